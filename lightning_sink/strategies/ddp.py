"""``SinkDDPStrategy``: the step programs on torch DDP, one gradient reduction per window."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.agreement import agree_on_checkpoint_path
from lightning_sink.checkpoint_format.ckpt_file import read_ckpt_file
from lightning_sink.checkpoint_format.resume_agreement import agree_on_resume
from lightning_sink.sink_data import SinkToken
from lightning_sink.strategies import checkpoint_state
from lightning_sink.strategies.config import (
    SinkConfig,
    validate_ddp_keywords,
    validate_device,
    validate_process_group_backend,
    validate_timeout,
)
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.fit_lifecycle import SinkFit, WindowParts, fit_setting
from lightning_sink.window import FlatAllReduce, NoReduction, Reducer

__all__ = ["SinkDDPStrategy"]


class SinkDDPStrategy(DDPStrategy):
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
        device_data_budget: see ``SinkStrategy``; the training data is staged on the device for one process only, so
            under DDP with several processes the batches keep the loader path (the fit's line on its programs says so).
        micro_steps_per_call: micro-batches (whole windows) per compiled call with ``graph_mode="compile"`` in sink
            mode; see ``SinkStrategy``. Above 1, the window's sum across the processes is traced into the program (a
            functional all-reduce), as one call runs several updates. ``None`` (default) runs one per call under
            several processes (the sum by the reducer's own all-reduce, between two compiled parts).
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

    accumulation_steps = fit_setting("accumulation_steps")
    partial_window = fit_setting("partial_window")
    sink_size = fit_setting("sink_size")
    prefetch_depth = fit_setting("prefetch_depth")
    graph_mode = fit_setting("graph_mode")
    micro_steps_per_call = fit_setting("micro_steps_per_call")
    sink_config = fit_setting("sink_config")
    micro_steps_in_window = fit_setting("micro_steps_in_window")
    # what tests and benchmarks look into
    _accumulator = fit_setting("store")
    _hooks = fit_setting("hooks")
    _data_position = fit_setting("data_position")

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

    # ------------------------------------------------------------------ the fit (SinkFit) and the step (StepEngine)
    @property
    def engine(self) -> StepEngine | None:
        """This fit's step engine (``None`` before train start and under manual optimization)."""
        return self.sink_fit.engine

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.sink_fit.configure_for_trainer(trainer)
        super().setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.sink_fit.process_dataloader(dataloader)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.sink_fit.start(self._window_parts())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.sink_fit.batch_started()

    @override
    def on_train_end(self) -> None:
        self.sink_fit.end()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self.sink_fit.teardown()
        super().teardown()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        engine = self.engine
        if engine is None:
            return super().training_step(*args, **kwargs)
        return self._run_sink() if self.sink_fit.sink_loop is not None else engine.training_step(*args, **kwargs)

    def accumulate_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The forward of a micro-batch that does not end its window; Lightning's closure runs its backward."""
        return self.sink_fit.running_engine().forward(*args, **kwargs)

    def update_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The window's last micro-batch (the closure) and the window's update."""
        return self.sink_fit.running_engine().update_step(optimizer, closure, **kwargs)

    def _run_sink(self) -> dict[str, Tensor] | None:
        return self.sink_fit.running_sink_loop().run()

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.engine is not None:
            self.engine.pre_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.post_backward()
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None or engine.passthrough:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.update_step(optimizer, closure, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.sink_fit.direct_transfer or isinstance(batch, SinkToken):
            return move_data_to_device(batch, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: the LightningModule is called directly, so DDP's reducer never fires."""
        yield

    # ------------------------------------------------------------------ checkpoints
    def sink_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly: the window, saved whole, and the data position."""
        return self.sink_fit.state_dict(checkpoint_state.gather_flat_buffers(self.world_size))

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
