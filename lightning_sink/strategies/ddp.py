"""``SinkDDPStrategy``: the step programs on torch DDP, one gradient reduction per window."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.agreement import agree_on_checkpoint_path
from lightning_sink.checkpoint_format.ckpt_file import read_ckpt_file
from lightning_sink.checkpoint_format.resume_agreement import agree_on_resume
from lightning_sink.strategies import checkpoint_state
from lightning_sink.strategies.config import (
    SinkConfig,
    validate_ddp_keywords,
    validate_device,
    validate_process_group_backend,
    validate_timeout,
)
from lightning_sink.strategies.fit_lifecycle import SinkFit, WindowParts, fit_setting
from lightning_sink.strategies.sink_hooks import SinkStrategyHooks
from lightning_sink.window import FlatAllReduce, NoReduction, Reducer

__all__ = ["SinkDDPStrategy"]


class SinkDDPStrategy(SinkStrategyHooks, DDPStrategy):
    """Gradient accumulation on ``DistributedDataParallel``, one gradient reduction per window.

    The model is still wrapped in DDP (rank 0's initial weights are broadcast, ``trainer.model`` is DDP as
    usual), but the strategy calls the LightningModule directly, so DDP's reducer never fires: micro-steps
    communicate nothing, and the window's update sums the fp32 window buffers of all ranks with a single
    ``all_reduce``. Module buffers (e.g. BatchNorm statistics) are broadcast from rank 0 once per window, where
    DDP would do it before every forward.

    Args:
        accumulation_steps: micro-batches per optimizer update; see ``SinkStrategy``.
        partial_window: ``"scale"``, ``"drop"``, ``"carry"`` or ``"lightning"``; see ``SinkStrategy``.
        sink_size, prefetch_depth, graph_mode, checkpoint_random_state: sink mode, graph sinking and the random
            generators in checkpoints (per rank); see ``SinkStrategy``.
        checkpoint_digests: the tensor digests of each ``.ckpt``; see ``SinkStrategy``.
        device_data_budget: see ``SinkStrategy``; each process stages the training set and gathers the batches of its
            own share (the indices its ``DistributedSampler`` draws).
        micro_steps_per_call: micro-batches (whole windows) per compiled call with ``graph_mode="compile"`` in sink
            mode; see ``SinkStrategy``. Above 1, the window's sum across the processes is traced into the program (a
            functional all-reduce), as one call runs several updates. ``None`` (default): decided from the step's size
            as under ``SinkStrategy``, the same on every process (agreed after the build, which communicates
            nothing); 1: the sum by the reducer's own all-reduce, between two compiled parts.
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
        checkpoint_random_state: bool = True,
        checkpoint_digests: bool = True,
        device_data_budget: int | None = None,
        micro_steps_per_call: int | None = None,
        **kwargs: Any,
    ) -> None:
        config = SinkConfig(
            accumulation_steps,
            partial_window,
            sink_size,
            prefetch_depth,
            graph_mode,
            checkpoint_random_state=checkpoint_random_state,
            checkpoint_digests=checkpoint_digests,
            device_data_budget=device_data_budget,
            micro_steps_per_call=micro_steps_per_call,
        )
        validate_ddp_keywords(kwargs)
        for device in kwargs.get("parallel_devices") or ():
            validate_device("parallel_devices", device)
        validate_process_group_backend(kwargs.get("process_group_backend"), kwargs.get("parallel_devices"))
        validate_timeout(kwargs.get("timeout"))
        super().__init__(**kwargs)
        self.sink_fit = SinkFit(self, config)

    micro_steps_per_call = fit_setting("micro_steps_per_call")

    @override
    def setup_environment(self) -> None:
        backend = compat.process_group_backend(self)
        if backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"SinkDDPStrategy(process_group_backend='nccl') needs CUDA devices, but this run is on"
                f" {self.root_device.type!r}: use process_group_backend='gloo' (or None) on CPU."
            )
        super().setup_environment()
        # ranks agree on the one checkpoint they resume from, or all stop before anything is loaded
        compat.check_before_resume(self, partial(agree_on_resume, world_size=self.world_size))

    # ------------------------------------------------------------------ the parts this strategy passes
    def _window_parts(self) -> WindowParts:
        reducer: Reducer = NoReduction() if self.world_size == 1 else FlatAllReduce(self._module_buffers)
        return WindowParts(make_store=self.sink_fit.flat_store, reducer=reducer, ranks_in_sum=self.world_size)

    def _module_buffers(self) -> Iterator[torch.Tensor]:
        assert self.lightning_module is not None
        return self.lightning_module.buffers()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: the LightningModule is called directly, so DDP's reducer never fires."""
        yield

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint[checkpoint_state.CHECKPOINT_KEY] = self.sink_state_dict()
        if self.is_global_zero:  # (the rank that writes the file)
            self.sink_fit.seal(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # every rank reads the file from its own disk: they agree that they see the same one, or all stop here
        agree_on_checkpoint_path(Path(checkpoint_path), self.world_size)
        load = super().load_checkpoint
        checkpoint = read_ckpt_file(lambda: load(checkpoint_path, weights_only=weights_only), checkpoint_path)
        self.sink_fit.check_digests(checkpoint, checkpoint_path)  # before anything of it is restored
        self.sink_fit.restore(checkpoint, checkpoint_path)
        return checkpoint

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
