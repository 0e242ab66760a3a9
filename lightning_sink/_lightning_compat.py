"""Every use of a private Lightning attribute, in one place.

Lightning's automatic optimization drives the strategies' windows (zero-grad, the ``optimizer_step`` hook, the
closure, the counters). Where no extension point exists (sinks, windows across epochs, LR schedulers held on a
skipped update) the functions below reach into the loop. ``tests/test_lightning_compat.py`` fails loudly when a Lightning release moves any of these.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, cast

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.loops.fetchers import _DataFetcher, _PrefetchDataFetcher
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.strategies.strategy import _StrategyRegistry
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.combined_loader import _shutdown_workers_and_reset_iterator

__all__ = [
    "recorded_step_counts",
    "check_before_resume",
    "TrainerSettings",
    "trainer_settings",
    "LoopOverrides",
    "install_loop_overrides",
    "remove_loop_overrides",
    "is_last_batch_of_epoch",
    "batch_index_in_epoch",
    "UpdateCounters",
    "set_logging_step",
    "run_zero_grad",
    "lightning_optimizer",
    "process_group_backend",
    "logging_step_set_to",
    "swap_hook_name",
    "first_batch_flag",
    "set_first_batch_flag",
    "metric_step_value",
    "metric_step_value_set_to",
    "logged_collection_items",
    "COLLECTION_STATE_SHARING",
    "run_before_optimizer_step",
    "call_lightning_module_hook",
    "before_batch_transfer",
    "checkpoint_every_n_train_steps",
    "DCP_METADATA_FILE_NAME",
    "set_module_device_mesh",
    "saves_distributed_checkpoint",
    "skip_training_batches",
    "shut_down_loader_workers",
    "forget_saved_loader_states",
    "StrategyRegistry",
    "single_device",
    "set_single_device",
    "model_parallel_sizes",
    "precision_after_closure",
    "callback_state_key",
    "can_stop_early",
    "step_time_left",
    "set_estimated_stepping_batches",
    "stock_estimated_stepping_batches",
    "reopen_interrupted_epoch",
]

# The registry a strategy class registers its names in (``Strategy.register_strategies``'s argument).
StrategyRegistry = _StrategyRegistry

# The file in which Lightning's ModelParallelStrategy keeps the non-tensor part (loops, callbacks, ...) of a DCP folder.
DCP_METADATA_FILE_NAME: str = _METADATA_FILENAME

# Names of the instance attributes we shadow on the epoch loop; deleting them restores Lightning's methods.
_SHADOWED = ("_should_accumulate", "update_lr_schedulers", "_num_ready_batches_reached", "_should_check_val_fx")


class TrainerSettings(Protocol):
    """Public Trainer attributes that Lightning's connectors set from outside the class, where a type checker does
    not see them."""

    callbacks: list[Callback]
    log_every_n_steps: int
    fast_dev_run: int | bool
    profiler: Profiler
    datamodule: pl.LightningDataModule | None


def trainer_settings(trainer: pl.Trainer) -> TrainerSettings:
    """The same trainer, typed with the attributes of ``TrainerSettings``."""
    return cast(TrainerSettings, trainer)


def _epoch_loop(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop.epoch_loop


def _automatic(trainer: pl.Trainer) -> Any:
    return _epoch_loop(trainer).automatic_optimization


@dataclass(frozen=True)
class LoopOverrides:
    """Every override of a Lightning loop method a fit needs, installed and removed as one unit.

    - ``batch_has_no_update`` answers Lightning's "does this batch accumulate?" (``_should_accumulate``). Needed only
      where windows do not follow Lightning's ``batch_idx % accumulate_grad_batches`` rule: windows that run across
      epochs (``partial_window="carry"``), a last partial window that is dropped, and sinks (a Lightning batch holds
      many updates, which the strategy counts itself). Lightning asks before and after the optimizer hook, for LR
      schedulers, logging and validation zero-grad; one answer keeps them consistent.
    - ``hold_step_schedulers`` skips Lightning's step-interval LR scheduler step when it returns True (an update
      skipped on overflow, or in sink mode, where the strategy steps them once per update itself). Plateau
      schedulers are left alone.
    - ``skip_backward``: in sink mode the strategy runs zero-grad and backward per micro-step; Lightning's closure
      around a whole sink must do neither.
    """

    batch_has_no_update: Callable[[], bool] | None = None
    hold_step_schedulers: Callable[[], bool] | None = None
    skip_backward: bool = False
    epoch_ends: Callable[[], bool] | None = None
    validates: Callable[[Callable[[], bool]], bool] | None = None

    @classmethod
    def for_sinks(
        cls,
        made_no_update: Callable[[], bool],
        sink_finished: Callable[[], bool],
        validates: Callable[[Callable[[], bool]], bool],
    ) -> LoopOverrides:
        """A segment of a sink is one Lightning batch: it accumulates when it made no update; the sink steps the
        schedulers; the epoch ends with the sink (``epoch_ends``: after the epoch's first batch, Lightning's
        "last batch of the epoch reached"); ``validates`` answers Lightning's "validate after this batch?"
        (``_should_check_val_fx``), given Lightning's own decision as a function."""
        return cls(
            batch_has_no_update=made_no_update,
            hold_step_schedulers=lambda: True,
            skip_backward=True,
            epoch_ends=sink_finished,
            validates=validates,
        )


