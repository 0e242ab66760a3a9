"""``SinkDDPStrategy``: the step programs on torch DDP, one gradient reduction per window."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry
from typing_extensions import override

from lightning_sink.strategies.config import (SinkConfig, validate_device, validate_process_group_backend,
                                             validate_timeout)
from lightning_sink.strategies.step_programs import StepProgramsMixin

__all__ = ["SinkDDPStrategy"]


class SinkDDPStrategy(StepProgramsMixin, DDPStrategy):
    """Gradient accumulation with two step programs on ``DistributedDataParallel``.

    The model is still wrapped in DDP (rank 0's initial weights are broadcast, ``trainer.model`` is DDP as
    usual), but the step programs call the LightningModule directly, so DDP's reducer never fires: accumulate
    steps communicate nothing, and the update step sums the fp32 window buffers of all ranks with a single
    ``all_reduce``. Module buffers (e.g. BatchNorm statistics) are broadcast from rank 0 once per window, where
    DDP would do it before every forward.

    Args:
        accumulation_steps: micro-batches per optimizer update; see ``SinkStrategy``.
        partial_window: ``"scale"``, ``"drop"`` or ``"carry"``; see ``SinkStrategy``.
        sink_size, prefetch_depth, graph_mode: sink mode and graph sinking; see ``SinkStrategy``.
        **kwargs: everything ``lightning.pytorch.strategies.DDPStrategy`` takes (``process_group_backend``,
            ``start_method``, ``timeout``, ...).
    """

    strategy_name = "sink_ddp"

    def __init__(
        self,
        accumulation_steps: int | None = None,
        partial_window: str = "scale",
        sink_size: int | None = None,
        prefetch_depth: int | None = None,
        graph_mode: str = "eager",
        **kwargs: Any,
    ) -> None:
        config = SinkConfig(accumulation_steps, partial_window, sink_size, prefetch_depth, graph_mode)
        validate_process_group_backend(kwargs.get("process_group_backend"))
        validate_timeout(kwargs.get("timeout"))
        for device in kwargs.get("parallel_devices") or ():
            validate_device("parallel_devices", device)
        super().__init__(**kwargs)
        self._init_step_programs(config)

    @override
    def setup_environment(self) -> None:
        backend = self._process_group_backend
        if backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"SinkDDPStrategy(process_group_backend='nccl') needs CUDA devices, but this run is on"
                f" {self.root_device.type!r}: use process_group_backend='gloo' (or None) on CPU."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._configure_for_trainer(trainer)
        super().setup(trainer)

    def _sync_module_buffers(self) -> None:
        module = self.lightning_module
        assert module is not None
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Two-step-program gradient accumulation on DDP (lightning-sink)"
        )
        strategy_registry.register(
            "sink_ddp_spawn",
            cls,
            description="SinkDDPStrategy with spawned processes (lightning-sink)",
            start_method="spawn",
        )

    def __repr__(self) -> str:
        return (f"SinkDDPStrategy(accumulation_steps={self.accumulation_steps}, partial_window={self.partial_window!r},"
                f" sink_size={self.sink_size}, graph_mode={self.graph_mode!r})")

