"""The sink strategies' own arguments, checked once at construction.

``SinkConfig`` holds what every sink strategy takes (accumulation, sinking, graph mode); the functions below check
the arguments the strategies pass on to Lightning's parents (device, process-group backend, timeout), which Lightning
itself checks only when the run starts, if at all. Every failure names the argument, the value and what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_sink.accumulation import PARTIAL_WINDOW_MODES
from lightning_sink.strategies.graph_modes import validate_graph_mode

__all__ = ["SinkConfig", "validate_device", "validate_process_group_backend", "validate_timeout"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SinkConfig:
    """Accumulation, sinking and graph-mode settings of a sink strategy (see ``SinkStrategy`` for their meaning)."""

    accumulation_steps: int | None = None
    partial_window: str = "scale"
    sink_size: int | None = None
    prefetch_depth: int | None = None
    graph_mode: str = "eager"
    checkpoint_random_state: bool = True

    def __post_init__(self) -> None:
        steps, sink_size, depth = self.accumulation_steps, self.sink_size, self.prefetch_depth
        if steps is not None and not (_is_int(steps) and steps >= 1):
            raise ValueError(
                f"accumulation_steps={steps!r} is not valid: pass an int >= 1 (micro-batches per optimizer update),"
                " or None to take Trainer(accumulate_grad_batches=...)."
            )
        if sink_size is not None and not (_is_int(sink_size) and (sink_size >= 1 or sink_size == -1)):
            raise ValueError(
                f"sink_size={sink_size!r} is not valid: pass an int >= 1 (micro-batches per sink), -1 (one data pass per"
                " sink), or None (no sinking: one Lightning batch per micro-batch)."
            )
        if depth is not None and not (_is_int(depth) and depth >= 0):
            raise ValueError(
                f"prefetch_depth={depth!r} is not valid: pass an int >= 1 (batches a background thread reads"
                " ahead), 0 (read in the training thread) or None (2 on CUDA, 0 on CPU)."
            )
        if depth is not None and sink_size is None:
            raise ValueError(
                f"prefetch_depth={depth!r} applies to sink mode only, but sink_size=None: set sink_size=K (or -1) to"
                " sink, or leave prefetch_depth=None (outside sink mode Lightning's own loader iteration applies)."
            )
        if self.partial_window not in PARTIAL_WINDOW_MODES:
            raise ValueError(
                f"partial_window={self.partial_window!r} is not valid: choose one of"
                f" {', '.join(map(repr, PARTIAL_WINDOW_MODES))}."
            )
        validate_graph_mode(self.graph_mode)
        if not isinstance(self.checkpoint_random_state, bool):
            raise TypeError(
                f"checkpoint_random_state={self.checkpoint_random_state!r} is not valid: pass True (checkpoints save"
                " and resumes restore the global random generators: torch's, CUDA's, Python's, NumPy's) or False."
            )


def validate_device(name: str, device: object) -> None:
    """``None``, a ``torch.device``, or a string or index torch understands as a device."""
    if device is None or isinstance(device, torch.device):
        return
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise TypeError(
            f"{name}={device!r} is not valid: pass a device string ('cpu', 'cuda', 'cuda:1', ...), a"
            " torch.device, or None."
        )
    try:
        torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"{name}={device!r} is not a device torch knows: pass e.g. 'cpu', 'cuda', 'cuda:1', 'mps', a torch.device,"
            " or None."
        ) from None


def _known_backends() -> list[str]:
    return [backend for backend in dist.Backend.backend_list if backend != "undefined"]


def validate_process_group_backend(backend: object) -> None:
    """``None`` (chosen by device), a backend torch.distributed knows, or a per-device list ('cpu:gloo,cuda:nccl')."""
    if backend is None:
        return
    known = _known_backends()
    names = [part.split(":")[-1] for part in backend.split(",")] if isinstance(backend, str) else [None]
    if not all(name in known for name in names):
        raise ValueError(
            f"process_group_backend={backend!r} is not valid: choose one of {', '.join(map(repr, known))}, a per-device"
            " list such as 'cpu:gloo,cuda:nccl', or None (gloo on CPU, nccl on CUDA)."
        )


def validate_timeout(timeout: object) -> None:
    """``None`` or a non-negative ``datetime.timedelta``."""
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout={timeout!r} is not valid: pass a datetime.timedelta >= 0 (or None).")
    if timeout < timedelta(0):
        raise ValueError(f"timeout={timeout!r} is negative: pass a datetime.timedelta >= 0 (or None).")