def install_loop_overrides(trainer: pl.Trainer, overrides: LoopOverrides) -> None:
    """Put every override in place (instance attributes shadowing the loop's methods); ``remove_loop_overrides``
    takes all of them away again."""
    remove_loop_overrides(trainer)
    loop = _epoch_loop(trainer)
    if overrides.batch_has_no_update is not None:
        loop._should_accumulate = overrides.batch_has_no_update
    hold = overrides.hold_step_schedulers
    if hold is not None:
        original_update = type(loop).update_lr_schedulers.__get__(loop)

        def update_lr_schedulers(interval: str, update_plateau_schedulers: bool) -> None:
            if interval == "step" and not update_plateau_schedulers and hold():
                return
            original_update(interval, update_plateau_schedulers)

        loop.update_lr_schedulers = update_lr_schedulers
    epoch_ends = overrides.epoch_ends
    if epoch_ends is not None:
        loop._num_ready_batches_reached = lambda: loop.batch_progress.current.ready > 0 and epoch_ends()
    validates = overrides.validates
    if validates is not None:
        lightning_decides = type(loop)._should_check_val_fx
        loop._should_check_val_fx = lambda data_fetcher: validates(lambda: lightning_decides(loop, data_fetcher))
    trainer.fit_loop._skip_backward = overrides.skip_backward


def remove_loop_overrides(trainer: pl.Trainer) -> None:
    """Lightning's own loop methods back (deleting the shadowing attributes restores them)."""
    loop = _epoch_loop(trainer)
    for name in _SHADOWED:
        loop.__dict__.pop(name, None)
    trainer.fit_loop._skip_backward = False


def is_last_batch_of_epoch(trainer: pl.Trainer) -> bool:
    """Whether the Lightning batch in flight is the last one of this epoch (known before it runs).

    Lightning's ``_TrainingEpochLoop._num_ready_batches_reached``, computed from the same attributes rather than
    called: it runs for every micro-batch, and the attribute reads stay inside this package (a guard test compares
    the two over fits with sized, limited and unsized loaders)."""
    progress = _epoch_loop(trainer).batch_progress
    return progress.current.ready == trainer.fit_loop.max_batches or bool(progress.is_last_batch)


def batch_index_in_epoch(trainer: pl.Trainer) -> int:
    """``trainer.fit_loop.batch_idx`` (the batch in flight, within its epoch), read from the progress counter that
    Lightning's property derives it from."""
    return int(_epoch_loop(trainer).batch_progress.current.ready) - 1


def _step_progress(trainer: pl.Trainer) -> Any:
    return _automatic(trainer).optim_progress.optimizer.step


class UpdateCounters:
    """Lightning's optimizer progress counters (saved in the loop state; ``trainer.global_step`` reads the
    completed step count), moved as Lightning moves its own. Looked up once per sink: a sink counts hundreds of
    updates, and the walk from the trainer to the counters costs more than the increments."""

    def __init__(self, trainer: pl.Trainer) -> None:
        progress = _automatic(trainer).optim_progress.optimizer
        self._step, self._zero_grad = progress.step, progress.zero_grad

    def update_ready(self) -> None:
        """Before the ``optimizer_step`` hook."""
        self._step.increment_ready()

    def update_completed(self) -> None:
        """After the ``optimizer_step`` hook."""
        self._step.increment_completed()

    def zero_grad(self) -> None:
        """A zero-grad whose hooks nobody overrides (``run_zero_grad`` counts the hooked one)."""
        self._zero_grad.increment_ready()
        self._zero_grad.increment_started()
        self._zero_grad.increment_completed()


