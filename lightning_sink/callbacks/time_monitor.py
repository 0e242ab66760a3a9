"""``TimeMonitor``: MindSpore's ``epoch time: ... ms, per step time: ... ms`` line, with throughput, for Lightning.

Once per epoch, which in sink mode (``SinkStrategy(sink_size=K)``, one sink per epoch) is once per sink:

- epoch time: from ``on_train_epoch_start`` to ``on_train_epoch_end`` (validation at the epoch's end included);
- per step time: training time / steps, where training time runs from the epoch's start to its last batch's end
  minus any validation in between (data loading included); in sink mode that is the sink's time / K;
- throughput: ``data_size * steps / training time`` samples per second.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_sink.callbacks._progress import StepCounter, UpdateAxis, is_sink, log_scalars
from lightning_sink.counts import check_count_fits
from lightning_sink.sink_data import SinkLoader

__all__ = ["TimeMonitor", "TIME_SCALARS"]

TIME_SCALARS = ("time/epoch_ms", "time/step_ms", "time/samples_per_s")


def _samples_per_step(trainer: pl.Trainer, batch: Any) -> int | None:
    """The global micro-batch: this rank's batch size times the ranks, or None when it cannot be told."""
    if is_sink(batch):  # the micro-batches are inside the sink; ask the loader the sink draws them from
        loader = trainer.train_dataloader
        loader = loader.loader if isinstance(loader, SinkLoader) else loader
        local = getattr(loader, "batch_size", None)
    else:
        try:
            local = extract_batch_size(batch)
        except MisconfigurationException:
            local = None
    return None if local is None else local * trainer.world_size


class TimeMonitor(Callback):
    """Print and log per-epoch time, per-step time and throughput, as MindSpore's ``TimeMonitor`` prints them.

    Args:
        data_size: samples per step, all ranks together (the global micro-batch). ``None`` infers it from the
            batch (outside sink mode) or the training loader's ``batch_size`` (sink mode), times the ranks; if that
            fails the throughput is left out. (MindSpore's ``data_size`` is the number of steps per epoch, which
            it needs because its callbacks cannot count them; here the steps are counted.)

    Printed on global rank 0 (rank 0's times):
    ``epoch time: 1234.567 ms, per step time: 12.346 ms, throughput: 2592.000 samples/s``. Logged to every logger
    as ``time/epoch_ms``, ``time/step_ms`` and ``time/samples_per_s`` on Lightning's step axis, at the step of the
    epoch's last micro-batch (u - 1 when it belongs to the u-th optimizer update; see ``LossMonitor``).
    The run's step count survives a restart via ``state_dict``; a resumed epoch is timed from the resume.
    """

    def __init__(self, data_size: int | None = None) -> None:
        check_count_fits("data_size", data_size)
        if data_size is not None and (isinstance(data_size, bool) or not isinstance(data_size, int) or data_size < 1):
            raise ValueError(
                f"data_size={data_size!r} is not valid: pass an int >= 1 (samples per step, all ranks together) or"
                " None to infer it from the batches."
            )
        self.data_size = data_size
        self.steps = StepCounter()
        self._epoch_start = self._last_batch_end = 0.0
        self._train_seconds = self._validation_seconds = 0.0
        self._epoch_steps = 0
        self._samples_per_step: int | None = data_size
        self._in_epoch = False
        self._validation_start: float | None = None
        self._axis = UpdateAxis()
        self._last_batch_step = 0  # the step axis position of the epoch's last batch so far

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start_epoch()
        self._epoch_start = self._last_batch_end = time.perf_counter()
        self._train_seconds = self._validation_seconds = 0.0
        self._epoch_steps = 0
        self._in_epoch = True

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._axis.batch_start(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self._train_seconds += now - self._last_batch_end - self._validation_seconds
        self._last_batch_end, self._validation_seconds = now, 0.0
        self._epoch_steps += self.steps.advance(outputs, batch, batch_idx)
        self._last_batch_step = self._axis.position(trainer)[0]
        if self._samples_per_step is None:
            self._samples_per_step = _samples_per_step(trainer, batch)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_epoch:
            self._validation_start = time.perf_counter()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._in_epoch and self._validation_start is not None:
            self._validation_seconds += time.perf_counter() - self._validation_start
            self._validation_start = None

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        epoch_ms = (time.perf_counter() - self._epoch_start) * 1000.0
        self._in_epoch = False
        if self._epoch_steps == 0:
            return
        step_ms = self._train_seconds * 1000.0 / self._epoch_steps
        metrics = {"time/epoch_ms": epoch_ms, "time/step_ms": step_ms}
        line = f"epoch time: {epoch_ms:5.3f} ms, per step time: {step_ms:5.3f} ms"
        if self._samples_per_step is not None and self._train_seconds > 0:
            throughput = self._samples_per_step * self._epoch_steps / self._train_seconds
            metrics["time/samples_per_s"] = throughput
            line += f", throughput: {throughput:5.3f} samples/s"
        if trainer.is_global_zero:
            print(line, flush=True)
        log_scalars(trainer, metrics, step=self._last_batch_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps.load_state_dict(state_dict["steps"])
