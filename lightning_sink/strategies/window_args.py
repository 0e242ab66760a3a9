"""The sink strategies' own constructor arguments, checked at construction."""

from __future__ import annotations

from lightning_sink.accumulation import PARTIAL_WINDOW_MODES

__all__ = ["validate_accumulation_args"]


def validate_accumulation_args(
    accumulation_steps: int | None, partial_window: str, sink_size: int | None = None,
    prefetch_depth: int | None = None,
) -> None:
    if accumulation_steps is not None and (
        isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1
    ):
        raise ValueError(
            f"accumulation_steps={accumulation_steps!r} is not valid: pass an int >= 1 (micro-batches per optimizer"
            " update), or None to take Trainer(accumulate_grad_batches=...)."
        )
    if sink_size is not None and (isinstance(sink_size, bool) or not isinstance(sink_size, int)
                                  or sink_size == 0 or sink_size < -1):
        raise ValueError(
            f"sink_size={sink_size!r} is not valid: pass an int >= 1 (micro-batches per sink), -1 (one data pass per"
            " sink), or None (no sinking: one Lightning batch per micro-batch)."
        )
    if prefetch_depth is not None and (isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int)
                                       or prefetch_depth < 0):
        raise ValueError(
            f"prefetch_depth={prefetch_depth!r} is not valid: pass an int >= 1 (batches a background thread reads"
            " ahead), 0 (read in the training thread) or None (2 on CUDA, 0 on CPU)."
        )
    if partial_window not in PARTIAL_WINDOW_MODES:
        raise ValueError(
            f"partial_window={partial_window!r} is not valid: choose one of {', '.join(map(repr, PARTIAL_WINDOW_MODES))}."
        )
