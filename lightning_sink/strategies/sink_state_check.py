"""The ``lightning_sink`` state of a checkpoint, checked before any of it is applied: a checkpoint is a file from
someone else's hands, and a count out of its range would otherwise change the training silently (a window closing
after the wrong number of micro-batches, a pass skipped whole).

Two checks, each failing with one line naming the file and the field:

- ``check_state_fields`` when the checkpoint is read: every field the strategies write has its type and sign, and
  the window's fields agree with each other (partial sums saved exactly when backward passes were counted).
- ``check_state_against_fit`` at train start, once the fit's settings and data are known: the open window holds
  fewer micro-batches than a window has, and the data position lies within the pass.

The fields are tables (``TOP_FIELDS``, ``WINDOW_FIELDS``, ``DATA_FIELDS``): a new field is one row. Fields a table
does not name are left alone, so a checkpoint with a field a later version added still loads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_sink.accumulation import PARTIAL_WINDOW_MODES
from lightning_sink.counts import is_int
from lightning_sink.random_state import is_valid_generator_state

__all__ = [
    "Field",
    "TOP_FIELDS",
    "WINDOW_FIELDS",
    "DATA_FIELDS",
    "FitFacts",
    "refuse_field",
    "window_micro_batches",
    "check_state_is_a_dict",
    "check_state_fields",
    "check_state_against_fit",
]

_SHOWN_CHARS = 60
_CPU_STATE_SHAPE = torch.get_rng_state().shape


@dataclass(frozen=True)
class Field:
    """One field of the state: whether a checkpoint must have it, the test of its value, and that test in words."""

    name: str
    required: bool
    accepts: Callable[[Any], bool]
    expected: str


def _int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: is_int(value) and value >= low


def _is_float_tensor(value: object) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _is_partial_sum(value: object) -> bool:
    """One rank's saved partial sum: the flat fp32 buffer, or (model-parallel) a list of local gradients or None."""
    if _is_float_tensor(value):
        return True
    return isinstance(value, (list, tuple)) and all(item is None or _is_float_tensor(item) for item in value)


