"""``SinkStrategy``: the step programs on one device."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.strategies.config import SinkConfig, validate_device
from lightning_sink.strategies.engine import StepEngineMixin

__all__ = ["SinkStrategy"]


class SinkStrategy(StepEngineMixin, SingleDeviceStrategy):
    """Gradient accumulation in fp32 window buffers on a single device.

    Args:
        accumulation_steps: micro-batches per optimizer update (N). ``None`` takes
            ``Trainer(accumulate_grad_batches=...)``; giving both with different values is an error.
        partial_window: what the last, incomplete window of an epoch does. ``"scale"`` (default) updates with the
            mean over its k micro-batches, exactly one batch of k*b; ``"drop"`` leaves those batches out of the
            epoch; ``"carry"`` keeps the window open into the next epoch.
        sink_size: micro-batches per sink (MindSpore's ``sink_size``): each Lightning epoch is one sink of K
            micro-batches drawn from an endless pass over the loader, run inside one Lightning batch. ``-1``: one
            data pass per sink; ``None`` (default): no sinking, one Lightning batch per micro-batch.
        prefetch_depth: micro-batches a background thread reads ahead in sink mode (on CUDA it also copies them to
            the GPU: pinned memory, non-blocking copies on a side stream); ``0`` reads in the training thread.
            ``None`` (default): 0 on CPU, and on CUDA for a ``DataLoader`` over in-memory tensors (read by
            indexing), where the thread's GIL hand-offs cost more than the reads it hides (measured in
            ``benchmarks/``); 2 on CUDA for other loaders. Set it for loaders that wait on I/O.
        graph_mode: ``"eager"`` (default); ``"compile"``: ``training_step`` and its backward compiled with
            ``torch.compile`` (both step programs share the forward and backward graphs); ``"cuda_graph"``: the
            same graphs captured as CUDA graphs (``torch.compile(mode="reduce-overhead")``), CUDA only.
        device: the device to train on; ``None`` takes the Trainer's accelerator (``cuda:0``, ``cpu``, ...).
    """

    strategy_name = "sink"

    def __init__(
        self,
        accumulation_steps: int | None = None,
        partial_window: str = "scale",
        sink_size: int | None = None,
        prefetch_depth: int | None = None,
        graph_mode: str = "eager",
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        config = SinkConfig(accumulation_steps, partial_window, sink_size, prefetch_depth, graph_mode)
        validate_device("device", device)
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._explicit_device = device is not None
        self._init_engine(config)

    # The accelerator connector reads this (refusing a device that contradicts ``Trainer(accelerator=...)``) and
    # fills it in when ``device=None``, so that the strategy follows ``Trainer(accelerator=..., devices=...)``.
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return [compat.single_device(self)] if self._explicit_device else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device | int | str]) -> None:
        if len(devices) != 1:
            raise ValueError(
                f"SinkStrategy runs on one device but the Trainer asks for {len(devices)} ({devices}); use"
                " strategy='sink_ddp' (SinkDDPStrategy) for several devices."
            )
        compat.set_single_device(self, torch.device(devices[0]))

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._configure_for_trainer(trainer)
        super().setup(trainer)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Two-step-program gradient accumulation on one device (lightning-sink)"
        )

    def __repr__(self) -> str:
        return (
            f"SinkStrategy(accumulation_steps={self.accumulation_steps}, partial_window={self.partial_window!r},"
            f" sink_size={self.sink_size}, graph_mode={self.graph_mode!r})"
        )
