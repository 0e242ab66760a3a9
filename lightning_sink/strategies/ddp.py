"""``SinkDDPStrategy``: the step programs on torch DDP, one gradient reduction per window."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.strategies.config import (
    SinkConfig,
    validate_device,
    validate_process_group_backend,
    validate_timeout,
)
from lightning_sink.strategies.engine import StepEngineMixin
from lightning_sink.window import FlatAllReduce, NoReduction, Reducer

__all__ = ["SinkDDPStrategy"]


class SinkDDPStrategy(StepEngineMixin, DDPStrategy):
    """Gradient accumulation on ``DistributedDataParallel``, one gradient reduction per window.

    The model is still wrapped in DDP (rank 0's initial weights are broadcast, ``trainer.model`` is DDP as
    usual), but the strategy calls the LightningModule directly, so DDP's reducer never fires: micro-steps
    communicate nothing, and the window's update sums the fp32 window buffers of all ranks with a single
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
        self._init_engine(config)

    @override
    def setup_environment(self) -> None:
        backend = compat.process_group_backend(self)
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

    @override
    def _make_reducer(self) -> Reducer:
        if self.world_size == 1:
            return NoReduction()
        return FlatAllReduce(lambda: self.lightning_module.buffers())

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
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
        return (
            f"SinkDDPStrategy(accumulation_steps={self.accumulation_steps}, partial_window={self.partial_window!r},"
            f" sink_size={self.sink_size}, graph_mode={self.graph_mode!r})"
        )
