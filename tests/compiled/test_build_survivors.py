"""After the compiled build, the objects it left are kept out of Python's full collections for the fit
(``gc.freeze``) and given back at its end, also when the fit raises; a process that froze objects itself keeps
its own choice."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_sink import SinkStrategy
from lightning_sink.sink.programs.build_survivors import BuildSurvivors
from tests.compiled.test_lightning_fit import MICRO, Net, dataset, quick_backend  # noqa: F401  (the fixture)
from tests.helpers import quiet_trainer


@pytest.fixture(autouse=True)
def nothing_frozen():
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()  # (whatever a failed test left)


class FrozenAtSinkEnds(pl.Callback):
    """The collector's frozen count at each sink's end; raises at sink ``fail_at`` where given."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.counts: list[int] = []
        self.fail_at = fail_at

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.counts.append(gc.get_freeze_count())
        if trainer.current_epoch == self.fail_at:
            raise RuntimeError("stopped by the test")


def fit(graph_mode: str, callback: FrozenAtSinkEnds) -> None:
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=5, graph_mode=graph_mode), max_epochs=3, callbacks=[callback]
    )
    trainer.fit(Net(), DataLoader(dataset(), batch_size=MICRO))


def test_the_builds_objects_are_frozen_for_the_fit_and_given_back_at_its_end():
    sinks = FrozenAtSinkEnds()
    fit("compile", sinks)
    assert len(sinks.counts) == 3 and all(count > 1000 for count in sinks.counts), sinks.counts
    assert gc.get_freeze_count() == 0


def test_they_are_given_back_when_the_fit_raises():
    sinks = FrozenAtSinkEnds(fail_at=1)
    with pytest.raises(RuntimeError, match="stopped by the test"):
        fit("compile", sinks)
    assert sinks.counts[0] > 1000
    assert gc.get_freeze_count() == 0


def test_eager_sinks_freeze_nothing():
    sinks = FrozenAtSinkEnds()
    fit("eager", sinks)
    assert sinks.counts == [0, 0, 0]


def test_a_process_that_froze_objects_itself_keeps_its_own_choice():
    gc.freeze()
    frozen = gc.get_freeze_count()
    sinks = FrozenAtSinkEnds()
    fit("compile", sinks)
    # neither more frozen nor given back (some of the frozen objects are freed by their reference counts)
    assert frozen * 0.9 <= gc.get_freeze_count() <= frozen
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_collection_after_a_build_traverses_the_builds_own_objects_only():
    """What existed before the build is frozen first: in the build the collector tracks only what the build made
    (the process tracks hundreds of thousands of torch's and Lightning's objects), the build's garbage cycles are
    collected after it and its survivors frozen with the rest until ``release``."""
    survivors = BuildSurvivors()
    tracked_before = len(gc.get_objects())
    with survivors.around_build():
        made = [[index] for index in range(1000)]
        garbage = Cycle()
        gone = weakref.ref(garbage)
        del garbage
        tracked_in_build = len(gc.get_objects())
    assert tracked_before > 50_000 and 1000 <= tracked_in_build < 1000 + 5000, (tracked_before, tracked_in_build)
    assert gone() is None  # collected after the build
    assert gc.get_freeze_count() >= tracked_before + len(made)
    survivors.release()
    assert gc.get_freeze_count() == 0
