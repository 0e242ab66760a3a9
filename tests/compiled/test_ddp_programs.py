"""``SinkDDPStrategy(sink_size=K, graph_mode="compile")`` on 2 gloo processes: the whole-step compiled programs, the
window's sum across the processes inside the update, against a plain PyTorch DDP loop written in the worker
(``tests/compiled/ddp_worker.py``), which runs both in the same two processes."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_launched

COMPILED = "the accumulate and update programs are compiled whole"


def launch(tmp_path, scenario: str) -> dict:
    run_launched("tests.compiled.ddp_worker", tmp_path, scenario, timeout=300)
    return torch.load(tmp_path / f"{scenario}.pt", weights_only=False)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def assert_compiled(said: list[str]) -> None:
    """The fit reported its programs compiled, with the window's all-reduce, and fell back to nothing."""
    reports = [line for line in said if COMPILED in line]
    assert len(reports) == 1 and "summed across 2 processes by one all-reduce" in reports[0], said
    assert not [line for line in said if "no whole-step programs" in line], said


def test_compiled_ddp_fits_match_the_plain_ddp_loop(tmp_path):
    """12 updates each: SGD with momentum in windows of 1 with norm clipping of the averaged gradient; AdamW in
    windows of 4 (sinks of 12 micro-batches)."""
    result = launch(tmp_path, "exactness")
    for name, fit in result.items():
        assert_compiled(fit["said"])
        rank0, rank1 = fit["ranks"]
        assert torch.equal(rank0, rank1), name
        assert fit["global_step"] == 12, name
        assert relative_error(rank0, fit["reference"]["params"]) <= 1e-5, name
    assert result["sgd_1"]["reference"]["clipped"] > 0  # the clipping changed some updates


def test_an_overflow_on_one_rank_skips_the_window_on_both(tmp_path):
    fit = launch(tmp_path, "overflow")
    assert_compiled(fit["said"])
    rank0, rank1 = fit["ranks"]
    assert torch.equal(rank0, rank1)
    assert [scaler.tolist() for scaler in fit["scalers"]] == [[2.0**9, 1.0]] * 2  # scale halved, one skip, each rank
    assert fit["reference"]["skipped"] == 1 and fit["global_step"] == 12  # (skipped windows count, as in Lightning)
    assert relative_error(rank0, fit["reference"]["params"]) <= 1e-5
