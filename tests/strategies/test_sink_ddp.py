"""SinkDDPStrategy on 2 gloo processes against a single-process reference over the global batch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_launched
from tests.helpers import (
    TinyClassifier,
    ddp_reference_windows,
    flat_params,
    make_dataset,
    reference_train,
    relative_error,
)

MICRO_BATCH, WORLD = 4, 2


def launch(
    out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int, scenario: str, torchrun: bool = False
) -> None:
    """Lightning's own launcher re-runs the command for rank 1; with ``torchrun`` both ranks come from torchrun."""
    run_launched(
        "tests.strategies.ddp_worker",
        out_dir,
        steps,
        partial_window,
        num_samples,
        epochs,
        scenario,
        torchrun=WORLD if torchrun else None,
        timeout=180,
    )


def run_workers(
    out_dir: Path, steps: int, partial_window: str, num_samples: int, epochs: int, torchrun: bool = False
) -> dict:
    launch(out_dir, steps, partial_window, num_samples, epochs, "exactness", torchrun)
    summary = json.loads((out_dir / "summary.json").read_text())
    summary.update(torch.load(out_dir / "result.pt"))
    return summary


@pytest.mark.slow
@pytest.mark.parametrize(
    "partial_window, num_samples, torchrun", [("scale", 96, False), ("carry", 80, False), ("drop", 88, True)]
)
def test_ddp_equals_global_batch_and_reduces_once_per_window(tmp_path, partial_window, num_samples, torchrun):
    steps, epochs = 4, 2
    result = run_workers(tmp_path, steps, partial_window, num_samples, epochs, torchrun)

    # Reference: one process, batch = micro-batch x steps x ranks, in the order torch's DistributedSampler
    # (which Lightning puts on the training loader) gives each rank.
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    reference = copy.deepcopy(model)
    windows = ddp_reference_windows(num_samples, MICRO_BATCH, steps, epochs, partial_window, WORLD)
    expected_lrs = reference_train(reference, make_dataset(num_samples=num_samples), windows)

    assert result["global_step"] == len(windows)
    assert result["lrs"] == pytest.approx(expected_lrs, rel=1e-12)
    assert torch.equal(result["params"], result["other_rank_params"])
    assert relative_error(result["params"].double(), flat_params(reference)) <= 1e-6
    # Communication: DDP's reducer never fires; exactly one all_reduce (the flat fp32 window buffer) in each
    # batch that updates, none in accumulate batches.
    per_batch = result["per_batch"]
    assert all(batch["ddp_hook"] == 0 for batch in per_batch)
    assert [batch["all_reduce"] for batch in per_batch] == [batch["updates"] for batch in per_batch]
    assert sum(batch["updates"] for batch in per_batch) == len(windows)


@pytest.mark.slow
def test_ddp_resume_mid_window_is_bit_identical(tmp_path):
    launch(tmp_path, 4, "scale", 80, 2, "resume")
    result = torch.load(tmp_path / "resume.pt")
    assert result["window_position"] == 2
    assert torch.equal(result["resumed"], result["uninterrupted"])


@pytest.mark.slow
def test_ddp_resume_with_dropout_restores_each_ranks_own_generator(tmp_path):
    """Each rank draws other dropout masks; the checkpoint holds every rank's generator and each rank gets its own
    back, so the resumed run reaches the uninterrupted run's parameters bit for bit."""
    launch(tmp_path, 2, "scale", 80, 2, "random_resume")
    result = torch.load(tmp_path / "random_resume.pt")
    rank0, rank1 = result["saved_torch_states"]
    assert not torch.equal(rank0, rank1)
    assert torch.equal(result["resumed"], result["uninterrupted"])


@pytest.mark.slow
def test_overflow_on_one_rank_skips_the_window_on_both(tmp_path):
    steps, num_samples, epochs = 4, 96, 2
    launch(tmp_path, steps, "scale", num_samples, epochs, "overflow")
    result = torch.load(tmp_path / "overflow.pt")
    rank0, rank1 = result["rank0"], result["rank1"]
    assert torch.equal(rank0, rank1)  # same parameters, scale and skipped count on both ranks
    params, scale, skipped = rank0[:-2], rank0[-2].item(), rank0[-1].item()
    assert (scale, skipped) == (2.0**9, 1.0)

    model = TinyClassifier(optimizer="adamw_fused", lr=0.01)
    windows = ddp_reference_windows(num_samples, MICRO_BATCH, steps, epochs, "scale", WORLD)
    reference_train(model, make_dataset(num_samples=num_samples), windows, skip={1})
    assert result["global_step"] == len(windows)
    assert relative_error(params.double(), flat_params(model)) <= 1e-6


@pytest.mark.slow
def test_ddp_sinks_equal_the_continuous_global_batch_reference(tmp_path):
    from torch.utils.data import DistributedSampler

    steps, num_samples, epochs, sink = 3, 96, 4, 5
    launch(tmp_path, steps, "scale", num_samples, epochs, "sink")
    result = torch.load(tmp_path / "sink.pt")
    assert torch.equal(result["rank0"], result["rank1"])

    # Each rank traverses its DistributedSampler continuously, the sampler epoch advancing per data pass.
    streams = []
    for rank in range(WORLD):
        micro, data_pass = [], 0
        while len(micro) < sink * epochs:
            sampler = DistributedSampler(range(num_samples), WORLD, rank, shuffle=True, seed=0)
            sampler.set_epoch(data_pass)
            order = list(sampler)
            micro += [order[i : i + MICRO_BATCH] for i in range(0, len(order), MICRO_BATCH)]
            data_pass += 1
        streams.append(micro[: sink * epochs])
    global_micro = [sum(parts, []) for parts in zip(*streams)]
    windows = [sum(global_micro[i : i + steps], []) for i in range(0, len(global_micro) - steps + 1, steps)]
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.95)
    lrs = reference_train(model, make_dataset(num_samples=num_samples), windows)
    assert result["global_step"] == len(windows) == 6
    assert result["lrs"] == pytest.approx(lrs, rel=1e-12)
    assert relative_error(result["rank0"].double(), flat_params(model)) <= 1e-6


@pytest.mark.slow
def test_ddp_sinks_write_every_updates_values_synced_as_lightning_syncs_them(tmp_path):
    """Each update u's last micro-step logs rank + 10 (u - 1) on each rank; sync_dist reduces them across ranks (mean
    0.5 + 10 (u - 1), max 1 + 10 (u - 1)), as Lightning does for a step value; the rest is rank 0's own value."""
    import csv

    launch(tmp_path, 2, "scale", 64, 3, "logging")  # 3 sinks of 4 micro-batches, 2 updates each
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("local")]
    assert [int(row["step"]) for row in rows] == list(range(6))
    assert [float(row["synced_mean"]) for row in rows] == [0.5 + 10 * u for u in range(6)]
    assert [float(row["synced_max"]) for row in rows] == [1.0 + 10 * u for u in range(6)]
    assert [float(row["local"]) for row in rows] == [10.0 * u for u in range(6)]


@pytest.mark.slow
def test_ddp_max_time_inside_a_sink_stops_every_rank_after_the_same_micro_batch(tmp_path):
    """Rank 0's clock decides (its micro-batches are the slow ones): both ranks end the sink at the same
    micro-batch, soon after the limit, instead of at the end of a 400-micro-batch sink."""
    launch(tmp_path, 2, "scale", 64, 1, "max_time")
    result = torch.load(tmp_path / "max_time.pt")
    rank0, rank1 = result["micro_batches"]
    assert rank0 == rank1
    assert 0 < rank0 < 400
