"""A sink strategy's fit lifecycle: its settings resolved against the Trainer, the collaborators chosen, the loop
rules installed at train start, and everything released at fit end. The step itself is in ``engine.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients, unique_trainable
from lightning_sink.data import DataPosition
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.indexed_batches import IndexedLoaderReads
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.sink_data import MicroBatchStream, SinkLoader, default_prefetch_depth
from lightning_sink.strategies.checkpoint_state import WindowCheckpointMixin
from lightning_sink.strategies.config import SinkConfig
from lightning_sink.strategies.fit_checks import (
    check_module_and_optimizer,
    draws_own_batches,
    settle_accumulation_steps,
)
from lightning_sink.strategies.graph_modes import check_graph_mode_device, step_function
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.strategies.resume_check import check_resume_settings
from lightning_sink.strategies.sink_logging import SinkLogBuffer
from lightning_sink.strategies.step_triggers import (
    ignore_one_batch_per_epoch_warning,
    warn_about_unaligned_step_triggers,
)
from lightning_sink.training_passes import TrainingPasses
from lightning_sink.window import GradientStore, NoGradients, NoReduction, Reducer

__all__ = ["FitLifecycleMixin"]


class FitLifecycleMixin(WindowCheckpointMixin):
    """Mixed into a Lightning ``Strategy`` subclass (through ``StepEngineMixin``); the subclass chooses the gradient
    store and the reducer (``_make_store`` and ``_make_reducer``)."""

    # Provided by the Strategy this is mixed into.
    lightning_module: pl.LightningModule | None
    precision_plugin: Any
    optimizers: list[Optimizer]
    world_size: int
    # Provided by StepEngineMixin (engine.py): the step these settings serve.
    _batch_has_no_update: Callable[[], bool]
    _window_backward_direct: Callable[..., Any]

    def _init_engine(self, config: SinkConfig) -> None:
        """``config`` holds the strategy's own arguments, validated at construction (``config.py``)."""
        self.sink_config = config
        self.sink_size, self.prefetch_depth, self.graph_mode = (
            config.sink_size,
            config.prefetch_depth,
            config.graph_mode,
        )
        self._requested_accumulation_steps = config.accumulation_steps
        self.accumulation_steps = config.accumulation_steps or 1
        self.partial_window = config.partial_window
        self._step_function: Callable[..., STEP_OUTPUT] | None = None
        self._sink_loader: SinkLoader | None = None
        self._stream: MicroBatchStream | None = None
        self._accumulator: GradientStore | None = None
        self._reducer: Reducer = NoReduction()
        self._data_position = DataPosition()
        self._passes = TrainingPasses(self._data_position)  # the loader outside sink mode (resume, "drop" length)
        self._indexed_reads = IndexedLoaderReads()  # outside sink mode: in-memory loaders read by indexing
        self._pending_state: dict[str, Any] | None = None
        self._pending_path: Any = None  # the checkpoint the pending state came from, for error messages
        self._log_buffer: SinkLogBuffer | None = None
        self._step_scheduler_configs: list[Any] = []
        self._needs_step_context = True
        self._scaling: LossScalePrecision | None = None
        self._passthrough = False  # N=1, one process, no loss scale, no sink: Lightning's own step, untouched
        self._hooks: HookPlan | None = None  # which hooks this fit uses (set at train start)
        self._direct_transfer = False  # batch_to_device may skip the transfer-hook dispatch (during a fit)
        self._store_params: tuple[int, ...] = ()
        self._in_update = False
        self._drop_window = False
        self._planned: tuple[int, bool] | None = None
        self._last_update_skipped = False
        self._sink_updates = 0
        self._counters: compat.UpdateCounters | None = None  # looked up at each sink's start
        self._store_checked = False  # whether this sink's direct path has checked the trainable set
        self._sink_window_batches = 0  # micro-batches of the open window in sink mode (None-returning ones too)
        self._step_takes_batch_idx = True
        self._work_before_step = True  # whether a single-step sink update has hooks or clipping before its step

    # ------------------------------------------------------------------ configuration
    @property
    def _trainer(self) -> pl.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @property
    def _accumulating(self) -> bool:
        """Whether the engine runs: automatic optimization is on (manual optimization is passed through)."""
        return self.lightning_module is not None and self.lightning_module.automatic_optimization

    @property
    def micro_steps_in_window(self) -> int | None:
        """In sink mode, micro-batches of the open window (0 right after an update); ``None`` otherwise, where a
        Lightning batch is one micro-batch and Lightning's own counters tell whether it closed a window."""
        if self._stream is None or not self._accumulating:
            return None
        return self._sink_window_batches

    @property
    def _loss_scaling(self) -> LossScalePrecision | None:
        plugin = self.precision_plugin
        return plugin if isinstance(plugin, LossScalePrecision) else None

    def _configure_for_trainer(self, trainer: pl.Trainer) -> None:
        """Settle accumulation and the precision plugin; called at the start of ``setup``."""
        scheduled = any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks)
        self.accumulation_steps = settle_accumulation_steps(
            type(self).__name__,
            self._requested_accumulation_steps,
            trainer.accumulate_grad_batches,
            scheduled,
            self.sink_size,
            trainer.lightning_module.automatic_optimization,
        )
        self._scheduled = scheduled
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            # Trainer(precision="16-mixed") on CUDA: Lightning's GradScaler would step the optimizer itself; use
            # the accumulating loss scaler instead (an explicit LossScalePrecision plugin is kept as given).
            self.precision_plugin = LossScalePrecision("16-mixed", DynamicLossScale(), device=plugin.device)
        if self.sink_size is not None:
            ignore_one_batch_per_epoch_warning()
        else:
            # Lightning's loop opens and closes windows with this (and divides each loss by it).
            trainer.accumulate_grad_batches = self.accumulation_steps

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer
        if trainer.state.stage != RunningStage.TRAINING or not self._accumulating:
            return dataloader
        if self.sink_size is not None:
            self._sink_loader = SinkLoader(dataloader)
            return self._sink_loader
        whole = self.accumulation_steps if self.partial_window == "drop" else None
        counts_batches = not draws_own_batches(trainer.lightning_module)
        # generators, "drop" epoch length, the resume position
        self._passes.take_loader(trainer, dataloader, whole_windows_of=whole, counts_batches=counts_batches)
        self._indexed_reads.take(dataloader)
        return dataloader

    # ------------------------------------------------------------------ collaborators (chosen by the strategy)
    def _make_store(self, params: list[torch.nn.Parameter]) -> GradientStore:
        """The window's gradient store; sharded strategies return their own (see ``model_parallel.py``)."""
        if self.accumulation_steps == 1 and self.world_size == 1 and self._scaling is None and not self._scheduled:
            return SingleStepGradients(params)  # nothing to sum, reduce or unscale
        return GradientAccumulator(params, follows_zero_grad=self._follows_zero_grad())

    def _make_reducer(self) -> Reducer:
        return NoReduction()

    def _follows_zero_grad(self) -> bool:
        """Windows that run across Lightning's zero-grad points (``carry``) reset only when they end."""
        return self.sink_size is not None or self.partial_window != "carry"

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if not self._accumulating:
            return
        trainer = self._trainer
        optimizers = self.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"{type(self).__name__} supports exactly one optimizer; got {len(optimizers)}.")
        self._scaling = self._loss_scaling
        check_module_and_optimizer(
            type(self).__name__,
            trainer.lightning_module,
            optimizers[0],
            accumulation_steps=self.accumulation_steps,
            sink_size=self.sink_size,
            scheduled=self._scheduled,
            world_size=self.world_size,
            loss_scaling=self._scaling is not None,
        )
        self._passthrough = (
            self.sink_size is None
            and self.accumulation_steps == 1
            and self.world_size == 1
            and self._scaling is None
            and not self._scheduled
        )
        self._step_scheduler_configs = [
            config
            for config in trainer.lr_scheduler_configs
            if config.interval == "step" and not config.reduce_on_plateau
        ]
        self._needs_step_context = self._plugin_has_step_context()
        self._hooks = HookPlan.for_run(trainer)
        self._direct_transfer = self._hooks.direct_transfer
        self._bind_direct_backward()
        self._reducer = self._make_reducer()
        self._accumulator, self._sink_window_batches = None, 0  # a fresh window for this fit
        self._refresh_store()
        check_graph_mode_device(self.graph_mode, self.root_device)  # type: ignore[attr-defined]
        self._step_function = step_function(self.lightning_module.training_step, self.graph_mode)
        # as Lightning builds the arguments: batch_idx only for a training_step that takes it
        self._step_takes_batch_idx = is_param_in_hook_signature(
            self.lightning_module.training_step, "batch_idx", min_args=2
        )
        if self._scaling is not None:
            self._scaling.to_device(self.root_device)  # type: ignore[attr-defined]
        if self._pending_state is not None:
            check_resume_settings(self._pending_state, self._window_settings(), self._pending_path)
            self._load_window_state(self._pending_state)
            self._pending_state = None
        if self.sink_size is None:
            self._passes.skip_trained_batches(trainer)  # after a mid-pass resume
        self._install_loop_rules(trainer)

    def _install_loop_rules(self, trainer: pl.Trainer) -> None:
        if self._sink_loader is not None:
            warn_about_unaligned_step_triggers(trainer, self.sink_size, self.accumulation_steps)
            self._stream = MicroBatchStream(
                self._sink_loader.loader, self._data_position, self._prefetch_depth(), copier=self._device_copier()
            )
            module = self.lightning_module
            self._log_buffer = SinkLogBuffer(module)
            compat.decide_window_ends(trainer, lambda: self._sink_updates == 0)
            compat.hold_step_schedulers(trainer, lambda: True)  # stepped per update by the sink loop
            compat.skip_lightning_backward(trainer, True)
            return
        if self.partial_window != "scale":
            compat.decide_window_ends(trainer, self._batch_has_no_update)
        if self._scaling is not None and self._step_scheduler_configs:
            compat.hold_step_schedulers(trainer, lambda: self._last_update_skipped)

    def _prefetch_depth(self) -> int:
        """``prefetch_depth``, or by default (``default_prefetch_depth``) from the device and the loader."""
        if self.prefetch_depth is not None:
            return self.prefetch_depth
        return default_prefetch_depth(self.root_device, self._sink_loader.loader)  # type: ignore[attr-defined, union-attr]

    def _device_copier(self) -> CudaBatchCopier | None:
        """On CUDA, the prefetch thread copies batches to the GPU, unless transfer hooks must run in this thread."""
        device = self.root_device  # type: ignore[attr-defined]
        if device.type != "cuda" or not self._hooks.direct_transfer or self._prefetch_depth() == 0:
            return None
        return CudaBatchCopier(device)

    def _refresh_store(self) -> None:
        """(Re)build the store when the optimizer's trainable parameters changed (param groups added by
        ``BaseFinetuning``, parameters unfrozen); called at window starts only, where the store is empty."""
        params = [p for group in self.optimizers[0].param_groups for p in group["params"]]
        key = tuple(id(p) for p in unique_trainable(params))
        if self._accumulator is not None and key == self._store_params:
            return
        if self._accumulator is not None:
            for param in params:
                param.grad = None  # the old store's views; the new window starts from zero
        self._store_params = key
        self._accumulator = self._make_store(params) if key else NoGradients()

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def on_train_end(self) -> None:
        self._close_stream()
        self._unbind_direct_backward()
        compat.remove_loop_overrides(self._trainer)
        super().on_train_end()  # type: ignore[misc]

    def teardown(self) -> None:
        self._close_stream()  # also when training raised and on_train_end never ran
        self._unbind_direct_backward()
        self._direct_transfer = False
        self._passes.release()
        self._indexed_reads.release()
        super().teardown()  # type: ignore[misc]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._sink_updates = 0
        self._passes.first_batch_started()
        if (
            self._accumulating
            and self.sink_size is None
            and self._trainer.accumulate_grad_batches != self.accumulation_steps
        ):
            self.accumulation_steps = self._trainer.accumulate_grad_batches  # a GradientAccumulationScheduler

    def _bind_direct_backward(self) -> None:
        """When nothing would run in Lightning's ``Strategy.backward`` but ``loss.backward()`` (no backward hooks,
        a plain precision plugin; see ``HookPlan``), this fit's backward calls it directly, skipping four hook
        dispatches per micro-batch. Not when ``backward`` is wrapped or replaced, on the class or on this object."""
        if self._hooks.direct_backward and not self._passthrough:  # (HookPlan: backward is Lightning's own)
            self.backward = self._window_backward_direct  # an attribute of this object, removed at fit end

    def _unbind_direct_backward(self) -> None:
        if self.__dict__.get("backward") == self._window_backward_direct:  # ours (not a wrapper someone put there)
            del self.backward

    def _plugin_has_step_context(self) -> bool:
        """Whether the precision plugin's step context does anything (autocast, ...); Lightning's base one does not."""
        kind = type(self.precision_plugin)
        return not (
            kind.train_step_context is Precision.train_step_context
            and kind.forward_context is Precision.forward_context
        )
