"""The sink strategies' own arguments, checked once at construction.

``SinkConfig`` holds what every sink strategy takes (accumulation, sinking, graph mode); the functions below check
the arguments the strategies pass on to Lightning's parents (device, process-group backend, timeout, DDP's own
keywords), which Lightning itself checks only when the run starts, if at all. Every failure names the argument, the value and what is valid.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from lightning_sink.accumulation import PARTIAL_WINDOW_MODES
from lightning_sink.counts import check_count_fits, is_int
from lightning_sink.devices import available_device_types, missing_device_reason
from lightning_sink.strategies.graph_modes import validate_graph_mode

__all__ = [
    "SinkConfig",
    "validate_device",
    "validate_process_group_backend",
    "validate_ddp_keywords",
    "validate_timeout",
]


# the fields that are counts, each bounded by what the process holds (counts.py)
_COUNTS = ("accumulation_steps", "sink_size", "prefetch_depth", "device_data_budget", "micro_steps_per_call")


@dataclass(frozen=True)
class SinkConfig:
    """Accumulation, sinking and graph-mode settings of a sink strategy (see ``SinkStrategy`` for their meaning)."""

    accumulation_steps: int | None = None
    partial_window: str = "scale"
    sink_size: int | None = None
    prefetch_depth: int | None = None
    graph_mode: str = "eager"
    checkpoint_random_state: bool = True
    checkpoint_digests: bool = True  # the .ckpt saves of SinkStrategy and SinkDDPStrategy (tensor_digests.py)
    device_data_budget: int | None = None  # bytes of training data the compiled programs may stage on the device
    # graph sinking: micro-batches per compiled call (sink/programs/compiled.py); None: from the step's size
    micro_steps_per_call: int | None = None

    def __post_init__(self) -> None:
        for name in _COUNTS:
            check_count_fits(name, getattr(self, name))
        steps, sink_size, depth = self.accumulation_steps, self.sink_size, self.prefetch_depth
        if steps is not None and not (is_int(steps) and steps >= 1):
            raise ValueError(
                f"accumulation_steps={steps!r} is not valid: pass an int >= 1 (micro-batches per optimizer update),"
                " or None to take Trainer(accumulate_grad_batches=...)."
            )
        if sink_size is not None and not (is_int(sink_size) and (sink_size >= 1 or sink_size == -1)):
            raise ValueError(
                f"sink_size={sink_size!r} is not valid: pass an int >= 1 (micro-batches per sink), -1 (one data pass per"
                " sink), or None (no sinking: one Lightning batch per micro-batch)."
            )
        if depth is not None and not (is_int(depth) and depth >= 0):
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
        budget = self.device_data_budget
        if budget is not None and not (is_int(budget) and budget >= 0):
            raise ValueError(
                f"device_data_budget={budget!r} is not valid: pass an int >= 0 (bytes of training data the compiled"
                " programs may stage on the device; 0 stages none) or None (a quarter of a CUDA device's memory; no"
                " limit on the CPU, where the data is in memory already)."
            )
        if not isinstance(self.checkpoint_digests, bool):
            raise TypeError(f"checkpoint_digests={self.checkpoint_digests!r} is not valid: pass True or False.")
        self._check_micro_steps_per_call()

    def _check_micro_steps_per_call(self) -> None:
        calls = self.micro_steps_per_call
        if calls is None:
            return  # the compiled programs decide from the step's size (compiled/call_length.py)
        if not (is_int(calls) and calls >= 1):
            raise ValueError(
                f"micro_steps_per_call={calls!r} is not valid: pass an int >= 1 (micro-batches per compiled call; 1"
                " runs one per call) or None (the default: decided from the step's size)."
            )
        if calls == 1:
            return
        if self.graph_mode == "eager" or self.sink_size is None:
            raise ValueError(
                f"micro_steps_per_call={calls} needs the compiled step programs of sink mode, but graph_mode="
                f"{self.graph_mode!r} and sink_size={self.sink_size!r}: set graph_mode='compile' (or 'cuda_graph')"
                " and sink_size=K (or -1), or leave micro_steps_per_call=None."
            )
        steps = self.accumulation_steps
        if steps is not None and calls % steps:
            raise ValueError(
                f"micro_steps_per_call={calls} is not valid with accumulation_steps={steps}: a call runs whole"
                f" windows, so pass a multiple of {steps} (or 1)."
            )


def validate_device(name: str, device: object) -> None:
    """``None``, or a ``torch.device``, device string or index naming a device this machine has."""
    if device is None:
        return
    if not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
        raise TypeError(
            f"{name}={device!r} is not valid: pass a device string ('cpu', 'cuda', 'cuda:1', ...), a"
            " torch.device, or None."
        )
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"{name}={device!r} is not a device torch knows: pass e.g. 'cpu', 'cuda', 'cuda:1', 'mps', a torch.device,"
            " or None."
        ) from None
    missing = missing_device_reason(parsed)
    if missing is not None:
        raise ValueError(
            f"{name}={device!r} is not valid: {missing}; pass a device this machine has"
            f" ({', '.join(map(repr, available_device_types()))}), or None to take the Trainer's accelerator."
        )


def _known_backends() -> list[str]:
    return [backend for backend in dist.Backend.backend_list if backend != "undefined"]


def validate_process_group_backend(backend: object, devices: Iterable[str | int | torch.device] | None = None) -> None:
    """``None`` (chosen by device), a backend torch.distributed knows, or a per-device list ('cpu:gloo,cuda:nccl');
    ``"nccl"`` alone only where it can work: CUDA available, and no non-CUDA device among ``devices``."""
    if backend is None:
        return
    known = _known_backends()
    names = [part.split(":")[-1] for part in backend.split(",")] if isinstance(backend, str) else [None]
    if not all(name in known for name in names):
        raise ValueError(
            f"process_group_backend={backend!r} is not valid: choose one of {', '.join(map(repr, known))}, a per-device"
            " list such as 'cpu:gloo,cuda:nccl', or None (gloo on CPU, nccl on CUDA)."
        )
    if backend != "nccl":
        return
    others = [str(device) for device in devices or () if torch.device(device).type != "cuda"]
    if not (torch.cuda.is_available() and dist.is_nccl_available()) or others:
        where = f"the devices {others}" if others else "this machine, which has no CUDA device"
        raise ValueError(
            f"process_group_backend={backend!r} cannot work on {where}: nccl needs CUDA devices. Use 'gloo' on CPU,"
            " or None (gloo on CPU, nccl on CUDA)."
        )


def validate_ddp_keywords(kwargs: Mapping[str, object]) -> None:
    """Every keyword is one ``DDPStrategy`` takes or one it hands to ``DistributedDataParallel`` (which it does only
    at fit, where an unknown one would fail deep inside DDP)."""
    strategy_names = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    ddp_names = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module", "device_ids"}
    unknown = sorted(set(kwargs) - strategy_names - ddp_names)
    if unknown:
        raise TypeError(
            f"SinkDDPStrategy got unknown keyword argument(s) {', '.join(f'{name}={kwargs[name]!r}' for name in unknown)}:"
            f" valid are this strategy's own, those of lightning's DDPStrategy ({', '.join(sorted(strategy_names))}) and"
            f" those of torch's DistributedDataParallel ({', '.join(sorted(ddp_names))})."
        )


def validate_timeout(timeout: object) -> None:
    """``None`` or a non-negative ``datetime.timedelta``."""
    if timeout is None:
        return
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout={timeout!r} is not valid: pass a datetime.timedelta >= 0 (or None).")
    if timeout < timedelta(0):
        raise ValueError(f"timeout={timeout!r} is negative: pass a datetime.timedelta >= 0 (or None).")