def set_logging_step(trainer: pl.Trainer, updated: bool) -> None:
    """The step the loggers write this sink's values at: as stock Lightning, the ``global_step`` before the batch's
    own increment (which Lightning makes after logging, only for a batch that updated)."""
    completed = _step_progress(trainer).total.completed
    _epoch_loop(trainer)._batches_that_stepped = completed - 1 if updated else completed


def run_zero_grad(trainer: pl.Trainer, batch_idx: int, optimizer: Any) -> None:
    """Lightning's own zero-grad step: ``on_before_zero_grad`` (callbacks, module), then the module's
    ``optimizer_zero_grad``, with the optimizer's zero-grad progress counters."""
    automatic = _automatic(trainer)
    automatic._on_before_zero_grad(optimizer)
    automatic._optimizer_zero_grad(batch_idx, optimizer)


def lightning_optimizer(strategy: Any) -> Any:
    """The ``LightningOptimizer`` wrapping the strategy's single optimizer, as Lightning passes it to
    ``LightningModule.optimizer_step``."""
    return strategy._lightning_optimizers[0]


def process_group_backend(strategy: Any) -> str | None:
    """``DDPStrategy``/``ModelParallelStrategy(process_group_backend=...)`` as given (``None``: chosen by device)."""
    return strategy._process_group_backend


@contextmanager
def logging_step_set_to(trainer: pl.Trainer, step: int) -> Iterator[None]:
    """Lightning's logging step (the step its loggers and ``LearningRateMonitor`` write at, and the one
    ``log_every_n_steps`` is checked against) set to ``step`` for the duration of the block, then restored."""
    loop = _epoch_loop(trainer)
    saved, loop._batches_that_stepped = loop._batches_that_stepped, step
    try:
        yield
    finally:
        loop._batches_that_stepped = saved


def swap_hook_name(module: pl.LightningModule, name: str | None) -> str | None:
    """Set Lightning's current hook name on the module (what ``self.log`` files its values under, and whose change
    during an epoch's first batch resets that hook's accumulated values) and return the previous one, to be put
    back as Lightning's own hook calls do. (A plain string attribute: written to the instance's ``__dict__``, where
    ``nn.Module.__setattr__`` would put it after its checks for parameters, buffers and submodules.)"""
    attributes = vars(module)
    previous = attributes["_current_fx_name"]
    attributes["_current_fx_name"] = name
    return cast(str | None, previous)


def first_batch_flag(trainer: pl.Trainer) -> bool | None:
    """Whether Lightning's logging treats the running batch as its epoch's first (``None`` between epochs): while it
    does, ``self.log`` resets a hook's accumulated values whenever the hook name changes."""
    return trainer._logger_connector._first_loop_iter


def set_first_batch_flag(trainer: pl.Trainer, value: bool | None) -> None:
    trainer._logger_connector._first_loop_iter = value


def metric_step_value(metric: Any) -> Any:
    """What Lightning writes as a logged torchmetrics ``Metric``'s step value: the result of the metric's latest
    forward call (the ``_forward_cache`` Lightning's result collection reads; None before any)."""
    return metric._forward_cache


@contextmanager
def metric_step_value_set_to(metric: Any, value: Any) -> Iterator[None]:
    """The Metric's step value, as Lightning reads it when it is logged, set to ``value`` for the block."""
    saved = metric._forward_cache
    metric._forward_cache = value
    try:
        yield
    finally:
        metric._forward_cache = saved


# The MetricCollection method that makes the members of a compute group share (or copy) the group's state; its
# public readers (``items``, ``values``, ``collection[key]``) call it and set a flag on the collection as they read.
COLLECTION_STATE_SHARING = "_compute_groups_create_state_ref"


def logged_collection_items(collection: Any) -> list[tuple[str, Any]]:
    """What ``LightningModule.log_dict(collection)`` logs for a torchmetrics ``MetricCollection``: its entries under
    their prefixed names, read with Lightning's own arguments (with compute groups, the members share their group's
    state by reference rather than by copy, which ``items`` sets up as it is read)."""
    options: dict[str, bool] = {"keep_base": False}
    if collection._enable_compute_groups:
        options["copy_state"] = False
    return list(collection.items(**options))


