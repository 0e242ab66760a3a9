"""The monitors read device values back to the host only at their print points (once), never per step."""

from __future__ import annotations

import torch

from lightning_sink import DynamicLossScale, LossScalePrecision, SinkStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor
from tests.callbacks.common import MICRO, SAMPLES, RecordingClassifier
from tests.helpers import loader, make_dataset, quiet_trainer

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")  # what reads a value back


class ReadCounter:
    """Counts the Tensor read methods called inside each listed hook of one callback, one count per call."""

    def __init__(self, callback, hooks=("on_train_batch_end", "on_train_epoch_end")):
        self.counts = {hook: [] for hook in hooks}
        self._active, self._count = False, 0
        for hook in hooks:
            original = getattr(callback, hook)

            def counted(*args, _original=original, _hook=hook, **kwargs):
                self._active, self._count = True, 0
                try:
                    return _original(*args, **kwargs)
                finally:
                    self._active = False
                    self.counts[_hook].append(self._count)

            setattr(callback, hook, counted)  # Lightning looks hooks up on the instance

    def __enter__(self):
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}
        for name, original in self._originals.items():

            def counting(tensor, *args, _original=original, **kwargs):
                self._count += self._active
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)


def fit(callbacks, sink_size=None, epochs=2):
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=1024.0))
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=2, sink_size=sink_size),
        max_epochs=epochs,
        plugins=[plugin],
        callbacks=callbacks,
    )
    trainer.fit(RecordingClassifier(), loader(make_dataset(num_samples=SAMPLES), MICRO))


def test_per_batch_reads_only_at_print_points():
    loss, scale, times = LossMonitor(4), LossScaleMonitor(3), TimeMonitor()
    counters = [ReadCounter(callback) for callback in (loss, scale, times)]
    with counters[0], counters[1], counters[2]:
        fit([loss, scale, times])
    steps = 2 * SAMPLES // MICRO
    assert counters[0].counts["on_train_batch_end"] == [int(t % 4 == 0) for t in range(1, steps + 1)]
    assert counters[0].counts["on_train_epoch_end"] == [1, 0]  # steps 9-10 are checked at the end of epoch 1
    # One read per printed line: every 3rd update = every 6th step.
    assert counters[1].counts["on_train_batch_end"] == [int(t % 6 == 0) for t in range(1, steps + 1)]
    assert sum(counters[2].counts["on_train_batch_end"] + counters[2].counts["on_train_epoch_end"]) == 0


def test_sink_mode_reads_once_per_sink():
    loss, scale, times = LossMonitor(1), LossScaleMonitor(1), TimeMonitor()
    counters = [ReadCounter(callback) for callback in (loss, scale, times)]
    with counters[0], counters[1], counters[2]:
        fit([loss, scale, times], sink_size=6, epochs=3)
    assert counters[0].counts == {"on_train_batch_end": [1, 1, 1], "on_train_epoch_end": [0, 0, 0]}
    assert counters[1].counts["on_train_batch_end"] == [1, 1, 1]
    assert sum(counters[2].counts["on_train_batch_end"]) == 0


def test_the_counter_sees_reads():
    """Guard: a callback that reads every batch's loss is counted."""
    from lightning.pytorch.callbacks import Callback

    class Reader(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            float(outputs["loss"])

        def on_train_epoch_end(self, trainer, pl_module):
            pass

    reader = Reader()
    counter = ReadCounter(reader)
    with counter:
        fit([reader], epochs=1)
    assert counter.counts["on_train_batch_end"] == [1] * (SAMPLES // MICRO)
