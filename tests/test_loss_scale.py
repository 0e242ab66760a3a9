"""The loss-scale rule, against its documented statement and against torch.amp.GradScaler."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_sink import DynamicLossScale, FixedLossScale, LossScalePrecision
from lightning_sink.loss_scale import LossScaler


def documented_rule(config: DynamicLossScale, overflows: list[bool]) -> list[float]:
    """The README's rule, written out in plain Python."""
    scale, growth, allowance, trajectory = config.init_scale, 0, config.hysteresis, []
    for overflow in overflows:
        if overflow:
            growth, allowance = 0, allowance - 1
            if allowance <= 0:
                scale = max(scale / config.scale_factor, config.min_scale)
        else:
            growth += 1
            if growth == config.scale_window:
                growth, allowance = 0, config.hysteresis
                scale = min(scale * config.scale_factor, config.max_scale)
        trajectory.append(scale)
    return trajectory


def run_scaler(config, overflows: list[bool]) -> tuple[list[float], int]:
    scaler = LossScaler(config)
    trajectory = []
    for overflow in overflows:
        scaler.update(torch.tensor(float(overflow)))
        trajectory.append(scaler.scale.item())
    return trajectory, int(scaler.skipped.item())


@pytest.mark.parametrize(
    "hysteresis, window, min_scale, max_scale", [(1, 3, 1.0, 2.0**10), (2, 4, 4.0, 2.0**9), (3, 2, 1.0, 2.0**12)]
)
def test_scripted_windows_follow_the_documented_rule(hysteresis, window, min_scale, max_scale):
    rng = random.Random(hysteresis)
    overflows = [rng.random() < 0.3 for _ in range(300)] + [False] * 40 + [True] * 30
    config = DynamicLossScale(
        init_scale=2.0**8, scale_window=window, hysteresis=hysteresis, min_scale=min_scale, max_scale=max_scale
    )
    trajectory, skipped = run_scaler(config, overflows)
    assert trajectory == documented_rule(config, overflows)
    assert skipped == sum(overflows)
    assert min(trajectory) == min_scale and max(trajectory) == max_scale  # both bounds were exercised


def test_matches_torch_grad_scaler_step_for_step():
    """hysteresis=1, init 2**16, window 2000: the same scale as GradScaler after every step."""
    overflow_steps = {10, 11, 50, 2500, 2600, 2601, 2602}  # two runs of > 2000 good steps: growth, twice
    overflows = [step in overflow_steps for step in range(4700)]
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    reference = torch.amp.GradScaler(
        "cpu", init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000
    )
    ours = LossScaler(DynamicLossScale(init_scale=2.0**16, scale_window=2000, hysteresis=1, max_scale=2.0**40))
    reference.scale(torch.ones(()))  # GradScaler creates its scale tensor lazily
    grew, previous = False, reference.get_scale()
    for overflow in overflows:
        param.grad = torch.full((1,), float("inf") if overflow else 1.0)
        reference.step(optimizer)
        reference.update()
        ours.update(torch.tensor(float(overflow)))
        assert ours.scale.item() == reference.get_scale()
        grew, previous = grew or reference.get_scale() > previous, reference.get_scale()
    assert grew


def test_fixed_scale_counts_only_dropped_windows():
    trajectory, skipped = run_scaler(FixedLossScale(64.0), [True, False, True])
    assert trajectory == [64.0] * 3 and skipped == 2
    assert run_scaler(FixedLossScale(64.0, drop_overflow_update=False), [True, True])[1] == 0


def test_unscale_and_overflow_flag():
    scaler = LossScaler(FixedLossScale(8.0))
    flat = torch.tensor([16.0, 32.0])
    assert scaler.check_and_unscale_(flat, divisor=2).item() == 0.0
    assert flat.tolist() == [1.0, 2.0]
    assert scaler.check_and_unscale_(torch.tensor([1.0, float("nan")]), divisor=1).item() == 1.0


def test_state_round_trip():
    scaler = LossScaler(DynamicLossScale(init_scale=1024.0, scale_window=3, hysteresis=2))
    for overflow in (True, True, False):
        scaler.update(torch.tensor(float(overflow)))
    restored = LossScaler(DynamicLossScale(init_scale=1024.0, scale_window=3, hysteresis=2))
    restored.load_state_dict(scaler.state_dict())
    for name in ("scale", "growth_tracker", "hysteresis_left", "skipped"):
        assert torch.equal(getattr(restored, name), getattr(scaler, name))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 0}, r"init_scale=0\) must be > 0"),
        ({"scale_factor": 1.0}, r"scale_factor=1.0\) must be > 1"),
        ({"scale_window": 0}, r"scale_window=0\) must be an int >= 1"),
        ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 4.0}, r"needs 0 < min_scale <= max_scale"),
        ({"init_scale": 2.0**30}, r"must lie in \[min_scale, max_scale\]"),
        ({"hysteresis": 0}, r"hysteresis=0\) must be an int >= 1"),
    ],
)
def test_dynamic_scale_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScale(**kwargs)


def test_plugin_arguments():
    with pytest.raises(ValueError, match=r"FixedLossScale\(loss_scale=-1\) must be > 0"):
        FixedLossScale(-1)
    with pytest.raises(ValueError, match=r"precision='fp8' is not valid: choose one of '16-mixed', 'bf16-mixed'"):
        LossScalePrecision("fp8")
    with pytest.raises(TypeError, match=r"loss_scale=128 is not valid: pass DynamicLossScale"):
        LossScalePrecision("16-mixed", loss_scale=128)


def test_defaults_scale_fp16_only():
    assert isinstance(LossScalePrecision("16-mixed").loss_scale, DynamicLossScale)
    assert isinstance(LossScalePrecision("16-true").loss_scale, DynamicLossScale)
    for precision in ("bf16-mixed", "bf16-true", "32-true"):
        plugin = LossScalePrecision(precision)
        assert plugin.loss_scale is None and plugin.scale == 1.0 and plugin.skipped_updates == 0
    # DynamicLossScale()'s own defaults are tested against torch's GradScaler in test_loss_scale_default.py
