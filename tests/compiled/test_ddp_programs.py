"""``SinkDDPStrategy(sink_size=K, graph_mode="compile")`` on 2 gloo processes: the whole-step compiled programs, the
window's sum across the processes inside the update, against a plain PyTorch DDP loop written in the worker
(``tests/compiled/ddp_worker.py``), which runs both in the same two processes."""

from __future__ import annotations

import pytest
import torch

from lightning_sink.compiled import ProgramSettings, RankSum, StepPrograms, build_step_programs
from lightning_sink.loss_scale import DynamicLossScale
from tests.compiled.models import OPTIMIZERS, Classifier, make_batches
from tests.distributed import run_launched

COMPILED = "programs are compiled whole"


def launch(tmp_path, scenario: str, timeout: int = 300) -> dict:
    run_launched("tests.compiled.ddp_worker", tmp_path, scenario, timeout=timeout)
    return torch.load(tmp_path / f"{scenario}.pt", weights_only=False)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def assert_compiled(said: list[str]) -> None:
    """The fit reported its programs compiled, with the window's all-reduce, and fell back to nothing."""
    reports = [line for line in said if COMPILED in line]
    assert len(reports) == 1 and "summed across 2 processes by one all-reduce" in reports[0], said
    assert not [line for line in said if "no whole-step programs" in line], said


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_overflow_on_one_rank_skips_the_window_on_both(tmp_path):
    fit = launch(tmp_path, "overflow")
    assert_compiled(fit["said"])
    rank0, rank1 = fit["ranks"]
    assert torch.equal(rank0, rank1)
    assert [scaler.tolist() for scaler in fit["scalers"]] == [[2.0**9, 1.0]] * 2  # scale halved, one skip, each rank
    assert fit["reference"]["skipped"] == 1 and fit["global_step"] == 12  # (skipped windows count, as in Lightning)
    assert relative_error(rank0, fit["reference"]["params"]) <= 1e-5


@pytest.mark.slow
def test_several_micro_batches_per_call_match_one_call_per_micro_batch(tmp_path):
    """``SinkDDPStrategy(graph_mode="compile", micro_steps_per_call=8, device_data_budget=...)``: the same parameters,
    bit for bit, on both ranks, as one compiled call per micro-batch; the fit says it runs 8 micro-steps per call."""
    result = launch(tmp_path, "several_per_call", timeout=900)  # four builds, one of 8 micro-steps per call
    one, several = result["one_per_call"], result["eight_per_call"]
    for fit in (one, several):
        assert_compiled(fit["said"])
        assert fit["global_step"] == 12
        assert torch.equal(fit["ranks"][0], fit["ranks"][1])
    assert [line for line in several["said"] if "8 micro-steps per call (one loop over its windows)" in line], several[
        "said"
    ]
    assert torch.equal(several["ranks"][0], one["ranks"][0])
    assert torch.equal(several["scale"], one["scale"])


@pytest.mark.slow
def test_a_step_scheduler_inside_calls_of_several_matches_one_call_per_micro_batch(tmp_path):
    """OneCycleLR stepped per update inside calls of 8 micro-batches (four windows, four all-reduces) under
    ``SinkDDPStrategy``: the same parameters, bit for bit, on both ranks, and the same final learning rate and beta1,
    as one compiled call per micro-batch."""
    result = launch(tmp_path, "scheduled_per_call", timeout=900)
    one, several = result["one_per_call"], result["eight_per_call"]
    for fit in (one, several):
        assert_compiled(fit["said"])
        assert fit["global_step"] == 24  # 4 sinks of 12 micro-batches, windows of 2
        assert torch.equal(fit["ranks"][0], fit["ranks"][1])
    assert [line for line in several["said"] if "8 micro-steps per call (one loop over its windows)" in line], several[
        "said"
    ]
    assert not [line for line in several["said"] if "one micro-batch per call instead" in line], several["said"]
    assert several["global_step"] == one["global_step"]
    assert torch.equal(several["ranks"][0], one["ranks"][0])
    assert (several["lr"], several["betas"]) == (one["lr"], one["betas"])