def _is_generator_state(value: object) -> bool:
    """A generator's state; one of a CPU generator's size must be one torch accepts (a loader's generators are)."""
    if not (isinstance(value, Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        return False
    return value.shape != _CPU_STATE_SHAPE or is_valid_generator_state(value)


TOP_FIELDS = (
    Field("accumulation_steps", False, _int_at_least(1), "an int >= 1"),
    Field("sink_size", False, lambda v: v is None or (is_int(v) and (v >= 1 or v == -1)), "None, -1 or an int >= 1"),
    Field("partial_window", False, lambda v: v in PARTIAL_WINDOW_MODES, f"one of {PARTIAL_WINDOW_MODES}"),
    Field("window", False, lambda v: v is None or isinstance(v, dict), "None or a dict"),
    Field("data", True, lambda v: isinstance(v, dict), "a dict"),
    # each rank's generators; their contents are checked where they are restored (``random_state.py``)
    Field("random", False, lambda v: isinstance(v, list) and len(v) >= 1, "a list of each rank's random state"),
)
WINDOW_FIELDS = (
    Field("micro_steps", True, _int_at_least(0), "an int >= 0"),
    Field(
        "buffers",
        False,
        lambda v: v is None or (isinstance(v, list) and len(v) >= 1 and all(_is_partial_sum(item) for item in v)),
        "None or a list of floating-point partial sums, one per rank",
    ),
    Field("world_size", False, _int_at_least(1), "an int >= 1"),
    Field("micro_batches", False, _int_at_least(0), "an int >= 0"),
    Field("drop", False, lambda v: isinstance(v, bool), "a bool"),
    Field("overflowed", False, lambda v: isinstance(v, bool), "a bool"),
    Field("loss_divisor", False, _int_at_least(1), "an int >= 1"),
    Field("reached", False, lambda v: isinstance(v, list) and all(isinstance(x, bool) for x in v), "a list of bools"),
)
DATA_FIELDS = (
    Field("trained_in_pass", True, _int_at_least(0), "an int >= 0"),
    Field("pass_index", False, _int_at_least(0), "an int >= 0"),
    # sink mode: micro-batches of the sink in flight, and of the whole fit
    Field("trained_in_sink", False, _int_at_least(0), "an int >= 0"),
    Field("trained_total", False, _int_at_least(0), "an int >= 0"),
    Field("sink_open", False, lambda v: isinstance(v, bool), "a bool"),
    Field(
        "pass_start_generators",
        False,
        lambda v: isinstance(v, list) and all(_is_generator_state(item) for item in v),
        "a list of 1-D uint8 tensors (random generator states torch accepts)",
    ),
)


def _shown(value: object) -> str:
    """A value for an error message: scalars as written, anything else by its type (never a whole tensor)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        text = repr(value)
        return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def refuse_field(checkpoint_path: Any, field: str, value: object, expected: str) -> ValueError:
    """The error for a field of the 'lightning_sink' state out of its range: the file, the field, the value."""
    return ValueError(
        f"{checkpoint_path}: the checkpoint's 'lightning_sink' state is not valid: {field} is {_shown(value)},"
        f" expected {expected}"
    )


def _check_table(section: Mapping[str, Any], fields: tuple[Field, ...], prefix: str, checkpoint_path: Any) -> None:
    for field in fields:
        if field.name not in section:
            if field.required:
                raise ValueError(
                    f"{checkpoint_path}: the checkpoint's 'lightning_sink' state is not valid: {prefix}{field.name} is"
                    f" missing, expected {field.expected}"
                )
            continue
        value = section[field.name]
        if not field.accepts(value):
            raise refuse_field(checkpoint_path, prefix + field.name, value, field.expected)


def window_micro_batches(window: Mapping[str, Any], accumulation_steps: int | None) -> int:
    """Micro-batches of a saved window that is still open (0: closed). Its own count, or (checkpoints from before it
    was saved) its backward passes: a window whose every micro-batch returned ``None`` has micro-batches but no
    backward pass, and is open. A count of a whole window is a closed one the strategy had not reset yet (it resets a
    window of one micro-batch when the next begins)."""
    done = int(window.get("micro_batches", window.get("micro_steps", 0)))
    return 0 if accumulation_steps is not None and done >= accumulation_steps else done


def check_state_is_a_dict(state: object, checkpoint_path: Any) -> None:
    if not isinstance(state, dict):
        raise refuse_field(checkpoint_path, "the state", state, "a dict")


def check_state_fields(state: dict[str, Any], checkpoint_path: Any) -> None:
    """The fields' types and signs, and the window's internal agreement (called when the checkpoint is read)."""
    _check_table(state, TOP_FIELDS, "", checkpoint_path)
    _check_table(state["data"], DATA_FIELDS, "data.", checkpoint_path)
    window = state.get("window")
    if window is None:
        return
    _check_table(window, WINDOW_FIELDS, "window.", checkpoint_path)
    backward_passes, buffers = window["micro_steps"], window.get("buffers")
    if "micro_batches" in window and backward_passes > window["micro_batches"]:
        raise refuse_field(
            checkpoint_path,
            "window.micro_steps",
            backward_passes,
            f"at most window.micro_batches={window['micro_batches']} (a backward pass per micro-batch at most)",
        )
    if (buffers is not None) != (backward_passes > 0):
        expected = "saved partial sums" if backward_passes > 0 else "None (no backward pass in the window)"
        raise refuse_field(
            checkpoint_path, "window.buffers", buffers, f"{expected} with window.micro_steps={backward_passes}"
        )
    if buffers is not None and "world_size" in window and len(buffers) != window["world_size"]:
        raise refuse_field(
            checkpoint_path,
            "window.buffers",
            f"{len(buffers)} partial sums",
            f"one per rank (window.world_size={window['world_size']})",
        )


@dataclass(frozen=True)
class FitFacts:
    """What the fit knows at train start that bounds the state: its window length and its data pass length."""

    accumulation_steps: int
    batches_per_pass: int | None  # None: the loader has no length
    # Lightning's counters as restored, and what bounds them (progress_ranges.py); None: not known
    epoch: int | None = None
    global_step: int | None = None
    micro_batches_per_epoch: int | None = None
    automatic: bool = True  # automatic optimization: one update per micro-batch at most


def check_state_against_fit(state: Mapping[str, Any], fit: FitFacts, checkpoint_path: Any) -> None:
    """Counts within their ranges: the open window short of a whole window, the data position within the pass."""
    window = state.get("window") or {}
    # (an open window's settings equal this fit's: resume_check.py refuses other ones before this runs)
    steps = int(state.get("accumulation_steps", fit.accumulation_steps))
    # (a window of N micro-batches is updated inside its last one: N backward passes are never saved, while N
    # micro-batches are a window of one the strategy resets only when the next one begins)
    for name, limit, closes in (
        ("micro_steps", steps - 1, "its update follows the last"),
        ("micro_batches", steps, ""),
    ):
        value = window.get(name, 0)
        if value > limit:
            raise refuse_field(
                checkpoint_path,
                f"window.{name}",
                value,
                f"an int in [0, {limit}] (a window of accumulation_steps={steps}{', ' + closes if closes else ''})",
            )
    if window.get("micro_batches") == steps and window.get("micro_steps", 0) > 0:
        raise refuse_field(
            checkpoint_path,
            "window.micro_steps",
            window["micro_steps"],
            f"0 in a window whose {steps} micro-batches are done (window.micro_batches={steps})",
        )
    trained = state["data"]["trained_in_pass"]
    if fit.batches_per_pass is not None and trained > fit.batches_per_pass:
        raise refuse_field(
            checkpoint_path,
            "data.trained_in_pass",
            trained,
            f"an int in [0, {fit.batches_per_pass}] (the training data pass has {fit.batches_per_pass} batches)",
        )
