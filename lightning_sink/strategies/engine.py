"""The step engine shared by every sink strategy: MindSpore's accumulation semantics inside Lightning's loop.

Without sinking, Lightning's automatic optimization drives each micro-batch as it does for any strategy: the
zero-grad hooks at a window's first batch, ``training_step``, the backward, and at the window's last batch the
``LightningModule.optimizer_step`` hook, the progress counters and the LR schedulers. The engine sits in the
extension points a strategy owns:

1. ``training_step`` calls the LightningModule directly (DDP's reducer never fires; ``graph_mode`` applies);
2. ``pre_backward`` lets the gradient store prepare ``.grad`` (the fp32 window sum) before Lightning's own
   ``backward`` (and its hooks) backpropagates, ``post_backward`` closes the micro-step;
3. ``optimizer_step`` (reached through the module's ``optimizer_step`` hook and ``optimizer.step(closure)``) ends
   the window. Without a loss scale, as Lightning's own precision plugin, it hands ``optimizer.step`` a closure
   that runs the window's last micro-batch, then readies the mean gradient (one reduction, the division,
   ``on_before_optimizer_step`` and clipping); with one, as Lightning's mixed precision, it runs the closure,
   then ``finish_window``: reduction, divide/unscale, the hooks and clipping, step or skip, loss-scale update.

Lightning divides each loss by ``accumulate_grad_batches`` (N); a window of k micro-steps that returned a loss
is divided by k/N at its end, so every update is the mean over its micro-batches. With sinking (``sink_size``) a
Lightning batch is a whole sink; ``_run_sink`` below runs its micro-steps and calls the same hooks, in the same
order, as Lightning would per micro-batch and per update (see ``docs/lightning-compatibility.md``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import (
    GradientAccumulator,
    MicroStep,
    SingleStepGradients,
    plan_micro_step,
    unique_trainable,
)
from lightning_sink.data import DataPosition
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.sink_data import PASS_END, MicroBatchStream, SinkLoader, SinkToken
from lightning_sink.strategies.checkpoint_state import (
    CHECKPOINT_KEY,
    WindowCheckpointMixin,
)
from lightning_sink.strategies.config import SinkConfig
from lightning_sink.strategies.graph_modes import check_graph_mode_device, step_function
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.strategies.resume_check import check_resume_settings
from lightning_sink.strategies.sink_logging import SinkLogBuffer
from lightning_sink.strategies.step_triggers import (
    ignore_one_batch_per_epoch_warning,
    warn_about_unaligned_step_triggers,
)
from lightning_sink.training_passes import TrainingPasses
from lightning_sink.window import (
    GradientStore,
    NoGradients,
    NoReduction,
    Reducer,
    finish_window,
    ready_window_gradient,
)

__all__ = ["StepEngineMixin", "CHECKPOINT_KEY"]


def _loss_of(output: STEP_OUTPUT) -> Tensor | None:
    """The loss in a ``training_step`` output, or ``None`` (the micro-batch is skipped, as in Lightning).

    An output without a loss raises Lightning's own ``MisconfigurationException``, as its closure does."""
    if type(output) is Tensor or isinstance(output, Tensor):  # the type check first: isinstance costs ~0.5 us
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    return ClosureResult.from_training_step_output(output).closure_loss  # None, or Lightning's own error


def _draws_own_batches(module: pl.LightningModule) -> bool:
    """``training_step(dataloader_iter)``: the module fetches its batches, so a step need not be one batch."""
    return is_param_in_hook_signature(module.training_step, "dataloader_iter", explicit=True)


def _forget_gradients(optimizer: Optimizer) -> None:
    """``zero_grad(set_to_none=True)`` without calling the optimizer's own ``zero_grad`` (whose calls users count)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def _needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure that re-evaluates the loss (``torch.optim.LBFGS``, ...)."""
    try:
        parameter = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