@pytest.mark.slow
def test_the_default_call_length_under_ddp_matches_one_call_per_micro_batch(tmp_path):
    """``SinkDDPStrategy(graph_mode="compile")`` with nothing else set: each process stages the training set and
    gathers its own share's batches, the build chooses several micro-steps per call (a whole staged sink of 12, and
    calls of 8) with the window's all-reduce inside the loop, and trains, with OneCycleLR inside the calls, the same
    parameters, bit for bit, on both ranks, as one call per micro-batch, staged or read by the loader path (an
    overflow on one rank inside such a call: ``test_an_overflow_on_one_rank_skips_the_window_on_both``)."""
    result = launch(tmp_path, "default_per_call", timeout=900)
    one, loader, default = result["one_per_call"], result["loader_path"], result["default"]
    for fit in (one, loader, default):
        assert_compiled(fit["said"])
        assert fit["global_step"] == 18
        assert torch.equal(fit["ranks"][0], fit["ranks"][1])
    built = [line for line in default["said"] if "8 micro-steps per call" in line]
    assert len(built) == 1 and "12 per call for a whole staged sink" in built[0], default["said"]
    assert "gathered on the device from the training set staged there" in built[0]
    assert [line for line in loader["said"] if "batches read by the loader path" in line], loader["said"]
    assert torch.equal(default["ranks"][0], one["ranks"][0])
    assert torch.equal(default["ranks"][0], loader["ranks"][0])  # staging changes nothing of what is trained
    assert (default["lr"], default["betas"]) == (one["lr"], one["betas"])


@pytest.mark.slow
def test_a_loop_that_builds_on_one_process_only_runs_one_micro_step_per_call_everywhere(tmp_path):
    """The loop over windows fails to build on rank 1 only (its build is refused there): no process waits for
    another, both run one micro-step per call (the line says why), bit for bit as with ``micro_steps_per_call=1``."""
    result = launch(tmp_path, "fail_loop_on_rank_1", timeout=900)
    one, default = result["one_per_call"], result["default"]
    assert_compiled(default["said"])
    assert [line for line in default["said"] if "did not build on every process" in line], default["said"]
    assert not [line for line in default["said"] if "8 micro-steps per call" in line], default["said"]
    assert torch.equal(default["ranks"][0], default["ranks"][1])
    assert torch.equal(default["ranks"][0], one["ranks"][0])


@pytest.mark.slow
def test_the_one_micro_step_programs_are_built_under_ddp_when_a_sink_first_needs_them(tmp_path):
    """``max_steps=17`` with sinks of 12 and windows of 2: the third sink ends with two micro-batches one per call,
    whose programs the build left out; they are built there, on both processes, and the fit trains bit for bit what
    one call per micro-batch trains. Refused on rank 1 only, both processes run the eager step from there (one
    warning, no process left waiting) and train the same within rounding."""
    result = launch(tmp_path, "pair_when_needed", timeout=900)
    one, default, refused = result["one_per_call"], result["default"], result["refused"]
    for fit in (one, default, refused):
        assert fit["global_step"] == 17
        assert torch.equal(fit["ranks"][0], fit["ranks"][1])
    built = [line for line in default["said"] if "programs of one micro-step compiled in" in line]
    assert len(built) == 1, default["said"]
    assert torch.equal(default["ranks"][0], one["ranks"][0])
    assert (default["lr"], default["betas"]) == (one["lr"], one["betas"])
    fell_back = [line for line in refused["said"] if "no whole-step programs" in line]
    assert len(fell_back) == 1 and "another process could not build them" in fell_back[0], refused["said"]
    assert relative_error(refused["ranks"][0], one["ranks"][0]) < 1e-6


