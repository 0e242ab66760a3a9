"""The strategies' own checkpoint state: the open window's partial sums and the data position."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sink.data import DataPosition
from lightning_sink.window import GradientStore

__all__ = ["CHECKPOINT_KEY", "WindowCheckpointMixin"]

CHECKPOINT_KEY = "lightning_sink"
_STATE_VERSION = 1


class WindowCheckpointMixin:
    """Saves and restores the window and data position of a sink strategy (mixed in with ``StepEngineMixin``)."""

    _accumulator: GradientStore | None
    _data_position: DataPosition
    _pending_state: dict[str, Any] | None
    accumulation_steps: int
    sink_size: int | None
    partial_window: str
    world_size: int

    def _window_state(self) -> dict[str, Any] | None:
        if self._accumulator is None:
            return None
        state = self._accumulator.state_dict()
        buffer = state.pop("buffer")
        # Each rank's partial sum differs; keep all of them so a resume is bit-identical.
        state["buffers"] = self._gather_buffers(buffer) if buffer is not None else None
        state["world_size"] = self.world_size
        return state

    def _gather_buffers(self, buffer: Tensor) -> list[Tensor]:
        if self.world_size == 1:
            return [buffer]
        gathered = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(gathered, buffer)
        return gathered

    def _load_window_state(self, state: dict[str, Any]) -> None:
        window = state.get("window")
        if window is None:
            return
        assert self._accumulator is not None
        buffers = window["buffers"]
        if buffers is not None and len(buffers) != self.world_size:
            raise ValueError(
                f"The checkpoint was saved inside an accumulation window by {len(buffers)} ranks; resume it with"
                f" {len(buffers)} ranks (now {self.world_size}), or from a checkpoint saved at a window boundary."
            )
        rank = getattr(self, "global_rank", 0)
        buffer = buffers[rank] if buffers is not None else None
        self._accumulator.load_state_dict({"micro_steps": window["micro_steps"], "buffer": buffer})
        if self.sink_size is not None:
            self._sink_window_batches = int(window["micro_steps"])

    def _window_settings(self) -> dict[str, Any]:
        """The arguments an open window was accumulated under (checked on resume: ``resume_check.py``)."""
        return {
            "accumulation_steps": self.accumulation_steps,
            "sink_size": self.sink_size,
            "partial_window": self.partial_window,
        }

    def sink_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly: window buffers, micro-step index, data position."""
        return {
            "version": _STATE_VERSION,
            **self._window_settings(),
            "window": self._window_state(),
            "data": self._data_position.state_dict(),
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Called on every rank by Trainer.save_checkpoint, so the gather above is safe.
        checkpoint[CHECKPOINT_KEY] = self.sink_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self._restore_sink_state(checkpoint, checkpoint_path)
        return checkpoint

    def _restore_sink_state(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """Take this package's state from a loaded checkpoint (also called for resharded checkpoints)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(
                    f"{checkpoint_path}: '{CHECKPOINT_KEY}' state has version {state.get('version')!r}; this"
                    f" lightning-sink reads version {_STATE_VERSION}."
                )
            # The data position must be known before Lightning first iterates the loader; the window buffers
            # are applied in on_train_start, once they exist.
            self._data_position.load_state_dict(state["data"])
            self._pending_state, self._pending_path = state, checkpoint_path
