"""The partial-window rule and the fp32 buffer, independent of Lightning."""

from __future__ import annotations

import pytest
import torch

from lightning_sink.accumulation import GradientAccumulator, MicroStep, plan_micro_step
from tests.helpers import group_windows


def simulate(batches_per_epoch: int, steps: int, epochs: int, partial_window: str) -> list[list[int]]:
    """Run the rule over an unsized stream of epochs; return the micro-batch ids of each applied update."""
    updates, window, batch_id = [], [], 0
    for _ in range(epochs):
        for index in range(batches_per_epoch):
            plan = plan_micro_step(len(window), steps, index == batches_per_epoch - 1, partial_window)
            window.append(batch_id)
            if plan is MicroStep.UPDATE:
                updates.append(window)
                window = []
            elif plan is MicroStep.ACCUMULATE_THEN_DROP:
                window = []
            batch_id += 1
    return updates


@pytest.mark.parametrize("partial_window", ["scale", "drop", "carry", "lightning"])
@pytest.mark.parametrize("batches_per_epoch, steps", [(10, 4), (8, 4), (3, 4), (7, 1), (9, 3)])
def test_rule_matches_window_grouping(batches_per_epoch, steps, partial_window):
    epochs = 3
    per_epoch = [[[e * batches_per_epoch + i] for i in range(batches_per_epoch)] for e in range(epochs)]
    expected = group_windows(per_epoch, steps, partial_window)
    assert simulate(batches_per_epoch, steps, epochs, partial_window) == expected


def test_buffer_state_round_trip_and_mismatch():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    accumulator = GradientAccumulator(params)
    accumulator.begin_micro_step()
    (params[0].sum() * 2 + params[1].sum()).backward()
    accumulator.end_micro_step()
    state = accumulator.state_dict()
    assert state["micro_steps"] == 1 and torch.equal(state["buffer"], torch.tensor([2.0] * 6 + [1.0] * 4))

    restored = GradientAccumulator([torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(4))])
    restored.load_state_dict(state)
    assert restored.micro_steps == 1 and torch.equal(restored.flat, state["buffer"])
    with pytest.raises(ValueError, match=r"buffer has 10 elements but the model's trainable parameters have 3"):
        GradientAccumulator([torch.nn.Parameter(torch.zeros(3))]).load_state_dict(state)


def test_frozen_and_shared_parameters_are_counted_once():
    shared = torch.nn.Parameter(torch.ones(2))
    frozen = torch.nn.Parameter(torch.ones(5), requires_grad=False)
    accumulator = GradientAccumulator([shared, frozen, shared])
    assert accumulator.flat.numel() == 2


def test_empty_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match="got no trainable parameters"):
        GradientAccumulator([torch.nn.Parameter(torch.ones(2), requires_grad=False)])


def test_single_step_gradients_are_each_micro_steps_own_as_in_a_plain_loop():
    from lightning_sink.accumulation import SingleStepGradients

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 2))
    store = SingleStepGradients([weight])
    assert store.flat is None  # no window buffer: nothing is summed, reduced or unscaled
    for _ in range(3):
        x = torch.randn(5, 3)
        store.begin_micro_step()
        (x @ weight).square().sum().backward()
        store.end_micro_step()
        store.write_gradients()
        expected = 2 * x.T @ (x @ weight.detach())  # d/dW sum((xW)^2), this micro-batch's alone
        assert torch.allclose(weight.grad, expected, rtol=1e-6)
        assert store.micro_steps == 1
        store.clear()
        assert store.micro_steps == 0 and store.state_dict() == {"micro_steps": 0, "buffer": None}


def test_single_step_gradients_refuse_a_checkpoint_taken_inside_a_window():
    from lightning_sink.accumulation import SingleStepGradients

    store = SingleStepGradients([torch.nn.Parameter(torch.zeros(2))])
    store.load_state_dict({"micro_steps": 0, "buffer": None})  # a window boundary: fine
    with pytest.raises(
        ValueError, match=r"inside an accumulation window \(3 micro-steps accumulated\).*accumulation_steps=1"
    ):
        store.load_state_dict({"micro_steps": 3, "buffer": torch.zeros(2)})


def test_a_window_whose_loss_divisor_changes_goes_on_with_its_sum_rescaled():
    """A checkpoint of programs that added whole losses' gradients (compiled programs, or an earlier version),
    resumed by programs that divide each loss by N: the sum so far is rescaled, so the window's mean is the mean of
    its micro-batches' gradients, as with one division throughout."""
    from lightning_sink.window.state import Window

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(5))
    targets = [torch.randn(5) for _ in range(3)]
    window = Window(GradientAccumulator([param]), ranks_in_sum=1)
    for index, target in enumerate(targets):
        if index == 1:
            window.divide_losses_by(3)  # the programs of the resumed fit
        window.store.begin_micro_step()
        ((param - target) ** 2).sum().div(window.loss_divisor).backward()
        window.store.end_micro_step()
    window.store.unscale(None, window.mean_divisor())
    window.store.write_gradients()
    expected = sum(2 * (param.detach() - target) for target in targets) / 3
    torch.testing.assert_close(param.grad, expected)