def assert_trains_as_stock(stock: dict, sink: dict) -> None:
    """The same updates, learning rate, logged loss and parameters (within the compiled programs' rounding), the
    processes' parameters equal in each fit."""
    assert sink["global_step"] == stock["global_step"] == 18
    assert sink["lr"] == pytest.approx(stock["lr"], rel=1e-12)
    assert sink["train_loss"] == pytest.approx(stock["train_loss"], rel=1e-5)
    for fit in (stock, sink):
        assert torch.equal(fit["ranks"][0], fit["ranks"][1])
    assert relative_error(sink["ranks"][0], stock["ranks"][0]) <= 1e-5


@pytest.mark.slow
def test_the_default_compiled_sink_under_ddp_trains_as_stock_lightning_without_sinking(tmp_path):
    """Stock Lightning's ``DDPStrategy`` with ``accumulate_grad_batches=2`` and ``SinkDDPStrategy(sink_size=12,
    graph_mode="compile")`` with its defaults (staged data, several micro-steps per call), a shuffled loader,
    OneCycleLR per update: the same updates, learning rate, logged loss and parameters (within the compiled
    programs' rounding)."""
    result = launch(tmp_path, "against_stock", timeout=900)
    stock, sink = result["stock"], result["sink"]
    assert_compiled(sink["said"])
    assert [line for line in sink["said"] if "per call for a whole staged sink" in line], sink["said"]
    assert_trains_as_stock(stock, sink)


@pytest.mark.slow
def test_partial_batches_in_a_compiled_sink_under_ddp_train_as_stock_lightning_without_sinking(tmp_path):
    """As above, with windows of one, over data passes that end with a partial batch on each process: the eager
    pair trains those (the same collectives on both processes), and nothing is compiled for their shape."""
    result = launch(tmp_path, "partial_against_stock", timeout=900)
    stock, sink = result["stock"], result["sink"]
    assert_compiled(sink["said"])
    assert not [line for line in sink["said"] if "programs of one micro-step compiled in" in line], sink["said"]
    assert_trains_as_stock(stock, sink)


def test_rank_sum_takes_one_route_and_several_ranks():
    with pytest.raises(ValueError, match="exactly one of group"):
        RankSum(2)
    with pytest.raises(ValueError, match="ranks=1"):
        RankSum(1, all_reduce=lambda flat: None)


def test_the_two_part_update_sums_what_the_all_reduce_returns(monkeypatch):
    """One process standing in for two ranks with the same data: an all-reduce that doubles the flat bucket. The
    update divides by the ranks too, so the parameters are those of the one-process programs; an overflow put in the
    bucket by the "other rank" skips the update and halves the scale."""
    batches = make_batches(8)
    plain, doubled = Classifier(), Classifier()
    built = {}
    poisoned = {"window": -1}
    calls = []

    def all_reduce(flat: torch.Tensor) -> None:
        calls.append(flat.numel())
        flat.mul_(2)
        if len(calls) - 1 == poisoned["window"]:
            flat[0] = float("inf")

    for name, module, rank_sum in (("plain", plain, None), ("doubled", doubled, RankSum(2, all_reduce=all_reduce))):
        optimizer = OPTIMIZERS["adamw"](module.parameters())
        built[name] = build_step_programs(
            module,
            optimizer,
            batches[0],
            ProgramSettings(loss_scale=DynamicLossScale(init_scale=2.0**4), backend="aot_eager", rank_sum=rank_sum),
        )
        assert isinstance(built[name], StepPrograms)
    for i, batch in enumerate(batches[:4]):  # windows of 2
        for programs in built.values():
            programs.accumulate(batch) if i % 2 == 0 else programs.update(batch)
    assert calls == [sum(p.numel() for p in doubled.parameters())] * 2  # one flat bucket per update
    for mine, reference in zip(doubled.parameters(), plain.parameters()):
        assert torch.allclose(mine, reference, rtol=1e-6, atol=1e-7)
    poisoned["window"] = 2
    before = [p.detach().clone() for p in doubled.parameters()]
    out = built["doubled"].update(batches[4])
    assert bool(out.found_inf) and built["doubled"].scaler.scale.item() == 2.0**3
    assert all(torch.equal(p, q) for p, q in zip(doubled.parameters(), before))
