"""``self.log`` inside a sink: recorded on the device per micro-step, handed to Lightning once per sink, and written
to the loggers at every update where Lightning would have written it without sinking.

Lightning's ``self.log`` does real work per call (validation, metadata, result bookkeeping), a large share of a
small model's whole step; a sink of K micro-steps would pay it K times per key although Lightning reads
the values only once, at the sink's end (a sink is one Lightning batch). ``SinkLogBuffer`` stands in for
``LightningModule.log`` while a sink runs: each call appends the value (a device tensor, nothing is read back) and
its micro-batch size. At the end of the sink every key goes to the real ``self.log`` at most twice, so that
Lightning's results are what K calls would have made them:

- the step value (what the progress bar and callbacks see) is the last micro-step's value, or, when the sink ends
  inside an accumulation window, the value of the sink's last update (Lightning writes it at that update's step);
- the epoch aggregate (``on_epoch=True``) covers every micro-step: the first call carries the other micro-steps,
  reduced with the key's ``reduce_fx`` (for "mean", their batch-size-weighted mean with their summed batch size),
  the second the step value.

The batch size of an ``on_epoch`` mean is taken from the micro-batch itself, as Lightning takes it from its batch
(Lightning's own batch in sink mode is a placeholder with no size). Calls the buffer does not reduce
(``enable_graph=True``, another ``reduce_fx``, a value Lightning would reject) go to the real ``self.log`` at once.
So does a torchmetrics ``Metric`` (Lightning holds the Metric itself, and its ``compute`` is the epoch value), at
its first call in the sink and again at the sink's end; the buffer records the metric's step value at each call
(its latest forward result, what Lightning writes at a step) for the updates Lightning does not see, and, when the
sink ends inside a window, gives Lightning the last update's.

Loggers. Without sinking, Lightning writes the step values at the end of the batch that makes the u-th update when
``u % log_every_n_steps == 0``, at step u - 1, and ``LearningRateMonitor`` writes the learning rates at the start of
the batches of that update, also at step u - 1. A sink is one Lightning batch, so Lightning itself only sees the
sink's start (the first update's learning rates) and its end (the last update's values). The strategy calls
``end_update`` after each update inside the sink, which notes how many values each key had by then and the
optimizers' settings the update left for the next one; ``flush`` then writes, for every update of the sink but the
last, the values Lightning would have written at its step (read back in one transfer, only when a point is due),
and runs each ``LearningRateMonitor``'s batch-start hook as of the update that followed it
(``sink/learning_rate_replay.py``).
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torchmetrics import Metric

from lightning_sink import _lightning_compat as compat
from lightning_sink.sink.learning_rate_replay import LearningRateReplay, Settings
from lightning_sink.sink.staging import StagedBatch

__all__ = ["SinkLogBuffer"]

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)
_MAX_BOUND = 256  # distinct (name, arguments) of ``self.log`` calls whose bound options a buffer keeps
# reduce_fx values whose K-step result the buffer can rebuild from a reduced prefix and the last value; the names
# are also the reduce_op names of ``Strategy.reduce`` (Lightning syncs ``sync_dist`` values with the same op).
_REDUCTIONS: dict[Any, str] = {
    "mean": "mean",
    "avg": "mean",
    torch.mean: "mean",
    "sum": "sum",
    torch.sum: "sum",
    "max": "max",
    torch.max: "max",
    "min": "min",
    torch.min: "min",
}


def _logs_at_update(trainer: pl.Trainer, update: int) -> bool:
    """Whether Lightning writes the step values of the batch that makes the ``update``-th optimizer update
    (``should_update_logs`` in Lightning's logger connector, for the fit loop, and ``fast_dev_run``)."""
    settings = compat.trainer_settings(trainer)
    every_n = settings.log_every_n_steps
    return (every_n > 0 and (update % every_n == 0 or trainer.should_stop)) or bool(settings.fast_dev_run)


@dataclass
class _Key:
    """One logged name's calls during a sink, all with the same options (Lightning refuses differing ones)."""

    options: dict[str, Any]
    reduction: str
    values: list[Tensor] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    # A torchmetrics Metric goes to Lightning at every call (Lightning accumulates it itself); its step values are
    # recorded here only for the updates Lightning does not see.
    metric: Metric | None = None


@dataclass
class _MetricLog:
    """A Metric's last ``self.log`` call in the sink, and whether there was more than one."""

    metric: Metric
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    again: bool = False


@dataclass
class _Update:
    """An optimizer update made inside a sink: the global step after it, how many values each key had by then, and
    (when a LearningRateMonitor will write at its step) the optimizers' settings it left for the next update."""

    global_step: int
    counts: dict[str, int]
    settings: list[Settings] | None


class SinkLogBuffer:
    """Records a LightningModule's ``self.log`` calls during one sink; ``flush`` hands them to Lightning."""

    def __init__(self, module: pl.LightningModule) -> None:
        self._module = module
        self._trainer = module.trainer
        self._stands_in = self.usable(module)
        self._learning_rates = LearningRateReplay(module)
        self._keys: dict[str, _Key] = {}
        self._bound: dict[
            tuple[Any, ...], dict[str, Any]
        ] = {}  # ``self.log``'s options by its arguments (``_options``)
        # each Metric logged in this sink: how it was last logged (Lightning gets it at the first and the last call)
        self._metric_logs: dict[str, _MetricLog] = {}
        self._updates: list[_Update] = []
        # the settings a LearningRateMonitor will read after an update whose schedulers were stepped before its
        # compiled call, by the global step that update makes (``schedulers_stepped``)
        self._settings_ahead: dict[int, list[Settings]] = {}
        self._micro_steps_since_update = 0
        self._micro_steps_in_sink = 0
        self._first_batch_flag: bool | None = None  # Lightning's, as the sink started
        self._micro_batch: Any = None
        self._micro_batch_size: int | None = None
        self._real_log: Callable[..., None] = module.log  # (the module's own, taken again at each install)
        self._log = torch.compiler.disable(self.log)  # a graph break under graph_mode="compile", as Lightning's

    @staticmethod
    def usable(module: pl.LightningModule) -> bool:
        """Whether the buffer can stand in for ``self.log``: not for a module that defines its own ``log`` (it
        would no longer be called per micro-step); such a module's values reach the loggers once per sink."""
        return not is_overridden("log", module, pl.LightningModule)

    # ------------------------------------------------------------------ around a sink
    def install(self) -> None:
        self._micro_steps_in_sink = 0
        self._first_batch_flag = compat.first_batch_flag(self._trainer)
        if self._stands_in:
            self._real_log = self._module.log
            vars(self._module)["log"] = (
                self._log
            )  # an instance attribute; ``log_dict`` calls ``self.log`` and lands here too

    def uninstall(self) -> None:
        if self._stands_in:
            self._module.__dict__.pop("log", None)
        self._keys.clear()
        self._metric_logs.clear()
        self._updates.clear()
        self._settings_ahead.clear()
        self._micro_steps_since_update = 0
        self._micro_batch = None
        if self._micro_steps_in_sink > 1:
            compat.set_first_batch_flag(self._trainer, self._first_batch_flag)

    def begin_micro_step(self, batch: Any) -> None:
        self._micro_batch, self._micro_batch_size = batch, None
        self._micro_steps_since_update += 1
        self._micro_steps_in_sink += 1
        if self._micro_steps_in_sink == 2:
            # A sink is one Lightning batch, often its epoch's first, during which Lightning resets a hook's values
            # at each change of hook name (training_step, then a hook such as on_after_backward, which also log).
            # Without sinking only the epoch's first micro-batch is such a batch: the rest of the sink is not.
            compat.set_first_batch_flag(self._trainer, False)

    def end_update(self) -> None:
        """Called by the strategy after each optimizer update inside the sink (after its LR schedulers stepped)."""
        self._micro_steps_since_update = 0
        if not self._keys and not self._learning_rates.monitors:
            return  # nothing logged yet (keys are only added): the update has nothing to write
        trainer = self._trainer
        settings = None
        if self._wants_settings(trainer.global_step):
            settings = self._settings_ahead.pop(trainer.global_step, None)
            if settings is None:
                settings = self._learning_rates.settings_now()
        self._updates.append(
            _Update(trainer.global_step, {name: len(key.values) for name, key in self._keys.items()}, settings)
        )

    def schedulers_stepped(self, global_step: int) -> None:
        """The step schedulers were just stepped for the update that will make ``global_step``, ahead of that
        update's own effects (a compiled call of several, ``sink/programs/scheduler_steps.py``): the settings they
        left are kept for its ``end_update`` where a LearningRateMonitor will read them."""
        if self._wants_settings(global_step):
            self._settings_ahead[global_step] = self._learning_rates.settings_now()

    def _wants_settings(self, global_step: int) -> bool:
        """Whether a LearningRateMonitor writes at the update after the one that makes ``global_step``."""
        trainer = self._trainer
        return (
            bool(self._learning_rates.monitors) and bool(trainer.loggers) and _logs_at_update(trainer, global_step + 1)
        )

    # ------------------------------------------------------------------ the stand-in for self.log
    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        options = self._options(name, value, args, kwargs)
        batch_size = options.pop("batch_size")  # may differ per call (a last, smaller micro-batch), as in Lightning
        if isinstance(value, Metric):
            # Lightning holds the Metric itself (its epoch value is the Metric's compute over all its updates), so
            # it needs the sink's first call, which registers and checks it, and the last (flush), which leaves the
            # step value; the calls between would each move Lightning's whole result to the device again
            logged = self._metric_logs.get(name)
            if logged is None:
                self._real_log(name, value, *args, **kwargs)
                self._metric_logs[name] = _MetricLog(value, args, kwargs)
            else:
                logged.metric, logged.args, logged.kwargs, logged.again = value, args, kwargs, True
            self._record_metric_step_value(name, value, options)
            return
        reduction = _REDUCTIONS.get(options["reduce_fx"])
        tensor = _as_scalar_tensor(value, self._module.device)
        if reduction is None or tensor is None or options["enable_graph"] or "/dataloader_idx_" in name:
            self._real_log(name, value, *args, **kwargs)  # Lightning handles it (or raises its own error)
            return
        # Lightning's defaults inside training_step: on_step=True, on_epoch=False
        options["on_step"] = True if options["on_step"] is None else options["on_step"]
        options["on_epoch"] = False if options["on_epoch"] is None else options["on_epoch"]
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = _Key(options, reduction)
        elif key.options != options:
            raise ValueError(
                f"self.log({name!r}, ...) was called with different arguments in one sink: {key.options} and then"
                f" {options}. Log each name with the same arguments on every step."
            )
        key.values.append(tensor)
        key.batch_sizes.append(self._batch_size(batch_size, options))

    def _options(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's options as ``LightningModule.log``'s signature binds them (defaults applied). Binding is most
        of a call's cost, so the result is kept per name and arguments (the same on every step, as a rule)."""
        cache_key = (name, args, tuple(kwargs.items()))
        try:
            bound, keeps = self._bound.get(cache_key), True
        except TypeError:  # an argument that cannot be a key (unhashable): bound each time
            bound, keeps = None, False
        if bound is None:
            call = _LOG_SIGNATURE.bind(self._module, name, value, *args, **kwargs)  # (raises as Lightning's would)
            call.apply_defaults()
            bound = dict(call.arguments)
            del bound["self"], bound["name"], bound["value"]
            if keeps:
                if len(self._bound) >= _MAX_BOUND:
                    self._bound.clear()  # (arguments that change every call, such as a tensor: nothing to keep)
                self._bound[cache_key] = bound
        return dict(bound)

    def _record_metric_step_value(self, name: str, metric: Metric, options: dict[str, Any]) -> None:
        """The Metric's step value as of this call (what Lightning would write at this micro-step's update)."""
        if options["on_step"] is False or options["logger"] is False:
            return  # (None: Lightning's default inside training_step, on step and to the logger)
        value = compat.metric_step_value(metric)
        if not isinstance(value, Tensor) or value.numel() != 1:
            return  # Lightning writes no step value (no forward call yet) or raises its own error at the sink end
        key = self._keys.get(name)
        if key is None:
            options["on_step"] = True
            options["on_epoch"] = False if options["on_epoch"] is None else options["on_epoch"]
            key = self._keys[name] = _Key(options, "metric", metric=metric)
        key.values.append(value.detach().clone())  # (the metric's next forward call replaces it)
        key.batch_sizes.append(1)

    def _batch_size(self, given: int | None, options: dict[str, Any]) -> int:
        if given is not None:
            return int(given)
        if not (options["on_epoch"] and _REDUCTIONS[options["reduce_fx"]] == "mean"):
            return 1  # unused by Lightning: only an epoch mean is weighted
        if self._micro_batch_size is None:
            batch = self._micro_batch
            # (a staged batch's size is its number of indices, one per sample: the size of the batch the loader
            # path reads for them)
            staged = isinstance(batch, StagedBatch)
            self._micro_batch_size = len(batch.indices) if staged else extract_batch_size(batch)
        return self._micro_batch_size

    # ------------------------------------------------------------------ at the sink's end
    def flush(self) -> None:
        """Hand every recorded key to the real ``self.log``; write the updates Lightning does not see to the loggers."""
        updates, self._updates = self._updates, []
        # Lightning writes the step values at the step of the sink's last update: when micro-steps of the next
        # window follow that update, the step value is the update's own, not the last micro-step's.
        last_update = updates[-1].counts if updates and self._micro_steps_since_update else {}
        for name, key in self._keys.items():
            step_index = (last_update.get(name) or len(key.values)) - 1
            if key.metric is None:
                self._hand_to_lightning(name, key, step_index)
            elif step_index != len(key.values) - 1:
                # Lightning already has the Metric; its step value is to be the update's, not the last micro-step's
                with compat.metric_step_value_set_to(key.metric, key.values[step_index]):
                    self._real_log(name, key.metric, **key.options)
            elif self._metric_logs[name].again:
                self._real_log(name, key.metric, **key.options)  # the step value of the sink's last call
        for name, logged in self._metric_logs.items():
            if name not in self._keys and logged.again:  # (no step value recorded: the last call as it was made)
                self._real_log(name, logged.metric, *logged.args, **logged.kwargs)
        self._write_updates_before_the_last(updates[:-1])
        self._keys.clear()
        self._metric_logs.clear()

    def _hand_to_lightning(self, name: str, key: _Key, step_index: int) -> None:
        """The other micro-steps reduced (for the epoch aggregate), then the step value: Lightning keeps the last."""
        values = torch.stack([_to_log_dtype(value) for value in key.values])
        if key.options["on_epoch"] and len(values) > 1:
            others = torch.cat([values[:step_index], values[step_index + 1 :]])
            sizes = key.batch_sizes[:step_index] + key.batch_sizes[step_index + 1 :]
            earlier, earlier_size = _reduce(others, sizes, key.reduction)
            self._real_log(name, earlier, batch_size=earlier_size, **key.options)
        self._real_log(name, values[step_index], batch_size=key.batch_sizes[step_index], **key.options)

    def _write_updates_before_the_last(self, updates: list[_Update]) -> None:
        """What Lightning would have written around each of these updates: its step values (at the end of its
        batch) and the learning rates for the next update (at the start of that update's batches)."""
        trainer = self._trainer
        if not updates or not trainer.loggers:
            return
        due = [update for update in updates if _logs_at_update(trainer, update.global_step)]
        points = dict(zip((update.global_step for update in due), self._read_step_values(due)))
        for update in updates:
            point = points.get(update.global_step)
            if point:
                point["epoch"] = trainer.current_epoch  # as Lightning adds to every point it writes
                for logger in trainer.loggers:
                    logger.log_metrics(point, step=update.global_step - 1)
            if update.settings is not None:
                self._learning_rates.replay(update.global_step, update.settings)

    def _read_step_values(self, due: list[_Update]) -> list[dict[str, float]]:
        """Each due update's step values by logged name; one read back for all of them."""
        points: list[dict[str, float]] = [{} for _ in due]
        columns: list[Tensor] = []
        placements: list[tuple[str, list[int]]] = []
        for name, key in self._keys.items():
            if key.options["logger"] is False or not key.options["on_step"]:  # (None: Lightning logs it)
                continue
            rows = [(row, update.counts[name] - 1) for row, update in enumerate(due) if update.counts.get(name)]
            if rows:
                column = torch.stack([_to_log_dtype(key.values[index]) for _, index in rows])
                columns.append(self._synced(column, key).double())
                placements.append((f"{name}_step" if key.options["on_epoch"] else name, [row for row, _ in rows]))
        if columns:
            values = iter(torch.cat(columns).tolist())  # the one host read of this sink's points
            for logged_name, point_rows in placements:
                for row in point_rows:
                    points[row][logged_name] = next(values)
        return points

    def _synced(self, values: Tensor, key: _Key) -> Tensor:
        """``sync_dist=True`` values reduced across ranks, as Lightning reduces each step value it logs."""
        options, trainer = key.options, self._trainer
        if key.metric is not None:
            return values  # Lightning writes a Metric's step value as the metric computed it
        if not options["sync_dist"] or options["rank_zero_only"] or trainer.world_size == 1:
            return values
        return trainer.strategy.reduce(values, group=options["sync_dist_group"], reduce_op=key.reduction)


def _as_scalar_tensor(value: Any, device: torch.device) -> Tensor | None:
    """The value as a one-element tensor on the module's device, or None when it is not one."""
    if isinstance(value, Tensor):
        # a copy, as Lightning's own logging takes: the value at the call, even if the tensor changes in place later
        # in the sink or is a CUDA graph's output buffer that the next replay overwrites
        return value.detach().clone() if value.numel() == 1 else None
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return torch.tensor(value, dtype=torch.get_default_dtype(), device=device)  # as Lightning converts numbers
    return None


def _to_log_dtype(value: Tensor) -> Tensor:
    """Lightning keeps logged values in float32 or float64 (it converts lower precisions and integers)."""
    value = value.reshape(())
    return value if value.dtype in (torch.float32, torch.float64) else value.to(torch.get_default_dtype())


def _reduce(values: Tensor, batch_sizes: list[int], reduction: str) -> tuple[Tensor, int]:
    """One value (and batch size) that Lightning's accumulation turns into the same result as the given steps."""
    if reduction == "mean":
        total = sum(batch_sizes)
        if len(set(batch_sizes)) == 1:
            return values.mean(), total
        # Python-number weights: a weight tensor would be a host-to-device copy, which waits for the device
        return torch.stack([value * size for value, size in zip(values, batch_sizes)]).sum() / total, total
    if reduction == "sum":
        return values.sum(), 1
    return (values.max() if reduction == "max" else values.min()), 1
