"""What a callback may change between sinks that the compiled programs took as fixed when they were built
(``sink/programs/build_assumptions.py``, ``OptimizerRule.changed_flags`` / ``lost_state``): each change hands the
fit over to the eager pair in one line naming it, and the fit trains as the same fit with ``graph_mode="eager"``.
Before the checks, the compiled fits trained an old tensor (a parameter given a new one, a buffer assigned anew),
kept the old clipping or dampening, or stopped with an error (the optimizer's state cleared, a pruning hook added).

The programs are built with the ``aot_eager`` backend, as in ``test_lightning_fit.py``."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.nn.utils import prune

from tests.compiled.test_lightning_fit import (
    Net,
    dataset,
    flat,
    loader,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
    trainer_for,
)


class AtEpoch(Callback):
    """Runs ``change(trainer, module)`` at the start of epoch 2 (a sink: the programs were built at the first)."""

    def __init__(self, change: Any) -> None:
        self.change = change

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 2:
            self.change(trainer, module)


def rebind_parameter(trainer: pl.Trainer, module: Any) -> None:
    weight = module.net[0].weight
    weight.data = weight.data.clamp(-0.05, 0.05)  # (WGAN's clipping written with a new tensor)


def rebind_buffer(trainer: pl.Trainer, module: Any) -> None:
    module.net[1].running_mean = module.net[1].running_mean * 0.5


def add_pruning(trainer: pl.Trainer, module: Any) -> None:
    prune.l1_unstructured(module.net[0], "weight", amount=0.3)  # (what Lightning's ModelPruning does)


def schedule_clipping(trainer: pl.Trainer, module: Any) -> None:
    trainer.gradient_clip_val = 0.05


def clear_optimizer_state(trainer: pl.Trainer, module: Any) -> None:
    trainer.optimizers[0].state.clear()  # (a warm restart)


def set_dampening(trainer: pl.Trainer, module: Any) -> None:
    trainer.optimizers[0].param_groups[0]["dampening"] = 0.5


# name: (the change, the optimizer, BatchNorm, what the one line says)
CASES = {
    "a parameter given a new tensor": (rebind_parameter, "adamw", False, "the module's 'net.0.weight' was given a new"),
    "a buffer assigned anew": (rebind_buffer, "adamw", True, "the module's 'net.1.running_mean' was given a new"),
    "a pruning hook": (add_pruning, "adamw", False, "a hook was added to or removed from the module"),
    "clipping scheduled": (schedule_clipping, "sgd", False, "gradient clipping changed from (0.5, 'norm') to (0.05,"),
    "optimizer state cleared": (clear_optimizer_state, "sgd", False, "lost momentum_buffer (optimizer.state cleared)"),
    "SGD dampening": (set_dampening, "sgd", False, "param_groups[0]['dampening'] changed from 0 to 0.5"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_the_programs_cannot_follow_hands_over_in_one_line_and_trains_as_eager(case):
    change, optimizer, batch_norm, says = CASES[case]
    params, lines = {}, []
    for graph_mode in ("eager", "compile"):
        model = Net(optimizer, batch_norm=batch_norm)
        trainer = trainer_for(graph_mode, 1, 10, 4, callbacks=[AtEpoch(change)], gradient_clip_val=0.5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        lines = [str(w.message) for w in caught if "no whole-step programs" in str(w.message)]
        params[graph_mode] = torch.cat([flat(model.net), *(b.flatten() for b in model.net.buffers())])
    assert len(lines) == 1 and says in lines[0], lines
    assert trainer.global_step == 40
    assert relative_error(params["compile"], params["eager"]) <= 1e-5


def test_a_parameter_changed_in_place_keeps_the_programs():
    def clamp_in_place(trainer: pl.Trainer, module: Any) -> None:
        module.net[0].weight.data.clamp_(-0.05, 0.05)

    params, lines = {}, []
    for graph_mode in ("eager", "compile"):
        model = Net("adamw")
        trainer = trainer_for(graph_mode, 1, 10, 4, callbacks=[AtEpoch(clamp_in_place)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        lines = [str(w.message) for w in caught if "no whole-step programs" in str(w.message)]
        params[graph_mode] = flat(model.net)
    assert lines == []
    assert relative_error(params["compile"], params["eager"]) <= 1e-5
