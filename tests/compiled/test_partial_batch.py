"""A data pass that ends with a partial batch (a loader's default ``drop_last=False``) under
``graph_mode="compile"``: the partial batch, of a shape the programs were not built for, is trained by the eager
pair, so no program is built or compiled again for it; the compiled programs take over at the next micro-batch.
Each fit against the same fit with ``graph_mode="eager"`` (parameters, steps, every logged point), with a step LR
scheduler, BatchNorm, and windows that run on across the partial batch.

The programs are built with the ``aot_eager`` backend, as in ``test_call_length.py``."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_sink import SinkStrategy
from lightning_sink.compiled import StepPrograms
from tests.compiled.test_lightning_fit import (
    Net,
    fit,
    flat,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
)
from tests.helpers import RecordingLogger, quiet_trainer

SAMPLES = 42  # with micro-batches of 4: 10 whole batches and a partial one of 2 in each data pass

# (accumulation steps, sink size, max_epochs, whether some whole micro-batch trains one per call)
CASES = {
    "windows of one, a sink of one pass": (1, -1, 3, False),
    "windows of one, sinks of one pass's length": (1, 11, 3, False),
    # (whole batches left at a pass's end: each run of two or more is one call of its own length)
    "windows of one, sinks of 7 (whole batches left at a pass's end)": (1, 7, 5, False),
    "windows of one, sinks of 9 (one whole batch left one per call at a pass's end)": (1, 9, 4, True),
    "windows of three across the partial batch": (3, -1, 3, True),
}


def partial_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    )


@pytest.fixture
def compiled_batch_rows(monkeypatch) -> list[int]:
    """The rows of every batch a one-micro-step program was given (staged micro-batches, which the programs gather
    themselves, are whole: ``-1``)."""
    rows: list[int] = []
    accumulate, update = StepPrograms.accumulate, StepPrograms.update

    def seen(batch: Any) -> None:
        rows.append(-1 if batch is None else len(batch[0]))

    def accumulate_seen(self: StepPrograms, batch: Any = None) -> Any:
        seen(batch)
        return accumulate(self, batch)

    def update_seen(self: StepPrograms, batch: Any = None) -> Any:
        seen(batch)
        return update(self, batch)

    monkeypatch.setattr(StepPrograms, "accumulate", accumulate_seen)
    monkeypatch.setattr(StepPrograms, "update", update_seen)
    return rows


def run(graph_mode: str, case: str, caplog: Any) -> dict[str, Any]:
    steps, sink_size, epochs, _ = CASES[case]
    strategy = SinkStrategy(accumulation_steps=steps, sink_size=sink_size, graph_mode=graph_mode)
    logger = RecordingLogger()
    trainer = quiet_trainer(strategy=strategy, logger=logger, log_every_n_steps=1, max_epochs=epochs)
    model = Net("adamw", batch_norm=True, step_lr=0.97)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(trainer, model, partial_dataset(), caplog)
    said = [record.getMessage() for record in caplog.records] + [str(warning.message) for warning in caught]
    return {
        "model": model,
        "trainer": trainer,
        "points": logger.points,
        "pair_built": [line for line in said if "programs of one micro-step compiled in" in line],
        "fell_back": [line for line in said if "no whole-step programs" in line],
        "recompiled": [line for line in said if "recompiled" in line],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_a_partial_last_batch_is_trained_by_the_eager_pair_and_nothing_is_compiled_for_it(
    case, caplog, several_calls, compiled_batch_rows
):
    eager = run("eager", case, caplog)
    compiled = run("compile", case, caplog)
    assert several_calls, "no call of several ran"
    assert 2 not in compiled_batch_rows, compiled_batch_rows  # the partial batch never reached a program
    needs_pair = CASES[case][3]
    assert len(compiled["pair_built"]) == int(needs_pair), compiled["pair_built"]
    assert bool(compiled_batch_rows) == needs_pair
    assert compiled["fell_back"] == [] and compiled["recompiled"] == []
    assert compiled["trainer"].global_step == eager["trainer"].global_step > 0
    assert relative_error(flat(compiled["model"].net), flat(eager["model"].net)) <= 1e-5
    for name in ("running_mean", "running_var"):  # (BatchNorm's statistics moved by every micro-batch)
        got, expected = (dict(run["model"].net.named_buffers()) for run in (compiled, eager))
        assert all(torch.allclose(got[key], expected[key], atol=1e-6) for key in got if key.endswith(name))
    assert [step for step, _ in compiled["points"]] == [step for step, _ in eager["points"]]
    for (_, got_values), (_, expected_values) in zip(compiled["points"], eager["points"]):
        assert got_values.keys() == expected_values.keys()
        assert all(
            abs(got_values[k] - expected_values[k]) <= 1e-5 * max(1.0, abs(expected_values[k])) for k in got_values
        )