def run_before_optimizer_step(trainer: pl.Trainer, optimizer: Any) -> None:
    """Call the ``on_before_optimizer_step`` hooks and clip gradients, as Lightning does after its closure."""
    precision_after_closure(trainer.strategy.precision_plugin, trainer.lightning_module, optimizer)


def precision_after_closure(plugin: Any, module: pl.LightningModule, optimizer: Any) -> None:
    """What a Lightning precision plugin does between its closure and the optimizer step: the
    ``on_before_optimizer_step`` hooks, then gradient clipping."""
    plugin._after_closure(module, optimizer)


def single_device(strategy: Any) -> torch.device:
    """The device a ``SingleDeviceStrategy`` was built with (its ``root_device``), without asking its accelerator."""
    return strategy._root_device


def set_single_device(strategy: Any, device: torch.device) -> None:
    """Point a ``SingleDeviceStrategy`` at another device (what ``root_device`` returns)."""
    strategy._root_device = device


def model_parallel_sizes(strategy: Any) -> tuple[int | str, int | str]:
    """``ModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=...)`` as given (``"auto"`` or an int)."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def callback_state_key(callback: Any, **settings: Any) -> str:
    """Lightning's state key format for a callback: its class name and the settings that tell instances apart."""
    return callback._generate_state_key(**settings)


def call_lightning_module_hook(trainer: pl.Trainer, name: str, *args: Any) -> Any:
    return call._call_lightning_module_hook(trainer, name, *args)


def before_batch_transfer(module: pl.LightningModule, batch: Any) -> Any:
    """``on_before_batch_transfer`` as Lightning's training loop calls it (the module's, or its datamodule's)."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def checkpoint_every_n_train_steps(callback: Any) -> int:
    """``ModelCheckpoint(every_n_train_steps=n)``'s n (0 when it does not save by steps); Lightning keeps it private."""
    return int(callback._every_n_train_steps or 0)


def set_module_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """What ``ModelParallelStrategy.setup_environment`` does, so ``configure_model`` sees ``self.device_mesh``."""
    module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``'s value (a DCP folder, not one full file)."""
    return bool(strategy._save_distributed_checkpoint)


def skip_training_batches(trainer: pl.Trainer, count: int) -> int:
    """Fetch and discard the first ``count`` batches of the training pass Lightning is about to start; returns how
    many there were (fewer when the pass is shorter).

    For a mid-epoch resume: Lightning restores its batch counters (so the epoch ends where it would have) but
    restarts a plain loader's iterator from its first batch. Skipping goes through Lightning's fetcher, so a batch it
    prefetched is dropped too, and its fetch count is put back: Lightning adds the restored batches to it itself.
    """
    fetcher = trainer.fit_loop._data_fetcher
    assert fetcher is not None, "the training loader's iterator is created before on_train_start"
    fetch = fetcher.__next__ if isinstance(fetcher, _PrefetchDataFetcher) else lambda: _DataFetcher.__next__(fetcher)
    fetched, skipped = fetcher.fetched, 0
    try:
        for _ in range(count):
            fetch()
            skipped += 1
    except StopIteration:
        pass
    fetcher.fetched = fetched
    return skipped


def shut_down_loader_workers(loader: object) -> None:
    """What Lightning does to a training loader at the end of fit: stop its (persistent) workers, drop its iterator."""
    _shutdown_workers_and_reset_iterator(loader)


def forget_saved_loader_states(trainer: pl.Trainer) -> None:
    """Keep Lightning from loading the checkpoint's state into a stateful training loader (the strategy resumes the
    loader itself); Lightning reads these states right after ``Strategy.process_dataloader``."""
    trainer.fit_loop._combined_loader_states_to_load = []


def can_stop_early(trainer: pl.Trainer) -> bool:
    """Whether ``trainer.should_stop`` may end the fit now (``min_epochs``/``min_steps`` are met)."""
    return bool(trainer.fit_loop._can_stop_early)


def step_time_left(trainer: pl.Trainer) -> float | None:
    """Seconds left before a ``Timer`` (``Trainer(max_time=...)``) that checks after every training batch stops the
    fit; ``None`` without such a timer."""
    for callback in trainer_settings(trainer).callbacks:
        if isinstance(callback, Timer) and callback._interval == "step" and callback._duration is not None:
            left = callback.time_remaining("train")
            if left is not None:
                return float(left)
    return None


