"""The two step programs and the bookkeeping around them, shared by every sink strategy.

MindSpore's ``TrainAccuStepsCell`` runs two graphs alternately: an accumulation graph (forward, backward,
``accu_grads += grads``) and an update graph (forward, backward, reduce, optimizer, clear). Here they are
``accumulate_step`` and ``update_step``: two separately callable methods, so that a later stage can compile or
capture each one on its own. Everything Lightning-specific around them (which program a batch runs, counters,
checkpoint state) lives in the same mixin so that ``SinkStrategy`` and ``SinkDDPStrategy`` stay thin.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.types import STEP_OUTPUT
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor
from torch.optim import Optimizer

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, MicroStep, SingleStepGradients, plan_micro_step
from lightning_sink.data import DataPosition
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.sink_data import PASS_END, MicroBatchStream, SinkLoader
from lightning_sink.strategies.config import SinkConfig
from lightning_sink.strategies.graph_modes import check_graph_mode_device, step_function
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.strategies.resume_check import check_resume_settings
from lightning_sink.strategies.sink_logging import SinkLogBuffer
from lightning_sink.strategies.step_triggers import ignore_one_batch_per_epoch_warning, warn_about_unaligned_step_triggers
from lightning_sink.training_passes import TrainingPasses

__all__ = ["StepProgramsMixin", "CHECKPOINT_KEY"]

CHECKPOINT_KEY = "lightning_sink"
_STATE_VERSION = 1


def _loss_of(output: STEP_OUTPUT) -> Tensor:
    if type(output) is Tensor:  # the common case first: an ABC isinstance check costs ~0.5 us a call
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise ValueError(
            "training_step must return the loss tensor or a dict with a 'loss' tensor when a lightning-sink strategy"
            f" accumulates; it returned {type(output).__name__}. Every micro-batch of a window needs a loss."
        )
    return loss


def _detached(output: STEP_OUTPUT) -> STEP_OUTPUT:
    if type(output) is not Tensor and isinstance(output, Mapping):
        return {key: value.detach() if isinstance(value, Tensor) else value for key, value in output.items()}
    return output.detach()


class StepProgramsMixin:
    """Gradient accumulation as two step programs, mixed into a Lightning ``Strategy`` subclass."""

    # Provided by the Strategy this is mixed into.
    lightning_module: pl.LightningModule | None
    precision_plugin: Any
    optimizers: list[Optimizer]
    world_size: int

    def _init_step_programs(self, config: SinkConfig) -> None:
        """``config`` is the strategy's validated arguments (``config.py``)."""
        self.sink_config = config
        accumulation_steps, partial_window = config.accumulation_steps, config.partial_window
        self.sink_size, self.prefetch_depth, self.graph_mode = config.sink_size, config.prefetch_depth, config.graph_mode
        self._step_function: Callable[..., STEP_OUTPUT] | None = None
        self._sink_loader: SinkLoader | None = None
        self._stream: MicroBatchStream | None = None
        self._requested_accumulation_steps = accumulation_steps
        self.accumulation_steps = accumulation_steps or 1
        self.partial_window = partial_window
        self._accumulator: GradientAccumulator | None = None
        self._data_position = DataPosition()
        self._passes = TrainingPasses(self._data_position)  # the loader outside sink mode (resume, "drop" length)
        self._pending_state: dict[str, Any] | None = None
        self._pending_path: Any = None  # the checkpoint the pending state came from, for error messages
        self._planned: tuple[int, bool] | None = None
        self._log_buffer: SinkLogBuffer | None = None
        self._step_scheduler_configs: list[Any] = []
        self._needs_step_context = True
        self._scaling: LossScalePrecision | None = None  # _loss_scaling, fixed once training starts

    # ------------------------------------------------------------------ configuration
    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def _trainer(self) -> pl.Trainer:
        assert self.lightning_module is not None
        return self.lightning_module.trainer

    @property
    def _accumulating(self) -> bool:
        """Whether the step programs run: automatic optimization is on (manual runs are passed through)."""
        return self.lightning_module is not None and self.lightning_module.automatic_optimization

    @property
    def _loss_scaling(self) -> LossScalePrecision | None:
        plugin = self.precision_plugin
        return plugin if isinstance(plugin, LossScalePrecision) else None

    def _configure_for_trainer(self, trainer: pl.Trainer) -> None:
        """Take accumulation over from the Trainer and settle the precision plugin; called at the start of ``setup``."""
        requested, from_trainer = self._requested_accumulation_steps, trainer.accumulate_grad_batches
        if requested is not None and from_trainer not in (1, requested):
            raise ValueError(
                f"{type(self).__name__}(accumulation_steps={requested}) conflicts with"
                f" Trainer(accumulate_grad_batches={from_trainer}): set one of them, or both to the same value."
            )
        self.accumulation_steps = requested or from_trainer
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
        if self.sink_size is None:
            # Lightning's estimated_stepping_batches (used to size OneCycleLR and friends) divides by this. (In
            # sink mode a Lightning batch is a whole sink, so Lightning's estimate cannot be made right this way.)
            trainer.accumulate_grad_batches = self.accumulation_steps

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self._trainer
        if trainer.state.stage != RunningStage.TRAINING or not self._accumulating:
            return dataloader
        if self.sink_size is not None:
            self._sink_loader = SinkLoader(dataloader)
            return self._sink_loader
        whole = self.accumulation_steps if self.partial_window == "drop" else None
        self._passes.take_loader(trainer, dataloader, whole_windows_of=whole)  # [data] generators, "drop" length
        return dataloader

    # ------------------------------------------------------------------ lifecycle
    def on_train_start(self) -> None:
        super().on_train_start()  # type: ignore[misc]
        if not self._accumulating:
            return
        optimizers = self.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"{type(self).__name__} supports exactly one optimizer; got {len(optimizers)}.")
        params = [p for group in optimizers[0].param_groups for p in group["params"]]
        # Fixed for the run (Lightning configures optimizers, schedulers and the plugin in setup): decided once
        # here rather than on every micro-step.
        self._scaling = self._loss_scaling
        self._step_scheduler_configs = [config for config in self._trainer.lr_scheduler_configs
                                        if config.interval == "step" and not config.reduce_on_plateau]
        self._needs_step_context = self._plugin_has_step_context()
        self._accumulator = self._make_accumulator(params)
        self._hooks = HookPlan.for_run(self._trainer)
        check_graph_mode_device(self.graph_mode, self.root_device)  # type: ignore[attr-defined]
        self._step_function = step_function(self.lightning_module.training_step, self.graph_mode)
        if self._scaling is not None:
            self._scaling.to_device(self.root_device)  # type: ignore[attr-defined]
        if self._pending_state is not None:
            check_resume_settings(self._pending_state, self._window_settings(), self._pending_path)  # [resume]
            self._load_window_state(self._pending_state)
            self._pending_state = None
        if self.sink_size is None:
            self._passes.skip_trained_batches(self._trainer)  # [data] after a mid-pass resume
        if self._sink_loader is not None:
            warn_about_unaligned_step_triggers(self._trainer, self.sink_size, self.accumulation_steps)
            self._stream = MicroBatchStream(self._sink_loader.loader, self._data_position, self._prefetch_depth(),
                                            copier=self._device_copier())
            module = self.lightning_module
            self._log_buffer = SinkLogBuffer(module) if SinkLogBuffer.usable(module) else None
        compat.install_loop_overrides(self._trainer, self._batch_has_no_update)

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

    def _make_accumulator(self, params: list[torch.nn.Parameter]) -> Any:
        """The window's gradient store (hook: sharded strategies return their own, see ``model_parallel.py``)."""
        if self.accumulation_steps == 1 and self.world_size == 1 and self._scaling is None:
            return SingleStepGradients(params)  # nothing to sum, reduce or unscale
        return GradientAccumulator(params)

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def on_train_end(self) -> None:
        self._close_stream()
        compat.remove_loop_overrides(self._trainer)
        super().on_train_end()  # type: ignore[misc]

    def teardown(self) -> None:
        self._close_stream()  # also when training raised and on_train_end never ran
        self._passes.release()  # [data]
        super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ which program a batch runs
    def _plan_micro_step(self) -> MicroStep:
        return plan_micro_step(
            self._accumulator.micro_steps,
            self.accumulation_steps,
            compat.is_last_batch_of_epoch(self._trainer),
            self.partial_window,
        )

    def _sink_will_update(self) -> bool:
        """Whether the coming sink completes at least one window (windows run on across sinks and passes)."""
        trainer = self._trainer
        if trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps:
            return False
        length = self.sink_size
        if length == -1:  # one data pass: what is left of it, or assume a window's worth when unsized
            try:
                length = len(self._sink_loader.loader) - self._data_position.trained_in_pass
            except TypeError:
                length = self.accumulation_steps
        return self._accumulator.micro_steps + length >= self.accumulation_steps

    def _batch_has_no_update(self) -> bool:
        """Lightning asks this several times per batch; decided once, before the batch runs, and cached."""
        if self._accumulator is None:
            return False
        batch_key = self._trainer.fit_loop.total_batch_idx
        if self._planned is None or self._planned[0] != batch_key:
            updates = self._sink_will_update() if self._stream is not None else \
                self._plan_micro_step() is MicroStep.UPDATE
            self._planned = (batch_key, updates)
        return not self._planned[1]

    # ------------------------------------------------------------------ Lightning entry points
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if not self._accumulating:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        batch, batch_idx = args[0], args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        if self._stream is not None:
            return self._run_sink()
        self._batch_has_no_update()  # fix the plan for this batch before its state changes
        plan = self._plan_micro_step()
        if plan is MicroStep.UPDATE:
            output = self.update_step(batch, batch_idx)
        else:
            output = self.accumulate_step(batch, batch_idx)
            if plan is MicroStep.ACCUMULATE_THEN_DROP:
                self._accumulator.clear()
        self._passes.batch_trained(compat.is_last_batch_of_epoch(self._trainer))  # [data] (sinks count their own)
        return output

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Runs Lightning's closure, whose ``training_step`` runs the step programs (the real update included)."""
        if not self._accumulating:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        result = closure()
        compat.finish_lightning_batch(self._trainer, lightning_counts_one=not self._batch_has_no_update())
        return result

    # ------------------------------------------------------------------ the sink loop
    def _run_sink(self) -> dict[str, Tensor]:
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

    def _run_micro_steps(self) -> dict[str, Tensor]:
        trainer, stream, buffer = self._trainer, self._stream, self._log_buffer
        max_steps = trainer.max_steps
        # Batches need moving unless the stream's thread already did, or they are for the CPU and no transfer hook
        # runs (a loader's batches are on the CPU already; walking them costs ~10 us a step).
        to_device = stream.copier is None and not (self._hooks.direct_transfer and self.root_device.type == "cpu")
        losses: list[Tensor] = []
        micro_index = 0
        while self.sink_size == -1 or micro_index < self.sink_size:
            if max_steps != -1 and trainer.global_step >= max_steps:
                break
            batch = stream.next()
            if batch is PASS_END:
                if self.sink_size == -1 and losses:
                    break  # one data pass per sink
                continue
            if to_device:
                batch = self._to_device(batch)
            if buffer is not None:
                buffer.begin_micro_step(batch)
            program = self.update_step if self._accumulator.micro_steps + 1 == self.accumulation_steps \
                else self.accumulate_step
            losses.append(_loss_of(program(batch, micro_index)))
            self._data_position.advance()
            micro_index += 1
        stacked = torch.stack(losses)
        return {"loss": stacked[-1], "mean_loss": stacked.mean(), "losses": stacked}

    # ------------------------------------------------------------------ the two step programs
    def accumulate_step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        """Forward, backward (of the scaled loss), add the gradients into the fp32 window buffers.

        Communicates nothing and reads nothing back to the host (unless ``skip_window_on_overflow`` is on).
        """
        self._accumulator.begin_micro_step()
        skip_backward = self._window_already_overflowed()
        if not self._needs_step_context and not skip_backward and torch.is_grad_enabled():
            output = self._step_function(batch, batch_idx)  # nothing to enter: the contexts cost a few us a step
        else:
            with self.precision_plugin.train_step_context(), torch.set_grad_enabled(not skip_backward):
                output = self._step_function(batch, batch_idx)
        if not skip_backward:
            self._backward(_loss_of(output))
        self._accumulator.end_micro_step()
        return _detached(output)

    def _plugin_has_step_context(self) -> bool:
        """Whether the precision plugin's step context does anything (autocast, ...); Lightning's base one does not."""
        kind = type(self.precision_plugin)
        return not (kind.train_step_context is Precision.train_step_context
                    and kind.forward_context is Precision.forward_context)

    def _backward(self, loss: Tensor) -> None:
        if not self._hooks.direct_backward:
            self.backward(loss, self.optimizers[0])  # type: ignore[attr-defined]  # hooks and plugin, as Lightning
            return
        scaling = self._scaling
        if scaling is not None and scaling.scaler is not None:
            loss = loss * scaling.scaler.scale.to(loss.dtype)
        loss.backward()

    def _before_optimizer_step(self, optimizer: Optimizer, trainer: pl.Trainer) -> None:
        if not self._hooks.direct_before_step:
            compat.run_before_optimizer_step(trainer, optimizer)  # on_before_optimizer_step hooks, then clipping
        elif trainer.gradient_clip_val:
            self.precision_plugin.clip_gradients(optimizer, trainer.gradient_clip_val,
                                                 trainer.gradient_clip_algorithm or "norm")

    def _to_device(self, batch: Any) -> Any:
        if self._hooks.direct_transfer:
            return move_data_to_device(batch, self.root_device)  # type: ignore[attr-defined]
        return self.batch_to_device(batch)  # type: ignore[attr-defined]  # the module's transfer hooks

    def _window_already_overflowed(self) -> bool:
        scaling = self._scaling
        if scaling is None or not scaling.skip_window_on_overflow or self._accumulator.micro_steps == 0:
            return False
        return bool(self._accumulator.has_overflow().item())  # host sync: opted in, one per micro-step

    def update_step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        """The accumulate step, then one reduction, clipping, the optimizer step and clearing the buffers."""
        output = self.accumulate_step(batch, batch_idx)
        self._apply_window_update()
        return output

    def _apply_window_update(self) -> None:
        accumulator, optimizer = self._accumulator, self.optimizers[0]
        assert accumulator is not None
        if self.world_size > 1:
            accumulator.reduce()  # also carries any rank's overflow (inf/NaN) to every rank
            self._sync_module_buffers()
        divisor = accumulator.micro_steps * self.world_size
        scaling = self._scaling
        if scaling is None:
            if divisor != 1:
                accumulator.flat.div_(divisor)
            found_inf = None
        else:
            found_inf = scaling.unscale_window(accumulator.flat, divisor)
        accumulator.write_gradients()
        self._finish_window(optimizer, scaling, found_inf)

    def _finish_window(self, optimizer: Optimizer, scaling: LossScalePrecision | None,
                       found_inf: Tensor | None) -> None:
        """Once the window's mean gradient is in ``.grad``: hooks and clipping, the step (or skip), the loss scale,
        clearing the window, the update count and the step-interval LR schedulers (held on a skipped window)."""
        trainer = self._trainer
        self._before_optimizer_step(optimizer, trainer)
        if scaling is None:
            optimizer.step()
        else:
            scaling.step_or_skip(optimizer, found_inf)
            scaling.update_scale(found_inf)
            self._log_loss_scale(scaling, found_inf)
        self._accumulator.clear()
        compat.record_optimizer_update(trainer)
        if self._step_scheduler_configs and not (scaling is not None and scaling.window_overflowed(found_inf)):
            self._step_lr_schedulers(trainer)

    def _log_loss_scale(self, scaling: LossScalePrecision, found_inf: Tensor | None) -> None:
        """Device tensors into Lightning's logger; they are read back only when the logger writes."""
        if scaling.scaler is None or found_inf is None or not self._trainer.loggers:
            return  # Lightning's self.log costs ~0.1 ms a call; nothing would read these without a logger
        module = self.lightning_module
        for name, value in (("loss_scale", scaling.scaler.scale), ("overflow", found_inf),
                            ("skipped_updates", scaling.scaler.skipped)):
            # float: Lightning warns when it converts an integer tensor for the logger itself
            module.log(name, value.to(torch.float32, copy=True), on_step=True, on_epoch=False, batch_size=1)

    def _sync_module_buffers(self) -> None:
        """Overridden by distributed strategies (rank 0's buffers win, as DDP's ``broadcast_buffers``)."""

    def _step_lr_schedulers(self, trainer: pl.Trainer) -> None:
        for config in self._step_scheduler_configs:
            if trainer.global_step % config.frequency == 0:
                compat.call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)

    # ------------------------------------------------------------------ checkpoint state
    def _window_state(self) -> dict[str, Any] | None:
        if self._accumulator is None:
            return None
        state = self._accumulator.state_dict()
        buffer = state.pop("buffer")
        # Each rank's partial sum differs; keep all of them so a resume is bit-identical.
        state["buffers"] = self._gather_buffers(buffer) if buffer is not None else None
        state["world_size"] = self.world_size
        return state

    def _gather_buffers(self, buffer: Tensor) -> list[Tensor]:
        if self.world_size == 1:
            return [buffer]
        gathered = [torch.empty_like(buffer) for _ in range(self.world_size)]
        dist.all_gather(gathered, buffer)
        return gathered

    def _load_window_state(self, state: dict[str, Any]) -> None:
        window = state.get("window")
        if window is None:
            return
        assert self._accumulator is not None
        buffers = window["buffers"]
        if buffers is not None and len(buffers) != self.world_size:
            raise ValueError(
                f"The checkpoint was saved inside an accumulation window by {len(buffers)} ranks; resume it with"
                f" {len(buffers)} ranks (now {self.world_size}), or from a checkpoint saved at a window boundary."
            )
        rank = getattr(self, "global_rank", 0)
        buffer = buffers[rank] if buffers is not None else None
        self._accumulator.load_state_dict({"micro_steps": window["micro_steps"], "buffer": buffer})

    def _window_settings(self) -> dict[str, Any]:
        """The arguments an open window was accumulated under (checked on resume: resume_check.py)."""
        return {"accumulation_steps": self.accumulation_steps, "sink_size": self.sink_size,
                "partial_window": self.partial_window}

    def sink_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly: window buffers, micro-step index, data position."""
        return {
            "version": _STATE_VERSION,
            **self._window_settings(),
            "window": self._window_state(),
            "data": self._data_position.state_dict(),
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Called on every rank by Trainer.save_checkpoint, so the gather above is safe.
        checkpoint[CHECKPOINT_KEY] = self.sink_state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        self._restore_sink_state(checkpoint, checkpoint_path)
        return checkpoint

    def _restore_sink_state(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """Take this package's state from a loaded checkpoint (also called for resharded checkpoints)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            if state.get("version") != _STATE_VERSION:
                raise ValueError(
                    f"{checkpoint_path}: '{CHECKPOINT_KEY}' state has version {state.get('version')!r}; this"
                    f" lightning-sink reads version {_STATE_VERSION}."
                )
            # The data position must be known before Lightning first iterates the loader; the window buffers
            # are applied in on_train_start, once they exist.
            self._data_position.load_state_dict(state["data"])
            self._pending_state, self._pending_path = state, checkpoint_path
