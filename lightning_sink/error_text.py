"""A library's exception as one short line inside this package's own error messages.

torch's refusal of a pickle (``weights_only``) spans many lines and advises re-running with ``weights_only=False``,
which for a file from untrusted hands is the one thing not to do: keep only the line saying what was refused.
"""

from __future__ import annotations

__all__ = ["reason_of"]

_MAX_CHARS = 300


def reason_of(error: BaseException) -> str:
    """The gist of ``error`` on one line (at most a few hundred characters)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    refused = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    if refused:  # (torch's advice to allow the class or to unpickle everything is left out)
        what = refused[0].removeprefix("WeightsUnpickler error:").strip().split(" Please use", 1)[0]
        text = f"Weights only load failed: the pickle is not plain data ({what})"
    else:
        text = " ".join(lines) or type(error).__name__
    return text if len(text) <= _MAX_CHARS else text[: _MAX_CHARS - 3] + "..."
