"""The compiled accumulate/update programs against the plain PyTorch loop written in ``models.py``: parameters
within 1e-5 relative after 100 updates (fp32, CPU), logged values, the optimizer's own state, schedulers without
recompiles, BatchNorm, clipping, dynamic loss scaling with injected overflows, and resume from a checkpoint.

Most tests compile with the ``aot_eager`` backend: the same TorchDynamo graph capture and AOTAutograd
functionalization as the default ``inductor``, without its code generation (minutes on a small CPU); one slow test
runs ``inductor`` itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from lightning_sink.compiled import ProgramSettings, StepPrograms, build_step_programs
from lightning_sink.loss_scale import DynamicLossScale
from tests.compiled.models import (
    OPTIMIZERS,
    Classifier,
    ConvClassifier,
    eager_loop,
    make_batches,
    make_image_batches,
    max_relative_difference,
    run_programs,
    windows_of,
)

BACKEND = "aot_eager"
UPDATES = 100


def build(model, optimizer, example, **kwargs) -> StepPrograms:
    programs = build_step_programs(
        model, optimizer, example, ProgramSettings(backend=kwargs.pop("backend", BACKEND), **kwargs)
    )
    assert isinstance(programs, StepPrograms), programs
    return programs


def pair(optimizer: str, **model_kwargs):
    model, reference = Classifier(**model_kwargs), Classifier(**model_kwargs)
    return model, OPTIMIZERS[optimizer](model.parameters()), reference, OPTIMIZERS[optimizer](reference.parameters())


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_programs_match_the_plain_loop_after_100_updates(optimizer, accumulation):
    # 100 updates, the last of them a partial window of 2 micro-batches when accumulating
    count = accumulation * (UPDATES - 1) + (2 if accumulation > 1 else 1)
    windows = windows_of(make_batches(count), accumulation)
    assert len(windows) == UPDATES and (accumulation == 1 or len(windows[-1]) == 2)
    model, opt, reference, reference_opt = pair(optimizer)
    programs = build(model, opt, windows[0][0])
    logged = run_programs(programs, windows)
    expected = eager_loop(reference, reference_opt, windows)
    assert max_relative_difference(model, reference) < 1e-5
    # the optimizer's own state holds the run (what state_dict, checkpoints and schedulers see)
    state, reference_state = opt.state_dict()["state"], reference_opt.state_dict()["state"]
    assert state.keys() == reference_state.keys()
    for index in state:
        assert state[index].keys() == reference_state[index].keys()
        for name, value in state[index].items():
            torch.testing.assert_close(value, reference_state[index][name], rtol=1e-5, atol=1e-6)
    # self.log values come out of the programs, equal to the eager run's
    assert [row.keys() for row in logged] == [row.keys() for row in expected]
    for row, reference_row in zip(logged, expected):
        for name in row:
            assert row[name] == pytest.approx(reference_row[name], rel=1e-5, abs=1e-6)
    assert programs.logged.options["double_loss"] == {"prog_bar": True}
    assert programs.window.micro_steps.item() == 0  # the last update reset the window


@pytest.mark.parametrize("clip", [("norm", 0.05), ("value", 0.01)])
def test_clipping_inside_the_update_program(clip):
    windows = windows_of(make_batches(4 * 30), 4)
    model, opt, reference, reference_opt = pair("sgd")
    programs = build(model, opt, windows[0][0], gradient_clip_val=clip[1], gradient_clip_algorithm=clip[0])
    run_programs(programs, windows)
    eager_loop(reference, reference_opt, windows, clip=clip)
    assert max_relative_difference(model, reference) < 1e-5
    unclipped, unclipped_opt, _, _ = pair("sgd")
    eager_loop(unclipped, unclipped_opt, windows)
    assert max_relative_difference(model, unclipped) > 1e-3  # the bound really clipped


def test_a_step_scheduler_changes_the_learning_rate_without_recompiling():
    windows = windows_of(make_batches(2 * 41), 2)  # ... and a partial last window
    windows[-1] = windows[-1][:1]
    model, opt, reference, reference_opt = pair("adamw")
    programs = build(model, opt, windows[0][0])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_opt, step_size=3, gamma=0.7)
    counters.clear()
    run_programs(programs, windows, scheduler)
    assert counters["stats"].get("unique_graphs", 0) == 0  # built once: no recompilation over the run
    eager_loop(reference, reference_opt, windows, scheduler=reference_scheduler)
    assert opt.param_groups[0]["lr"] == reference_opt.param_groups[0]["lr"] < 1e-3
    assert max_relative_difference(model, reference) < 1e-5


def test_batch_norm_running_statistics_update():
    windows = windows_of(make_batches(3 * 20), 3)
    model, opt, reference, reference_opt = pair("sgd", batch_norm=True)
    programs = build(model, opt, windows[0][0])
    run_programs(programs, windows)
    eager_loop(reference, reference_opt, windows)
    assert model.net[1].num_batches_tracked.item() == 60
    assert max_relative_difference(model, reference) < 1e-5  # parameters and running statistics


@pytest.mark.parametrize("overflow_at", [(5,), (2, 9, 10, 11, 30)])
def test_dynamic_loss_scale_skips_overflowing_windows_by_the_scale_rule(overflow_at):
    """Overflows injected into chosen micro-steps (an inf input): the window is skipped and the scale follows the
    rule, checked against torch.amp.GradScaler (the same rule with hysteresis 1)."""
    batches = make_batches(4 * 25)
    for index in overflow_at:
        batches[index][0][0, 0] = float("inf")
    windows = windows_of(batches, 4)
    model, opt, reference, reference_opt = pair("adam")
    programs = build(model, opt, windows[0][0], loss_scale=DynamicLossScale(init_scale=2.0**10, scale_window=3))
    found = []
    for window in windows:
        for position, batch in enumerate(window):
            if position == len(window) - 1:
                found.append(programs.update(batch).found_inf.item())
            else:
                programs.accumulate(batch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    eager_loop(reference, reference_opt, windows, scaler=scaler)
    skipped_windows = sorted({index // 4 for index in overflow_at})
    assert [i for i, flag in enumerate(found) if flag] == skipped_windows
    assert programs.scaler.skipped.item() == len(skipped_windows)
    assert programs.scaler.scale.item() == scaler.get_scale()
    assert max_relative_difference(model, reference) < 1e-5
    steps = {state["step"].item() for state in opt.state.values()}
    assert steps == {25.0 - len(skipped_windows)}  # a skipped window is no optimizer step


def test_resuming_from_a_checkpoint_reaches_the_uninterrupted_run_bit_for_bit():
    windows = windows_of(make_batches(2 * 40), 2)
    straight, straight_opt, _, _ = pair("adamw")
    run_programs(build(straight, straight_opt, windows[0][0]), windows)

    first, first_opt, _, _ = pair("adamw")
    run_programs(build(first, first_opt, windows[0][0]), windows[:20])
    checkpoint = copy.deepcopy({"model": first.state_dict(), "optimizer": first_opt.state_dict()})
    resumed, resumed_opt, _, _ = pair("adamw")
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    run_programs(build(resumed, resumed_opt, windows[0][0]), windows[20:])
    for a, b in zip(resumed.state_dict().values(), straight.state_dict().values()):
        assert torch.equal(a, b)


def test_an_optimizer_state_loaded_under_built_programs_is_taken_up():
    windows = windows_of(make_batches(30), 1)
    model, opt, _, _ = pair("sgd")
    programs = build(model, opt, windows[0][0])
    run_programs(programs, windows[:10])
    saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
    run_programs(programs, windows[10:20])
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])  # new state tensors: the programs copy them into their own
    run_programs(programs, windows[10:20])
    reference, reference_opt, _, _ = pair("sgd")
    eager_loop(reference, reference_opt, windows[:20])
    assert max_relative_difference(model, reference) < 1e-5


@pytest.mark.slow
def test_the_inductor_backend_matches_the_plain_loop():
    windows = windows_of(make_batches(4 * UPDATES), 4)
    model, opt, reference, reference_opt = pair("sgd", batch_norm=True)
    programs = build(model, opt, windows[0][0], backend="inductor", gradient_clip_val=0.5)
    run_programs(programs, windows)
    eager_loop(reference, reference_opt, windows, clip=("norm", 0.5))
    assert max_relative_difference(model, reference) < 1e-5


@pytest.mark.slow
def test_inductor_programs_of_a_convolution_net_match_the_plain_loop():
    # on a CPU the programs are built with Inductor's layout optimization off and its C++ wrapper on
    # (inductor_options): convolutions, max-pooling and their backward through that route, AdamW, windows of 4
    windows = windows_of(make_image_batches(4 * 30), 4)
    model, reference = ConvClassifier(), ConvClassifier()
    opt, reference_opt = OPTIMIZERS["adamw"](model.parameters()), OPTIMIZERS["adamw"](reference.parameters())
    programs = build(model, opt, windows[0][0], backend="inductor")
    logged = run_programs(programs, windows)
    expected = eager_loop(reference, reference_opt, windows)
    assert max_relative_difference(model, reference) < 1e-5
    assert [row["double_loss"] for row in logged] == pytest.approx([row["double_loss"] for row in expected], rel=1e-5)


def test_several_micro_steps_per_call_match_the_plain_loop():
    windows = windows_of(make_batches(2 * 40), 2)
    model, opt, reference, reference_opt = pair("adamw")
    programs = build(model, opt, windows[0][0], micro_steps_per_call=4, accumulation_steps=2)
    logged = []
    for call in range(20):  # 4 micro-batches (2 windows) per call
        batches = [batch for window in windows[2 * call : 2 * call + 2] for batch in window]
        logged += [{name: value.item() for name, value in out.logs.items()} for out in programs.run_several(batches)]
    expected = eager_loop(reference, reference_opt, windows)
    assert max_relative_difference(model, reference) < 1e-5
    assert [row["double_loss"] for row in logged] == pytest.approx([row["double_loss"] for row in expected], rel=1e-5)
    # the loop alone: the calls never needed the one-micro-step programs
    assert set(programs.compile_seconds) == {"several"} and not programs.pair_built
    programs.accumulate(windows[0][0])  # (built now, on its first call)
    assert set(programs.compile_seconds) == {"accumulate", "update", "several"} and programs.pair_built


def test_several_micro_steps_per_call_run_whole_windows():
    model = Classifier()
    with pytest.raises(ValueError, match=r"micro_steps_per_call=6 is not a multiple of accumulation_steps=4"):
        build_step_programs(
            model,
            OPTIMIZERS["sgd"](model.parameters()),
            None,
            ProgramSettings(micro_steps_per_call=6, accumulation_steps=4),
        )
    with pytest.raises(ValueError, match=r"micro_steps_per_call=0 is not valid: pass an int >= 1"):
        build_step_programs(model, OPTIMIZERS["sgd"](model.parameters()), None, ProgramSettings(micro_steps_per_call=0))


def test_dropout_draws_the_eager_random_numbers_on_the_cpu():
    windows = windows_of(make_batches(20), 2)
    model, opt, reference, reference_opt = pair("sgd", dropout=0.5)
    programs = build(model, opt, windows[0][0])  # compiling restores the random state it used
    torch.manual_seed(123)
    run_programs(programs, windows)
    torch.manual_seed(123)
    eager_loop(reference, reference_opt, windows)
    assert max_relative_difference(model, reference) < 1e-5
    other, other_opt, _, _ = pair("sgd", dropout=0.5)
    torch.manual_seed(7)
    eager_loop(other, other_opt, windows)
    assert max_relative_difference(other, reference) > 1e-2  # the masks matter: other numbers, other parameters
