"""With calls of several micro-steps (the default's loop over windows), the fit's build compiles the loop alone: the
accumulate and update programs of one micro-step are built at the start of the first segment that trains a
micro-batch one per call (a segment's rest of one window, at a sink's end, ``max_steps`` or a schedule point; a
window left open across sinks), never inside a call, and never in a fit whose micro-batches all run in calls of
several (a rest of two windows or more is a call of its own length). Each
fit against the same fit with one call per micro-batch, bit for bit, and where the build of the pair fails, the
eager step from there, against a plain PyTorch loop.

The programs are built with the ``aot_eager`` backend, as in ``test_call_length.py``."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from lightning_sink.compiled import StepPrograms
from tests.compiled.test_lightning_fit import (
    Net,
    RecordingLogger,
    dataset,
    fit,
    flat,
    loader,
    plain_loop,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
)
from tests.helpers import quiet_trainer

# (accumulation steps, sink size, the trainer's limits, whether some micro-batch trains one per call); a data pass
# is 10 micro-batches, staged on the device, and the default's calls are 8 micro-steps and a whole sink
CASES = {
    "every sink one call": (2, 10, {"max_epochs": 3}, False),
    "max_steps inside the last sink": (2, 10, {"max_steps": 11}, True),
    "max_steps leaving two windows of the last sink": (2, 10, {"max_steps": 12}, False),
    "a window open across sinks": (3, 10, {"max_epochs": 3}, True),
    "checkpoints every 9 updates": (1, 10, {"max_epochs": 2, "every_n_train_steps": 9}, True),
}


@pytest.fixture
def pair_calls(monkeypatch) -> list[bool]:
    """For each one-micro-step call of the fit, whether its programs were built before it (by the sink loop, at its
    segment's start) rather than inside the call."""
    built_before: list[bool] = []
    accumulate, update = StepPrograms.accumulate, StepPrograms.update

    def accumulate_seen(self: StepPrograms, batch: Any = None) -> Any:
        built_before.append(self.pair_built)
        return accumulate(self, batch)

    def update_seen(self: StepPrograms, batch: Any = None) -> Any:
        built_before.append(self.pair_built)
        return update(self, batch)

    monkeypatch.setattr(StepPrograms, "accumulate", accumulate_seen)
    monkeypatch.setattr(StepPrograms, "update", update_seen)
    return built_before


def run(case: str, calls: int | None, caplog: Any, folder: Path) -> dict[str, Any]:
    steps, sink_size, limits, _ = CASES[case]
    limits = dict(limits)
    if "every_n_train_steps" in limits:  # (a schedule point: segments of 9 and 1, then 8 and 2)
        every = limits.pop("every_n_train_steps")
        limits.update(callbacks=[ModelCheckpoint(dirpath=folder, every_n_train_steps=every)], enable_checkpointing=True)
    strategy = SinkStrategy(
        accumulation_steps=steps, sink_size=sink_size, graph_mode="compile", micro_steps_per_call=calls
    )
    logger = RecordingLogger()
    trainer = quiet_trainer(strategy=strategy, logger=logger, log_every_n_steps=1, **limits)
    model = Net("adamw")
    reference = copy.deepcopy(model.net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(trainer, model, dataset(), caplog)
    said = [record.getMessage() for record in caplog.records] + [str(warning.message) for warning in caught]
    return {
        "model": model,
        "trainer": trainer,
        "points": logger.points,
        "reference": reference,
        "build": [line for line in said if "programs are compiled whole" in line],
        "pair_built": [line for line in said if "programs of one micro-step compiled in" in line],
        "fell_back": [line for line in said if "no whole-step programs" in line],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_pair_is_built_at_the_first_segment_that_needs_it(case, caplog, several_calls, pair_calls, tmp_path):
    one = run(case, 1, caplog, tmp_path / "one")
    assert several_calls == [] and one["pair_built"] == []  # (one per call: the fit's build made the pair)
    assert all(pair_calls), "a one-micro-step call ran before its programs were built"
    pair_calls.clear()
    default = run(case, None, caplog, tmp_path / "default")
    needs_pair = CASES[case][3]
    assert several_calls, "the default ran no call of several"
    assert "the accumulate and update programs of one micro-step compile when first needed" in default["build"][0]
    assert len(default["pair_built"]) == int(needs_pair), default["pair_built"]
    assert bool(pair_calls) == needs_pair and all(pair_calls), pair_calls
    assert default["fell_back"] == []
    assert default["trainer"].global_step == one["trainer"].global_step
    assert torch.equal(flat(default["model"].net), flat(one["model"].net))
    assert default["points"] == one["points"]


def test_a_pair_that_does_not_build_leaves_the_eager_step_from_there(caplog, several_calls, monkeypatch, tmp_path):
    """The pair's build fails at the last sink (``max_steps`` inside it): the fit trains on with the eager step,
    says so in one warning naming the error, and ends where a plain loop ends."""

    def refused(self: StepPrograms) -> float:
        raise RuntimeError("no pair here")

    monkeypatch.setattr(StepPrograms, "build_pair", refused)
    result = run("max_steps inside the last sink", None, caplog, tmp_path)
    assert several_calls == [10, 10]  # (then one window, by the pair: its build fails)
    assert len(result["fell_back"]) == 1, result["fell_back"]
    assert (
        "the accumulate and update programs of one micro-step did not build (RuntimeError: no pair here)"
        in (result["fell_back"][0])
    )
    assert result["trainer"].global_step == 11
    reference = result["reference"]
    expected = plain_loop(reference, "adamw", 22, 2, dataset())
    assert expected["updates"] == 11
    assert relative_error(flat(result["model"].net), flat(reference)) <= 1e-5


@pytest.mark.parametrize("case", ["max_steps inside the last sink", "checkpoints every 9 updates"])
def test_a_fit_that_builds_the_pair_midway_trains_as_stock_lightning_without_sinking(case, caplog, tmp_path):
    """The same run without sinking: stock Lightning with ``accumulate_grad_batches``, the same limits and
    checkpoint callback: the same updates, the same steps logged, parameters within the compiled programs'
    rounding."""
    steps, _, limits, _ = CASES[case]
    limits = dict(limits)
    if "every_n_train_steps" in limits:
        every = limits.pop("every_n_train_steps")
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "stock", every_n_train_steps=every)
        limits.update(callbacks=[checkpoint], enable_checkpointing=True)
    logger = RecordingLogger()
    stock = Net("adamw")
    trainer = quiet_trainer(accumulate_grad_batches=steps, logger=logger, log_every_n_steps=1, **limits)
    trainer.fit(stock, loader(dataset()))
    sink = run(case, None, caplog, tmp_path / "sink")
    assert len(sink["pair_built"]) == 1 and sink["points"]
    assert sink["trainer"].global_step == trainer.global_step
    assert [(step, sorted(values)) for step, values in sink["points"]] == [
        (step, sorted(values)) for step, values in logger.points
    ]
    assert relative_error(flat(sink["model"].net), flat(stock.net)) <= 1e-5


def test_segments_cut_by_checkpoints_run_as_calls_of_the_loop_and_train_as_stock_lightning(
    caplog, several_calls, pair_calls, tmp_path
):
    """A shuffled loader (passes of 30 micro-batches), a step LR scheduler, windows of 2, sinks of 12 and a
    checkpoint every 4 updates: the sinks' segments of 8 and 4 micro-batches each run as one call of the loop, no
    one-micro-step program is built or run, and the fit is stock Lightning's without sinking (``accumulate_grad_batches``,
    the same callback and limit): the same updates, checkpoints, losses logged at each step and parameters."""
    x, y = dataset().tensors
    data = TensorDataset(x.repeat(3, 1), y.repeat(3))

    def shuffled() -> DataLoader:
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    def fit_with(strategy: Any, folder: Path, **options: Any) -> dict[str, Any]:
        logger, model = RecordingLogger(), Net("adamw", step_lr=0.97)
        checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=4, save_top_k=-1)
        trainer = quiet_trainer(
            strategy=strategy,
            logger=logger,
            log_every_n_steps=1,
            max_steps=12,
            callbacks=[checkpoint],
            enable_checkpointing=True,
            **options,
        )
        with caplog.at_level("INFO"):
            trainer.fit(model, shuffled())
        return {
            "model": model,
            "trainer": trainer,
            "points": logger.points,
            "saved": sorted(p.name for p in folder.iterdir()),
        }

    stock = fit_with("auto", tmp_path / "stock", accumulate_grad_batches=2)
    caplog.clear()
    sink = fit_with(SinkStrategy(accumulation_steps=2, sink_size=12, graph_mode="compile"), tmp_path / "sink")
    assert several_calls == [8, 4, 4, 8] and pair_calls == []
    assert not [r for r in caplog.records if "programs of one micro-step compiled in" in r.getMessage()]
    assert sink["trainer"].global_step == stock["trainer"].global_step == 12
    # each update's logged step values (the epoch's come at a sink's end in sink mode: an epoch is a sink)
    steps = [
        [(step, values["train_loss"]) for step, values in run["points"] if "train_loss" in values]
        for run in (sink, stock)
    ]
    assert [step for step, _ in steps[0]] == [step for step, _ in steps[1]] == list(range(12))
    assert all(abs(a - b) <= 1e-5 for (_, a), (_, b) in zip(*steps))
    assert len(sink["saved"]) == len(stock["saved"]) == 3
    assert relative_error(flat(sink["model"].net), flat(stock["model"].net)) <= 1e-5