# ``Trainer.estimated_stepping_batches`` is a property of the class; a fit that knows its updates better (sink
# mode, where an epoch is a sink) registers its own estimate here, and the property, wrapped once per Trainer class
# that defines it (``lightning`` and ``pytorch_lightning`` each have one), asks it first.
_ESTIMATES: weakref.WeakKeyDictionary[Any, Callable[[], int | float]] = weakref.WeakKeyDictionary()
_STOCK_ESTIMATES: dict[type, Callable[[Any], int | float]] = {}
_NAME = "estimated_stepping_batches"


def _estimate_owner(trainer: pl.Trainer) -> type:
    return next(cls for cls in type(trainer).__mro__ if _NAME in vars(cls))


def set_estimated_stepping_batches(trainer: pl.Trainer, estimate: Callable[[], int | float] | None) -> None:
    """Make ``trainer.estimated_stepping_batches`` return ``estimate()`` (``None``: Lightning's own again)."""
    if estimate is None:
        _ESTIMATES.pop(trainer, None)
        return
    owner = _estimate_owner(trainer)
    if owner not in _STOCK_ESTIMATES:
        stock = vars(owner)[_NAME]
        _STOCK_ESTIMATES[owner] = stock.fget

        def estimated_stepping_batches(self: Any) -> int | float:
            own = _ESTIMATES.get(self)
            return own() if own is not None else stock.fget(self)

        estimated_stepping_batches.__doc__ = stock.__doc__
        setattr(owner, _NAME, property(estimated_stepping_batches))
    _ESTIMATES[trainer] = estimate


def stock_estimated_stepping_batches(trainer: pl.Trainer) -> int | float:
    """Lightning's own ``estimated_stepping_batches`` (which loads the training data if it is not loaded yet)."""
    owner = _estimate_owner(trainer)
    fget = _STOCK_ESTIMATES.get(owner) or vars(owner)[_NAME].fget
    return fget(trainer)


def reopen_interrupted_epoch(checkpoint: dict[str, Any]) -> bool:
    """In a checkpoint Lightning saved after a stop inside an epoch (``max_steps``), mark that epoch as interrupted
    rather than finished, as in a checkpoint saved during it: a resume then continues it instead of starting the
    next. Returns whether the checkpoint was changed (it is left alone when its epoch is already open)."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit_loop, dict):
        return False
    progress = fit_loop.get("epoch_progress")
    if not isinstance(progress, dict):
        return False
    total, current = progress.get("total"), progress.get("current")
    if not (isinstance(total, dict) and isinstance(current, dict)):
        return False
    trackers: list[dict[str, Any]] = [total, current]
    if any(tracker.get("completed") != tracker.get("ready") or not tracker.get("ready") for tracker in trackers):
        return False
    for tracker in trackers:
        tracker["processed"] = tracker["completed"] = tracker["ready"] - 1
    checkpoint["epoch"] = max(0, int(checkpoint.get("epoch", 1)) - 1)
    return True


def check_before_resume(strategy: Any, check: Callable[[Any], None]) -> None:
    """Have ``check(checkpoint_path)`` run where Lightning starts restoring a run, before it loads anything: on every
    rank, with the path that rank resolved (``None`` where it resolved none, e.g. a ``ckpt_path="last"`` with no
    last checkpoint on its node), so that it may be a collective. Replaces any check installed before."""
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is None:
        return
    connector = trainer._checkpoint_connector
    stock = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        check(checkpoint_path)
        stock(checkpoint_path, weights_only=weights_only)

    vars(connector)["resume_start"] = resume_start


def recorded_step_counts(checkpoint: dict[str, Any]) -> set[int]:
    """The optimizer step counts a checkpoint's loop state records (automatic and manual optimization's), from which
    Lightning restores ``global_step``; the checkpoint's top-level ``global_step`` is one of them in every checkpoint
    a run writes. Empty where the loop state is absent or not in this shape."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop") if isinstance(checkpoint.get("loops"), dict) else None
    if not isinstance(fit_loop, dict):
        return set()
    automatic = fit_loop.get("epoch_loop.automatic_optimization.optim_progress")
    manual = fit_loop.get("epoch_loop.manual_optimization.optim_step_progress")
    totals = [
        automatic.get("optimizer", {}).get("step", {}).get("total") if isinstance(automatic, dict) else None,
        manual.get("total") if isinstance(manual, dict) else None,
    ]
    return {
        total["completed"]
        for total in totals
        if isinstance(total, dict)
        and isinstance(total.get("completed"), int)
        and not isinstance(total["completed"], bool)
    }
