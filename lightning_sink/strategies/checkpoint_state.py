"""The strategies' own checkpoint state: the open window, saved whole (every rank's partial sums and the window's
own fields, ``Window.state_dict``), and the data position.

Format (version 1): ``{"version", "accumulation_steps", "sink_size", "partial_window", "window", "data"}`` and,
unless the strategy was built with ``checkpoint_random_state=False``, ``"random"`` (every rank's global random
generators, ``random_state.py``; checkpoints without it load and leave the generators as they are), where
``window`` is ``None`` (no fit yet) or ``{"micro_steps", "buffers", "world_size", "micro_batches", "drop",
"overflowed", "loss_divisor"}``. Checkpoints written before the window's own fields were saved lack the last four;
they load as they did (the backward passes stand in for the micro-batches).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sink.checkpoint_format.sink_section import CHECKPOINT_KEY
from lightning_sink.data import DataPosition
from lightning_sink.strategies.engine import EngineHost
from lightning_sink.strategies.progress_ranges import check_lightning_counters
from lightning_sink.strategies.sink_state_check import check_state_fields, check_state_is_a_dict
from lightning_sink.window.state import Window

__all__ = ["CHECKPOINT_KEY", "gather_flat_buffers", "sink_state", "read_sink_state", "load_window"]

_STATE_VERSION = 1


def gather_flat_buffers(world_size: int) -> Callable[[Tensor], list[Tensor]]:
    """Every rank's flat partial sum (same shape on every rank), for a resume that is bit-identical."""

    def gather(buffer: Tensor) -> list[Tensor]:
        if world_size == 1:
            return [buffer]
        gathered = [torch.empty_like(buffer) for _ in range(world_size)]
        dist.all_gather(gathered, buffer)
        return gathered

    return gather


def _window_state(window: Window, gather: Callable[[Any], list[Any]], world_size: int) -> dict[str, Any]:
    state = window.state_dict()
    buffer = state.pop("buffer")
    # Each rank's partial sum differs; keep all of them so a resume is bit-identical.
    state["buffers"] = gather(buffer) if buffer is not None else None
    state["world_size"] = world_size
    return state


def sink_state(
    settings: dict[str, Any],
    window: Window | None,
    data_position: DataPosition,
    gather: Callable[[Any], list[Any]],
    host: EngineHost,
    random_states: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Called on every rank by ``Trainer.save_checkpoint``, so ``gather`` may be a collective. ``random_states``:
    every rank's global random generators (``random_state.gather_random_states``), saved as ``"random"``."""
    state = {
        "version": _STATE_VERSION,
        **settings,
        "window": _window_state(window, gather, host.world_size) if window is not None else None,
        "data": data_position.state_dict(),
    }
    if random_states is not None:
        state["random"] = random_states
    return state


def read_sink_state(checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any] | None:
    """The checkpoint's state (``None``: a stock checkpoint), its fields checked (``sink_state_check.py``)."""
    check_lightning_counters(checkpoint, checkpoint_path)
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is None:
        return None
    check_state_is_a_dict(state, checkpoint_path)
    if state.get("version") != _STATE_VERSION:
        raise ValueError(
            f"{checkpoint_path}: '{CHECKPOINT_KEY}' state has version {state.get('version')!r}; this"
            f" lightning-sink reads version {_STATE_VERSION}."
        )
    check_state_fields(state, checkpoint_path)
    return state


def load_window(window: Window, state: dict[str, Any], host: EngineHost) -> None:
    """Restore the saved window (its fields checked by ``read_sink_state``) into this fit's (its store exists by
    now)."""
    saved = state.get("window")
    if saved is None:
        return
    buffers = saved["buffers"]
    world_size = host.world_size
    if buffers is not None and len(buffers) != world_size:
        raise ValueError(
            f"The checkpoint was saved inside an accumulation window by {len(buffers)} ranks; resume it with"
            f" {len(buffers)} ranks (now {world_size}), or from a checkpoint saved at a window boundary."
        )
    buffer = buffers[host.global_rank] if buffers is not None else None
    window.load_state_dict({**saved, "buffer": buffer})