class StepEngineMixin(WindowCheckpointMixin):
    """Mixed into a Lightning ``Strategy`` subclass; the subclass chooses the gradient store and the reducer
    (``_make_store`` and ``_make_reducer``)."""

    # Provided by the Strategy this is mixed into.
    lightning_module: pl.LightningModule | None
    precision_plugin: Any
    optimizers: list[Optimizer]
    world_size: int

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
        requested, from_trainer = self._requested_accumulation_steps, trainer.accumulate_grad_batches
        scheduled = any(isinstance(callback, GradientAccumulationScheduler) for callback in trainer.callbacks)
        if requested is not None and scheduled:
            raise ValueError(
                f"{type(self).__name__}(accumulation_steps={requested}) and a GradientAccumulationScheduler callback"
                " both set the window size: pass accumulation_steps=None to let the scheduler choose it per epoch."
            )
        if scheduled and self.sink_size is not None:
            raise ValueError(
                f"GradientAccumulationScheduler changes the window size per epoch, but {type(self).__name__}"
                f"(sink_size={self.sink_size}) runs windows across sinks (its epochs): give accumulation_steps"
                " instead, or train without sink_size."
            )
        if requested is not None and from_trainer not in (1, requested):
            raise ValueError(
                f"{type(self).__name__}(accumulation_steps={requested}) conflicts with"
                f" Trainer(accumulate_grad_batches={from_trainer}): set one of them, or both to the same value."
            )
        self.accumulation_steps = requested or from_trainer
        self._scheduled = scheduled
        module = trainer.lightning_module
        if not module.automatic_optimization and self.accumulation_steps > 1:
            raise ValueError(
                f"{type(self).__name__}(accumulation_steps={self.accumulation_steps}) accumulates for automatic"
                " optimization only, but this LightningModule sets `automatic_optimization = False`. Set"
                " accumulation_steps=1 and accumulate by hand: call `self.manual_backward(loss / N)` on every batch"
                " and `opt.step(); opt.zero_grad()` on every N-th batch."
            )
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
        counts_batches = not _draws_own_batches(trainer.lightning_module)
        # generators, "drop" epoch length, the resume position
        self._passes.take_loader(trainer, dataloader, whole_windows_of=whole, counts_batches=counts_batches)
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
        self._check_fit_start(trainer, optimizers[0])
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

    def _check_fit_start(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        windows = self.sink_size is not None or self.accumulation_steps > 1 or self._scheduled
        why = (
            f"sink_size={self.sink_size}"
            if self.sink_size is not None
            else f"accumulation_steps={self.accumulation_steps}"
        )
        if windows and _draws_own_batches(trainer.lightning_module):
            raise ValueError(
                f"training_step(dataloader_iter) draws its own batches, but {type(self).__name__}({why}) must see"
                " every micro-batch to close its windows: take `batch` (and `batch_idx`) instead, or train with"
                " accumulation_steps=1 and no sink_size."
            )
        passes_closure = self.sink_size is None and self.accumulation_steps == 1 and self.world_size == 1
        if _needs_closure(optimizer) and not (passes_closure and self._loss_scaling is None):
            raise ValueError(
                f"{type(optimizer).__name__}.step needs a closure that re-evaluates the loss, but"
                f" {type(self).__name__}({why}, {self.world_size} process(es)) steps once per window on its averaged"
                " gradient and cannot re-run the window's micro-batches: use it with accumulation_steps=1, no"
                " sink_size, one process and no loss scale, or choose an optimizer that steps without a closure."
            )

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
        """``prefetch_depth``, or by default: 2 on CUDA (the thread's copies overlap compute); 0 on CPU."""
        if self.prefetch_depth is not None:
            return self.prefetch_depth
        return 2 if self.root_device.type == "cuda" else 0  # type: ignore[attr-defined]

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

    # ------------------------------------------------------------------ windows that Lightning does not delimit
    def _plan_micro_step(self) -> MicroStep:
        return plan_micro_step(
            self._accumulator.micro_steps,
            self.accumulation_steps,
            compat.is_last_batch_of_epoch(self._trainer),
            self.partial_window,
        )

    def _batch_has_no_update(self) -> bool:
        """Lightning asks this several times per batch (``carry`` and ``drop``); decided once, before the batch."""
        batch_key = self._trainer.fit_loop.total_batch_idx
        if self._planned is None or self._planned[0] != batch_key:
            self._planned = (batch_key, self._plan_micro_step() is MicroStep.UPDATE)
        return not self._planned[1]

    # ------------------------------------------------------------------ one micro-batch, in call order
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """Lightning's closure calls this first (the window's last micro-batch: from inside ``optimizer_step``)."""
        if not self._accumulating:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        if self._stream is not None:
            return self._run_sink()
        if self.partial_window != "scale":
            self._batch_has_no_update()  # fix the plan for this batch before its state changes
            self._drop_window = self._plan_micro_step() is MicroStep.ACCUMULATE_THEN_DROP
        elif self._accumulator.micro_steps and self._trainer.fit_loop.batch_idx % self.accumulation_steps == 0:
            self._accumulator.end_window()  # an optimizer_step hook that ran the closure without stepping
        if self._in_update or self._passthrough:
            output = self._forward(*args, **kwargs)
        else:
            output = self.accumulate_step(*args, **kwargs)
        self._passes.batch_trained(compat.is_last_batch_of_epoch(self._trainer))  # (sinks count their own)
        return output

    def accumulate_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The forward of a micro-batch that does not end its window; Lightning's closure runs its backward."""
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        skip_backward = self._window_already_overflowed()
        if self._scaling is not None:
            self._scaling.skip_backward = skip_backward  # the plugin's backward (and _direct_backward) skip it
        if not self._needs_step_context and not skip_backward and torch.is_grad_enabled():
            output = self._step_function(*args, **kwargs)  # nothing to enter: the contexts cost a few us a step
        else:
            with self.precision_plugin.train_step_context(), torch.set_grad_enabled(not skip_backward):
                output = self._step_function(*args, **kwargs)
        if output is None and self.world_size > 1:
            # Lightning's own rule (its loop raises the same): the ranks' reductions would no longer pair up
            raise RuntimeError(
                "Skipping the `training_step` by returning None in distributed training is not supported: every"
                " rank must contribute to each window's gradient reduction."
            )
        return output

    @contextmanager
    def block_backward_sync(self) -> Any:
        """Nothing to block: the LightningModule is called directly, so DDP's reducer never fires."""
        yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Before Lightning's backward (and its hooks): the store prepares ``.grad`` (the window's fp32 sum).

        The engine lives in ``pre_backward``/``post_backward`` rather than ``backward``, so ``Strategy.backward``
        stays Lightning's own (what code that wraps or counts it expects)."""
        super().pre_backward(closure_loss)  # type: ignore[misc]
        if not self._accumulating or self._passthrough:
            return
        store = self._accumulator
        if store.micro_steps == 0:
            self._refresh_store()
            store = self._accumulator
        store.begin_micro_step(self._in_update or self._drop_window)

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._accumulating and not self._passthrough:
            self._accumulator.end_micro_step()
            if self._drop_window:
                self._accumulator.clear()  # the epoch ends inside a window under "drop": discard it
                self._drop_window = False
        super().post_backward(closure_loss)  # type: ignore[misc]

    def _bind_direct_backward(self) -> None:
        """When nothing would run in Lightning's ``Strategy.backward`` but ``loss.backward()`` (no backward hooks,
        a plain precision plugin; see ``HookPlan``), this fit's backward calls it directly, skipping four hook
        dispatches per micro-batch. Not when ``backward`` is wrapped or replaced, on the class or on this object."""
        if self._hooks.direct_backward and not self._passthrough:  # (HookPlan: backward is Lightning's own)
            self.backward = self._window_backward_direct  # an attribute of this object, removed at fit end

    def _unbind_direct_backward(self) -> None:
        if self.__dict__.get("backward") == self._window_backward_direct:  # ours (not a wrapper someone put there)
            del self.backward

    def _window_backward_direct(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        if args or kwargs:  # arguments for Tensor.backward: Lightning's path hands them on
            return Strategy.backward(self, closure_loss, optimizer, *args, **kwargs)  # type: ignore[arg-type]
        self.pre_backward(closure_loss)
        self._direct_backward(closure_loss)
        self.post_backward(closure_loss)
        return closure_loss

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Without transfer hooks to run (``HookPlan``), the move itself, without dispatching to nobody. A sink's
        placeholder batch stays as it is: the transfer hooks see each real micro-batch instead (``_to_device``)."""
        if self._direct_transfer or isinstance(batch, SinkToken):
            return move_data_to_device(batch, device or self.root_device)  # type: ignore[attr-defined]
        return super().batch_to_device(batch, device, dataloader_idx)  # type: ignore[misc]

    def _direct_backward(self, loss: Tensor) -> None:
        """What Lightning's backward does with a plain precision plugin and no hooks: scale, backpropagate."""
        scaling = self._scaling
        if scaling is None:
            loss.backward()
        elif not scaling.skip_backward:  # the window already overflowed: its forward ran without autograd
            (loss if scaling.scaler is None else loss * scaling.scaler.scale.to(loss.dtype)).backward()

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Reached from the module's ``optimizer_step`` hook through ``optimizer.step(closure=...)``."""
        if not self._accumulating or self._passthrough:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        return self.update_step(optimizer, closure, **kwargs)

    def update_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The window's last micro-batch (the closure: forward, backward) and the window's update."""
        scaling = self._scaling
        if scaling is None:
            return self._update_inside_step(optimizer, closure, **kwargs)
        loss = self._last_micro_step(closure)
        store = self._accumulator
        if store.micro_steps == 0:
            return loss  # no micro-batch of this window returned a loss: nothing to apply
        found_inf = finish_window(
            store,
            self._reducer,
            scaling,
            optimizer,
            self._window_divisor(),
            lambda: self._before_optimizer_step(optimizer),
            **kwargs,
        )
        self._last_update_skipped = bool(self._step_scheduler_configs) and scaling.window_overflowed(found_inf)
        self._log_loss_scale(scaling, found_inf)
        return loss

    def _update_inside_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """``optimizer.step(closure)`` as Lightning's fp32 precision plugin calls it: the optimizer enters its
        ``step``, runs the closure (the window's last micro-batch, then its mean gradient, hooks and clipping),
        then updates, so an optimizer's own ``step`` sees the calls in stock Lightning's order. A window where no
        ``training_step`` returned a loss has no gradient: ``.grad`` is ``None``, so the step changes nothing."""
        store = self._accumulator

        def window_closure() -> Any:
            loss = self._last_micro_step(closure)
            if store.micro_steps:
                ready_window_gradient(
                    store, self._reducer, None, self._window_divisor(), lambda: self._before_optimizer_step(optimizer)
                )
            else:
                _forget_gradients(optimizer)
            return loss

        self._last_update_skipped = False
        output = optimizer.step(closure=window_closure, **kwargs)
        if store.micro_steps:
            store.end_window()
        return output

    def _last_micro_step(self, closure: Callable[[], Any]) -> Any:
        self._in_update = True
        try:
            return closure()
        finally:
            self._in_update = False

    def _window_divisor(self) -> float:
        """Lightning divided every loss by N; the mean over the k micro-steps (on every rank) divides by k/N more."""
        return self._accumulator.micro_steps * self._ranks_in_sum() / self._loss_divisor()

    def _ranks_in_sum(self) -> int:
        """Ranks whose gradients the reduced window sums (FSDP2's reduce-scatter averages them already)."""
        return self.world_size

    def _loss_divisor(self) -> int:
        """What each micro-step's loss was divided by before backward: Lightning's ``accumulate_grad_batches``
        (the sink's hook path divides as Lightning does), 1 on the sink's direct path."""
        if self._stream is not None and self._hooks.direct_sink_step:
            return 1
        return self.accumulation_steps

    def _plugin_has_step_context(self) -> bool:
        """Whether the precision plugin's step context does anything (autocast, ...); Lightning's base one does not."""
        kind = type(self.precision_plugin)
        return not (
            kind.train_step_context is Precision.train_step_context
            and kind.forward_context is Precision.forward_context
        )

    def _window_already_overflowed(self) -> bool:
        scaling = self._scaling
        if scaling is None or not scaling.skip_window_on_overflow or self._accumulator.micro_steps == 0:
            return False
        return bool(self._accumulator.has_overflow().item())  # host sync: opted in, one per micro-step

    def _before_optimizer_step(self, optimizer: Optimizer) -> None:
        trainer = self._trainer
        if not self._hooks.direct_before_step:
            compat.run_before_optimizer_step(trainer, optimizer)  # on_before_optimizer_step hooks, then clipping
        elif trainer.gradient_clip_val:
            self.precision_plugin.clip_gradients(
                optimizer, trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm"
            )

    def _log_loss_scale(self, scaling: LossScalePrecision, found_inf: Tensor | None) -> None:
        """Device tensors into Lightning's logger; they are read back only when the logger writes."""
        if scaling.scaler is None or found_inf is None or not self._trainer.loggers:
            return  # Lightning's self.log costs ~0.1 ms a call; nothing would read these without a logger
        module = self.lightning_module
        for name, value in (
            ("loss_scale", scaling.scaler.scale),
            ("overflow", found_inf),
            ("skipped_updates", scaling.scaler.skipped),
        ):
            # float: Lightning warns when it converts an integer tensor for the logger itself
            module.log(name, value.to(torch.float32, copy=True), on_step=True, on_epoch=False, batch_size=1)

    def _step_lr_schedulers(self, trainer: pl.Trainer) -> None:
        for config in self._step_scheduler_configs:
            if trainer.global_step % config.frequency == 0:
                compat.call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)

    # ------------------------------------------------------------------ the sink loop
    def _run_sink(self) -> dict[str, Tensor] | None:
        """K micro-steps inside one Lightning batch; nothing is read back to the host (losses stay on the device).

        Windows run on across sinks and data passes (the data is one endless stream), so ``partial_window`` does
        not apply here. A ``max_steps`` reached inside the sink ends it; the data position records what was trained.
        ``self.log`` calls are recorded during the sink and handed to Lightning at its end (``sink_logging.py``).
        """
        buffer = self._log_buffer
        if buffer is None:
            return self._run_micro_steps()
        buffer.install()
        try:
            output = self._run_micro_steps()
            buffer.flush()
        finally:
            buffer.uninstall()
        return output

    def _run_micro_steps(self) -> dict[str, Tensor] | None:
        trainer, stream, buffer = self._trainer, self._stream, self._log_buffer
        self._counters = compat.UpdateCounters(trainer)
        self._store_checked = False
        # the updates this sink may make before max_steps (global_step moves only through this sink's updates)
        updates_allowed = trainer.max_steps - trainer.global_step if trainer.max_steps != -1 else -1
        # Batches need moving unless the stream's thread already did, or they are for the CPU and no transfer hook
        # runs (a loader's batches are on the CPU already; walking them costs ~10 us a step).
        to_device = stream.copier is None and not (self._direct_transfer and self.root_device.type == "cpu")
        # Lightning's loop converted only the sink's placeholder; "16-true" and the like convert each real batch.
        converts_input = type(self.precision_plugin).convert_input is not Precision.convert_input  # type: ignore[attr-defined]
        direct = self._hooks.direct_sink_step
        losses: list[Tensor] = []
        micro_index = 0
        while self.sink_size == -1 or micro_index < self.sink_size:
            if updates_allowed != -1 and self._sink_updates >= updates_allowed:
                break
            batch = stream.next()
            if batch is PASS_END:
                if self.sink_size == -1 and micro_index:
                    break  # one data pass per sink
                continue
            if converts_input:
                batch = self.precision_plugin.convert_input(batch)  # type: ignore[attr-defined]
            if to_device:
                batch = self._to_device(batch)
            if buffer is not None:
                buffer.begin_micro_step(batch)
            loss = (
                self._sink_micro_step_direct(batch, micro_index)
                if direct
                else self._sink_micro_step(batch, micro_index)
            )
            if loss is not None:
                losses.append(loss)
            self._data_position.advance()
            micro_index += 1
            if self._sink_window_batches == 0 and buffer is not None:
                buffer.end_update()  # the loggers get this update's values at its step (sink_logging.py)
        compat.set_logging_step(trainer, updated=self._sink_updates > 0)
        if not losses:
            return None  # every micro-batch returned None: Lightning skips the batch, as for a None step
        stacked = torch.stack(losses)
        return {"loss": stacked[-1], "mean_loss": stacked.mean(), "losses": stacked}

    def _step_args(self, batch: Any, batch_idx: int) -> tuple[Any, ...]:
        return (batch, batch_idx) if self._step_takes_batch_idx else (batch,)

    def _count_sink_update(self, run_update: Callable[[], Any]) -> None:
        """One update, counted as Lightning counts its own; then the step-interval LR schedulers."""
        self._counters.update_ready()
        run_update()
        self._counters.update_completed()
        self._sink_updates += 1
        if self._step_scheduler_configs and not self._last_update_skipped:
            self._step_lr_schedulers(self._trainer)

    def _sink_micro_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        """One micro-batch with every hook, in Lightning's order: ``training_step``; at a window's first batch
        ``on_before_zero_grad`` and ``optimizer_zero_grad``; the backward hooks; at its last batch the module's
        ``optimizer_step`` hook, whose ``optimizer.step(closure)`` runs this micro-batch and the update."""
        trainer, optimizer = self._trainer, self.optimizers[0]
        starts = self._sink_window_batches == 0
        result: list[Tensor | None] = [None]

        def closure() -> Tensor | None:
            output = self._forward(*self._step_args(batch, batch_idx))
            step = ClosureResult.from_training_step_output(output, self.accumulation_steps)
            if starts:
                compat.run_zero_grad(trainer, batch_idx, optimizer)
            if step.closure_loss is not None:
                self.backward(step.closure_loss, optimizer)
                result[0] = step.loss
            return step.loss

        if starts and self._accumulator.micro_steps:
            self._accumulator.end_window()  # an optimizer_step hook that ran the closure without stepping
        self._sink_window_batches += 1
        if self._sink_window_batches < self.accumulation_steps:
            closure()
            return result[0]
        self._sink_window_batches = 0
        self._count_sink_update(
            lambda: compat.call_lightning_module_hook(
                trainer, "optimizer_step", trainer.current_epoch, batch_idx, compat.lightning_optimizer(self), closure
            )
        )
        return result[0]

    def _sink_micro_step_direct(self, batch: Any, batch_idx: int) -> Tensor | None:
        """The same micro-step when nobody overrides its hooks: no dispatch, no closure object."""
        if self._sink_window_batches == 0:
            if not self._store_checked:
                # Parameters unfrozen or param groups added: that happens in hooks (finetuning callbacks), and none
                # runs inside a sink on this path, so the first window start of each sink is the one to check.
                self._refresh_store()
                self._store_checked = True
            self._accumulator.zero_grad()  # what the default optimizer_zero_grad (set_to_none=True) leaves
            self._counters.zero_grad()
        store = self._accumulator
        self._sink_window_batches += 1
        ends = self._sink_window_batches == self.accumulation_steps
        output = self._forward(*self._step_args(batch, batch_idx))
        loss = _loss_of(output)
        if loss is not None:
            store.begin_micro_step(ends)
            self._direct_backward(loss)  # (not divided by N: _loss_divisor is 1 on this path)
            store.end_micro_step()
            loss = loss.detach()
        if ends:
            self._sink_window_batches = 0
            self._count_sink_update(lambda: self.update_step(self.optimizers[0], lambda: None))
        return loss

    def _to_device(self, batch: Any) -> Any:
        """The transfer hooks, as Lightning's loop runs them for each of its batches (``batch_to_device`` alone moves
        the batch when none is overridden)."""
        if not self._direct_transfer:
            batch = compat.before_batch_transfer(self.lightning_module, batch)  # type: ignore[attr-defined]
        return self.batch_to_device(batch)  # type: ignore[attr-defined]
