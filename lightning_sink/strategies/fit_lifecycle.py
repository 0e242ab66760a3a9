"""A sink strategy's fit, from construction to teardown: its settings resolved against the Trainer, the data it
reads, and the checkpoint state (``checkpoint_state.py``). At train start it has its engine assembled
(``engine_assembly.py``) and, in sink mode, its sink loop wired (``sink/fit_wiring.py``), and it undoes both at
train end. The step itself is in ``engine.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import has_len_all_ranks
from torch.nn import Parameter

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients
from lightning_sink.data import DataPosition
from lightning_sink.indexed_batches import IndexedLoaderReads
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.random_state import gather_random_states, restore_rank_random_state
from lightning_sink.sink.fit_wiring import SinkSettings, SinkWiring
from lightning_sink.sink.loop import SinkLoop
from lightning_sink.sink_data import SinkLoader
from lightning_sink.strategies import checkpoint_state
from lightning_sink.strategies.carried_windows import carried_updates
from lightning_sink.strategies.config import SinkConfig
from lightning_sink.strategies.engine import EngineHost, StepEngine
from lightning_sink.strategies.engine_assembly import (
    EngineSettings,
    WindowParts,
    assemble_engine,
    bind_backward,
    install_window_rules,
    unbind_backward,
)
from lightning_sink.strategies.fit_checks import (
    UpdateMakeup,
    check_sink_callbacks,
    draws_own_batches,
    settle_accumulation_steps,
)
from lightning_sink.strategies.graph_modes import step_function
from lightning_sink.strategies.hooks import HookPlan
from lightning_sink.strategies.progress_ranges import check_progress_against_fit, whole_count
from lightning_sink.strategies.resume_check import check_resume_settings
from lightning_sink.strategies.sink_state_check import FitFacts, check_state_against_fit
from lightning_sink.strategies.tensor_digests import add_tensor_digests, check_tensor_digests
from lightning_sink.training_passes import TrainingPasses
from lightning_sink.window import GradientStore

# WindowParts is engine_assembly's; the strategies import it from here, with the SinkFit they give it to.
__all__ = ["WindowParts", "SinkFit", "fit_setting"]


def fit_setting(name: str) -> Any:
    """A strategy attribute that reads the fit's setting of that name (``strategy.accumulation_steps``, ...)."""
    return property(lambda strategy: getattr(strategy.sink_fit, name), doc=f"The fit's ``{name}``.")


def _nothing_to_give_back() -> None:
    """No ModelCheckpoint reads a held setting."""


