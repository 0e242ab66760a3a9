"""A call of several micro-steps carries the training state from window to window packed into one flat tensor per
dtype and device (``lightning_sink.compiled.flat_carry``): every kind of state must come out as it would from one
call per micro-batch, and each tensor keep its own layout. A parameter stored transposed (not contiguous), a
BatchNorm's float statistics and integer counter, SGD with momentum beside AdamW's moments and steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.compiled.test_lightning_fit import Net, flat, quick_backend  # noqa: F401  (the fixture)
from tests.compiled.test_several_per_call import logged_fit


def transposed_first_layer(model: Net) -> None:
    """The first layer's weight held as the transpose of a contiguous tensor, as a module may store it."""
    weight = model.net[0].weight
    model.net[0].weight = nn.Parameter(weight.detach().t().contiguous().t())


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_every_kind_of_carried_state_equals_one_call_per_micro_batch(optimizer, caplog, several_calls, monkeypatch):
    original = Net.__init__

    def init(self: Net, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        transposed_first_layer(self)

    monkeypatch.setattr(Net, "__init__", init)
    one = logged_fit(2, 8, 3, 1, caplog, optimizer=optimizer, batch_norm=True)
    assert several_calls == []
    several = logged_fit(2, 8, 3, 4, caplog, optimizer=optimizer, batch_norm=True)
    assert set(several_calls) == {4} and len(several_calls) >= 3
    for model in (one["model"], several["model"]):
        weight = model.net[0].weight
        assert weight.shape == (16, 8) and weight.stride() == (1, 16)  # still the module's own parameter
    assert torch.equal(flat(several["model"].net), flat(one["model"].net))
    counters = [model.net[1].num_batches_tracked for model in (one["model"], several["model"])]
    assert counters[0].dtype == torch.int64 and int(counters[0]) == int(counters[1]) > 0
    states = [model.trainer.optimizers[0].state for model in (one["model"], several["model"])]
    for parameter_one, parameter_several in zip(one["model"].parameters(), several["model"].parameters()):
        for key, value in states[0][parameter_one].items():
            assert torch.equal(states[1][parameter_several][key], value), key
    assert several["points"] == one["points"]
