"""Reading a whole-file Lightning checkpoint (a ``.ckpt``) through Lightning's own loading, its failures one line.

An empty or truncated file fails deep in torch (``EOFError`` with no message, ``OSError: [Errno 22]`` from the zip
reader, a zip-directory error of several sentences), naming no file; a file that is not Lightning's dict fails
later, far from its cause. Both become one ``ValueError`` naming the file and the reason. A missing file keeps
Lightning's own ``FileNotFoundError``, which names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_sink.error_text import reason_of

__all__ = ["read_ckpt_file"]


def read_ckpt_file(load: Callable[[], Any], checkpoint_path: Any) -> dict[str, Any]:
    """``load()`` (Lightning's load of ``checkpoint_path``), its failures as one line naming the file."""
    what = f"checkpoint {str(checkpoint_path)!r}"
    try:
        checkpoint = load()
    except FileNotFoundError:
        raise
    except Exception as error:  # (whatever torch's reader or unpickler raises on damaged bytes)
        raise ValueError(
            f"{what} could not be read: {type(error).__name__}: {reason_of(error)} (an empty, truncated or damaged"
            " file; save it again or resume from another checkpoint)"
        ) from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{what} holds a {type(checkpoint).__name__}, not the dict of a Lightning checkpoint")
    return checkpoint