class SinkFit:
    """Held by a sink strategy from its construction (``host``: that strategy)."""

    def __init__(self, host: EngineHost, config: SinkConfig) -> None:
        self.host = host
        self.sink_config = config
        self.sink_size, self.graph_mode = config.sink_size, config.graph_mode
        self.prefetch_depth = config.prefetch_depth
        self.micro_steps_per_call = config.micro_steps_per_call
        self._requested_accumulation_steps = config.accumulation_steps
        self.accumulation_steps = config.accumulation_steps or 1
        self.partial_window = config.partial_window
        self.scheduled = False  # a GradientAccumulationScheduler changes accumulation_steps during the fit
        self.data_position = DataPosition()
        self.passes = TrainingPasses(self.data_position)  # the loader outside sink mode (resume, "drop" length)
        self._indexed_reads = IndexedLoaderReads()  # outside sink mode: in-memory loaders read by indexing
        self._sink_loader: SinkLoader | None = None
        self.pending_state: dict[str, Any] | None = None  # a checkpoint's state, applied at train start
        self._pending_random_states: list[Any] | None = None  # a checkpoint's random generators, also at train start
        self._pending_path: Any = None  # the checkpoint the pending state came from, for error messages
        self.engine: StepEngine | None = None  # this fit's engine (automatic optimization only)
        self._sink = SinkWiring()  # sink mode: the sink loop, from train start to train end
        self.direct_transfer = False  # batch_to_device may skip the transfer-hook dispatch (during a fit)
        self._trainer: pl.Trainer | None = None
        self._val_check_interval: int | float | None = None  # the Trainer's, held during a sink-mode fit
        self._give_back_save_points: Callable[[], None] = _nothing_to_give_back  # (ModelCheckpoint's reading of it)

    # ------------------------------------------------------------------ what the strategy and its users read
    @property
    def trainer(self) -> pl.Trainer:
        """The Trainer of the fit (known from the strategy's ``setup`` on)."""
        if self._trainer is None:
            module = self.host.lightning_module
            assert module is not None
            self._trainer = module.trainer
        return self._trainer

    @property
    def accumulating(self) -> bool:
        """Whether the engine runs: automatic optimization is on (manual optimization is passed through)."""
        module = self.host.lightning_module
        return module is not None and module.automatic_optimization

    @property
    def loss_scaling(self) -> LossScalePrecision | None:
        plugin = self.host.precision_plugin
        return plugin if isinstance(plugin, LossScalePrecision) else None

    @property
    def store(self) -> GradientStore | None:
        """The open window's gradient store (``None`` before the engine is built)."""
        return self.engine.window.store if self.engine is not None else None

    @property
    def hooks(self) -> HookPlan | None:
        return self.engine.hooks if self.engine is not None else None

    @property
    def sink_loop(self) -> SinkLoop | None:
        """In sink mode, the fit's sink loop (from train start to train end)."""
        return self._sink.loop

    @property
    def micro_steps_in_window(self) -> int | None:
        """In sink mode, micro-batches of the open window (0 right after an update); ``None`` otherwise, where a
        Lightning batch is one micro-batch and Lightning's own counters tell whether it closed a window."""
        if self.sink_loop is None or self.engine is None:
            return None
        return self.engine.window.micro_batches

    def running_engine(self) -> StepEngine:
        """The engine, for the extension points Lightning calls only while it trains with it."""
        if self.engine is None:
            raise RuntimeError(f"{type(self.host).__name__}: the step engine is built at train start; none runs now.")
        return self.engine

    def running_sink_loop(self) -> SinkLoop:
        if self.sink_loop is None:
            raise RuntimeError(f"{type(self.host).__name__}: no sink runs outside a fit with sink_size set.")
        return self.sink_loop

    # ------------------------------------------------------------------ before the fit
    def configure_for_trainer(self, trainer: pl.Trainer) -> None:
        """Settle accumulation and the precision plugin; called at the start of the strategy's ``setup``."""
        host = self.host
        self._trainer = trainer
        callbacks = compat.trainer_settings(trainer).callbacks
        scheduled = any(isinstance(callback, GradientAccumulationScheduler) for callback in callbacks)
        self.accumulation_steps = settle_accumulation_steps(
            type(host).__name__,
            self._requested_accumulation_steps,
            trainer.accumulate_grad_batches,
            scheduled,
            self.sink_size,
            trainer.lightning_module.automatic_optimization,
        )
        self.scheduled = scheduled
        plugin = host.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is not None:
            # Trainer(precision="16-mixed") on CUDA: Lightning's GradScaler would step the optimizer itself; use
            # the accumulating loss scaler instead (an explicit LossScalePrecision plugin is kept as given).
            host.precision_plugin = LossScalePrecision("16-mixed", DynamicLossScale(), device=plugin.device)
        if self.sink_size is not None:
            check_sink_callbacks(type(host).__name__, self.sink_size, callbacks, trainer.lightning_module)
            # A step-based val_check_interval is the sink schedule's (sink/schedule.py); Lightning's own reading of
            # it, against a loader of sink placeholders, would be wrong. Given back when the fit ends.
            interval = trainer.val_check_interval
            if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval != 1.0:
                self._val_check_interval = interval
                trainer.val_check_interval = 1.0
                self._give_back_save_points = compat.save_points_read(trainer, interval)
            compat.set_estimated_stepping_batches(trainer, self.estimated_updates)
        else:
            # Lightning's loop opens and closes windows with this (and divides each loss by it).
            trainer.accumulate_grad_batches = self.accumulation_steps
            if self.partial_window == "carry":  # (windows run across epochs: no update per epoch's last window)
                compat.set_estimated_stepping_batches(
                    trainer, lambda: carried_updates(trainer, self.accumulation_steps)
                )

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.trainer
        if trainer.state.stage != RunningStage.TRAINING or not self.accumulating:
            return dataloader
        if self.sink_size is not None:
            self._sink_loader = SinkLoader(dataloader)
            # Lightning checks the length of the loader it iterates, which is now the placeholder (no length): the
            # same checks and warnings over the user's loader, as stock gives them (a sized IterableDataset, a
            # loader empty on some rank).
            module = trainer.lightning_module
            allow_zero = bool(module and module.allow_zero_length_dataloader_with_multiple_devices)
            has_len_all_ranks(dataloader, trainer.strategy, allow_zero)
            return self._sink_loader
        whole = self.accumulation_steps if self.partial_window == "drop" else None
        counts_batches = not draws_own_batches(trainer.lightning_module)
        # generators, "drop" epoch length, the resume position
        self.passes.take_loader(trainer, dataloader, whole_windows_of=whole, counts_batches=counts_batches)
        self._indexed_reads.take(dataloader)
        return dataloader

    def flat_store(self, params: list[Parameter]) -> GradientStore:
        """The store of the single-device and DDP strategies: the flat fp32 window sum, or plain ``.grad`` where a
        window is one micro-step on one process without a loss scale (nothing to sum, reduce or unscale)."""
        update = UpdateMakeup(
            accumulation_steps=self.accumulation_steps,
            sink_size=self.sink_size,
            scheduled=self.scheduled,
            world_size=self.host.world_size,
            loss_scaling=self.loss_scaling is not None,
        )
        if not update.sums_windows:
            return SingleStepGradients(params)
        # Windows that run across Lightning's zero-grad points ("carry") reset only when they end.
        follows_zero_grad = self.sink_size is not None or self.partial_window != "carry"
        # Which parameters a window's backward passes reached is tracked on one process (another rank may have
        # reached one this one did not, see accumulation.py), and not beside the whole-step compiled programs of a
        # sink, whose gradients of a parameter nothing reached are zeros (and which refuse parameter hooks).
        tracks = self.host.world_size == 1 and (self.sink_size is None or self.graph_mode == "eager")
        return GradientAccumulator(params, follows_zero_grad=follows_zero_grad, tracks_reached=tracks)

    # ------------------------------------------------------------------ the fit
    def start(self, parts: WindowParts) -> None:
        """At train start: check the run, have the engine assembled from ``parts`` and the fit's own settings, and
        install the loop rules (the sink loop's in sink mode)."""
        self._restore_random_states()
        if not self.accumulating:
            return
        host, trainer = self.host, self.trainer
        settings = EngineSettings(
            accumulation_steps=self.accumulation_steps,
            partial_window=self.partial_window,
            sink_size=self.sink_size,
            scheduled=self.scheduled,
            graph_mode=self.graph_mode,
        )
        # step_function is read from this module at each start: the fallback tests (tests/compiled) replace it here
        # with a quicker compiler backend.
        self.engine = engine = assemble_engine(host, trainer, parts, settings, self.passes, step_function)
        self.direct_transfer = engine.hooks.direct_transfer
        bind_backward(host, engine)
        if self.pending_state is not None:
            self._apply_pending_state(engine)
        if self.sink_size is None:
            self.passes.skip_trained_batches(trainer)  # after a mid-pass resume
        if self._sink_loader is not None:
            self._sink.wire(host, trainer, engine, self._sink_loader, self.data_position, self._sink_settings())
        else:
            install_window_rules(trainer, engine, self.partial_window)

    def _apply_pending_state(self, engine: StepEngine) -> None:
        """A checkpoint's state, checked against this fit, into the new engine's window."""
        assert self.pending_state is not None
        check_resume_settings(self.pending_state, self.window_settings(), self._pending_path)
        facts = self._fit_facts()
        check_state_against_fit(self.pending_state, facts, self._pending_path)
        check_progress_against_fit(self.pending_state, facts, self._pending_path)
        checkpoint_state.load_window(engine.window, self.pending_state, self.host)
        self.pending_state = None

    def _sink_settings(self) -> SinkSettings:
        assert self.sink_size is not None
        return SinkSettings(
            sink_size=self.sink_size,
            accumulation_steps=self.accumulation_steps,
            graph_mode=self.graph_mode,
            micro_steps_per_call=self.micro_steps_per_call,
            prefetch_depth=self.prefetch_depth,
            device_data_budget=self.sink_config.device_data_budget,
            val_check_interval=self._val_check_interval,
        )

    def _restore_random_states(self) -> None:
        """A resumed run's global random generators continue from the checkpoint's. Restored at train start, after
        what Lightning draws while it sets the fit up (the first training iterator's base seed, a sanity check, which
        it runs with the generators isolated), so that the next draw is the training's, as in the uninterrupted run."""
        saved, self._pending_random_states = self._pending_random_states, None
        if saved is not None and self.sink_config.checkpoint_random_state:
            host = self.host
            restore_rank_random_state(saved, host.global_rank, host.world_size, self._pending_path)

    def _fit_facts(self) -> FitFacts:
        """What bounds a checkpoint's counts: the window length, the batches of a data pass where known (in sink
        mode the loader's length, otherwise Lightning's epoch length, limits and ``"drop"`` applied), Lightning's
        restored counters and the micro-batches of one of its epochs (in sink mode its sink of ``sink_size``)."""
        trainer = self.trainer
        if self._sink_loader is not None:
            try:
                batches = whole_count(len(self._sink_loader.loader))
            except TypeError:
                batches = None
            per_epoch = self.sink_size if self.sink_size != -1 else batches  # (a sink is one Lightning epoch)
        else:
            batches = per_epoch = whole_count(trainer.num_training_batches)
        module = self.host.lightning_module
        automatic = module is not None and module.automatic_optimization
        return FitFacts(
            self.accumulation_steps, batches, trainer.current_epoch, trainer.global_step, per_epoch, automatic
        )

    def estimated_updates(self) -> int | float:
        """``trainer.estimated_stepping_batches`` in sink mode: the optimizer updates of ``max_epochs`` sinks (a
        window's micro-batches may span sinks), capped by ``max_steps``; Lightning's own answer where the number of
        micro-batches is not known (``max_epochs=-1``, ``sink_size=-1`` over a loader without a length)."""
        trainer = self.trainer
        stock = compat.stock_estimated_stepping_batches(trainer)  # (loads the training data if needed)
        epochs = trainer.max_epochs
        if self._sink_loader is None or epochs is None or epochs < 0:
            return stock
        per_sink = self.sink_size if self.sink_size != -1 else sized_len(self._sink_loader.loader)
        if per_sink is None:
            return stock
        updates = max(epochs, 1) * per_sink // self.accumulation_steps
        return min(updates, trainer.max_steps) if trainer.max_steps != -1 else updates

    def batch_started(self) -> None:
        """At each Lightning batch's start (``on_train_batch_start``)."""
        if self.sink_loop is not None:
            self.sink_loop.batch_started()
        self.passes.first_batch_started()
        engine = self.engine
        if engine is not None and self.sink_size is None:
            steps = self.trainer.accumulate_grad_batches
            if steps != self.accumulation_steps:  # a GradientAccumulationScheduler
                self.accumulation_steps = engine.accumulation_steps = steps
                engine.window.divide_losses_by(steps)

    def end(self) -> None:
        """At train end."""
        self._sink.unwire()
        unbind_backward(self.host, self.engine)
        compat.remove_loop_overrides(self.trainer)

    def teardown(self) -> None:
        if self._val_check_interval is not None and self._trainer is not None:
            self._trainer.val_check_interval = self._val_check_interval  # the Trainer's own setting, given back
        self._val_check_interval = None
        self._give_back_save_points()
        self._give_back_save_points = _nothing_to_give_back
        if self._trainer is not None:
            compat.set_estimated_stepping_batches(self._trainer, None)
        self._sink.unwire()  # also when training raised and on_train_end never ran
        unbind_backward(self.host, self.engine)
        if self.engine is not None:
            self.engine.window.store.release()  # (its hooks off the user's parameters)
        self.direct_transfer = False
        self.passes.release()
        self._indexed_reads.release()
        self.pending_state = self._pending_random_states = None  # (a checkpoint's state is for the fit that loaded it)

    # ------------------------------------------------------------------ checkpoints
    def window_settings(self) -> dict[str, Any]:
        """The arguments an open window was accumulated under (checked on resume: ``resume_check.py``)."""
        return dict(
            accumulation_steps=self.accumulation_steps, sink_size=self.sink_size, partial_window=self.partial_window
        )

    def state_dict(self, gather: Callable[[Any], list[Any]]) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly (``gather``: every rank's partial sums)."""
        window = self.engine.window if self.engine is not None else None
        self.passes.before_save()  # (outside sink mode: sinks keep their own position)
        random_states = gather_random_states(self.host.world_size) if self.sink_config.checkpoint_random_state else None
        return checkpoint_state.sink_state(
            self.window_settings(), window, self.data_position, gather, self.host, random_states
        )

    def seal(self, checkpoint: dict[str, Any]) -> None:
        """Before a ``.ckpt`` is written: record the digest of each of its tensors (unless opted out)."""
        if self.sink_config.checkpoint_digests:
            add_tensor_digests(checkpoint, checkpoint_state.CHECKPOINT_KEY)

    def check_digests(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """A loaded ``.ckpt``'s tensors against the digests recorded in it (where it has them, unless opted out).
        Only for a whole ``.ckpt``: a DCP folder's ``meta.pt`` lacks the tensors (its files have their own)."""
        if self.sink_config.checkpoint_digests:
            check_tensor_digests(checkpoint, checkpoint_state.CHECKPOINT_KEY, checkpoint_path)

    def restore(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """Take this package's state from a checkpoint (resharded ones too) that a fit loads, not validate or test."""
        state = checkpoint_state.read_sink_state(checkpoint, checkpoint_path)
        if state is not None and self.trainer.state.fn == TrainerFn.FITTING:
            # The data position must be known before Lightning first iterates the loader; the window is applied
            # at train start, once the engine exists.
            self.data_position.load_state_dict(state["data"])
            self.pending_state, self._pending_path = state, checkpoint_path
            self._pending_random_states = state.get("random")
            size, position = self.sink_size, self.data_position
            # (``sink_open`` is what the sink loop recorded; checkpoints written before it have the counts only, and
            # a sink of ``sink_size=-1`` ends with its data pass, whose length only the loop knew)
            if (size == -1 and position.sink_open) or (size is not None and 0 < position.trained_in_sink < size):
                # A stop inside a sink (max_steps) that Lightning recorded as the end of its epoch: the resume
                # continues that sink, in that epoch, to its planned end.
                compat.reopen_interrupted_epoch(checkpoint)
