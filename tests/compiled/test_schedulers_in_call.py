"""``interval="step"`` LR schedulers inside a compiled call of several windows (``micro_steps_per_call=M``): each
update of the call uses the values the scheduler gives it, so the fit is bit for bit the fit with one micro-batch
per call (parameters, optimizer state, scheduler state, every logged learning rate and value, ``global_step``), for
the schedulers recipes use, sized from ``estimated_stepping_batches``; against the plain loop; and the cases that run
one window per call instead, said in one line.

The programs are built with the ``aot_eager`` backend, as in ``test_several_per_call.py``."""

from __future__ import annotations

import copy
import math
import re
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from torch.optim import lr_scheduler

from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
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
from tests.compiled.test_several_per_call import trainer_for
from tests.helpers import quiet_trainer


def warmup_cosine(optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    warmup = 3

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return {"scheduler": lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}


def one_cycle(optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    # cycles the learning rate and the momentum (AdamW's beta1, SGD's momentum) every update
    return {"scheduler": lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total), "interval": "step"}


def every_third(optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    return {"scheduler": lr_scheduler.StepLR(optimizer, 1, gamma=0.7), "interval": "step", "frequency": 3}


def chained(optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    parts = [lr_scheduler.ConstantLR(optimizer, factor=0.5, total_iters=5), lr_scheduler.ExponentialLR(optimizer, 0.9)]
    return {"scheduler": lr_scheduler.ChainedScheduler(parts), "interval": "step"}


def sequential(optimizer: torch.optim.Optimizer, total: int) -> dict[str, Any]:
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    cosine = lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - 4)
    return {"scheduler": lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[4]), "interval": "step"}


SCHEDULERS = {
    "warmup_cosine": warmup_cosine,
    "one_cycle": one_cycle,
    "every_third": every_third,
    "chained": chained,
    "sequential": sequential,
}


class Scheduled(Net):
    def __init__(self, optimizer: str, schedule: str) -> None:
        super().__init__(optimizer)
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        total = int(self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": SCHEDULERS[self.schedule](optimizer, total)}


def scheduled_fit(optimizer: str, schedule: str, calls: int, caplog: Any, model: Net | None = None) -> dict[str, Any]:
    model = model or Scheduled(optimizer, schedule)
    logger = RecordingLogger()
    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    trainer = trainer_for(2, 10, 3, calls, logger=logger, log_every_n_steps=1, callbacks=[monitor])
    fit(trainer, model, dataset(), caplog)
    return {"model": model, "trainer": trainer, "points": logger.points}


def _equal_states(first: Any, second: Any) -> bool:
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_equal_states(first[k], second[k]) for k in first)
    if isinstance(first, (list, tuple)):
        return len(first) == len(second) and all(_equal_states(a, b) for a, b in zip(first, second))
    if isinstance(first, torch.Tensor):
        return torch.equal(first, second)
    return first == second


@pytest.mark.parametrize(
    "optimizer, schedule",
    [
        ("adamw", "warmup_cosine"),
        ("adamw", "one_cycle"),
        ("sgd", "one_cycle"),
        ("adam", "every_third"),
        ("sgd", "chained"),
        ("adamw", "sequential"),
    ],
)
def test_a_call_of_several_windows_follows_the_step_scheduler_bit_for_bit(optimizer, schedule, caplog, several_calls):
    one = scheduled_fit(optimizer, schedule, 1, caplog)
    assert several_calls == []
    several = scheduled_fit(optimizer, schedule, 4, caplog)
    assert len(several_calls) >= 5 and set(several_calls) == {4}  # two updates per call, the scheduler in it
    assert torch.equal(flat(several["model"].net), flat(one["model"].net))
    trainers = several["trainer"], one["trainer"]
    assert trainers[0].global_step == trainers[1].global_step == 15
    assert _equal_states(trainers[0].optimizers[0].state_dict(), trainers[1].optimizers[0].state_dict())
    schedulers = [trainer.lr_scheduler_configs[0].scheduler.state_dict() for trainer in trainers]
    assert _equal_states(*schedulers)
    assert several["points"] == one["points"]
    rates = [value for _, point in one["points"] for name, value in point.items() if name.startswith("lr-")]
    assert len(set(rates)) >= 4  # the learning rate moved inside the fit, so inside calls


def test_a_step_scheduler_inside_calls_matches_the_plain_loop(caplog, several_calls):
    model = Net("adamw", step_lr=0.9)
    reference = copy.deepcopy(model.net)
    trainer = trainer_for(2, 10, 3, 4)
    fit(trainer, model, dataset(), caplog)
    assert set(several_calls) == {4}
    expected = plain_loop(reference, "adamw", 30, 2, dataset(), step_lr=0.9)
    assert trainer.global_step == expected["updates"] == 15
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(expected["lr"], rel=1e-12)
    assert relative_error(flat(model.net), flat(reference)) <= 1e-5


class RecordedSteps(Net):
    """A step scheduler whose every ``step()`` call is recorded, as a scheduler with side effects (a print, a
    counter, a log line) sees them."""

    def __init__(self) -> None:
        super().__init__("adamw")
        self.stepped: list[tuple[int, float]] = []

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        stepped = self.stepped

        class Recording(lr_scheduler.LambdaLR):
            def step(self, epoch: Any = None) -> None:
                super().step(epoch)
                stepped.append((self.last_epoch, self.get_last_lr()[0]))

        scheduler = Recording(optimizer, lambda step: 0.9**step)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def test_the_user_scheduler_is_stepped_once_per_update_as_by_stock_lightning(caplog, several_calls):
    # calls of several read each update's values by stepping the scheduler before the call: it must see exactly
    # the step() calls stock Lightning makes (none ahead and put back, none twice), in the same order
    stock = RecordedSteps()
    quiet_trainer(max_epochs=3, accumulate_grad_batches=2).fit(stock, loader(dataset()))
    sinks = RecordedSteps()
    fit(trainer_for(2, 10, 3, 4), sinks, dataset(), caplog)
    assert set(several_calls) == {4}
    assert len(stock.stepped) == 1 + 15  # the scheduler's own first step at construction, then one per update
    assert sinks.stepped == stock.stepped


def test_max_time_is_checked_between_calls(caplog, several_calls):
    """A time limit no longer turns the calls of several off: the clock is read after each call."""
    model = Net("adamw")
    reference = copy.deepcopy(model.net)
    trainer = trainer_for(2, 10, 3, 4, max_time={"days": 1})
    fit(trainer, model, dataset(), caplog)
    assert set(several_calls) == {4} and len(several_calls) >= 5
    expected = plain_loop(reference, "adamw", 30, 2, dataset())
    assert trainer.global_step == expected["updates"] == 15
    assert relative_error(flat(model.net), flat(reference)) <= 1e-5


def test_a_max_time_reached_ends_the_fit_after_the_call_in_flight(caplog, several_calls):
    model = Net("adamw")
    trainer = trainer_for(2, 10, 30, 4, max_time={"seconds": 0.5})
    fit(trainer, model, dataset(), caplog)
    # the programs' build (at the first sink's start) outlasts the limit: the first call's micro-batches, then the
    # fit ends
    assert several_calls == [4]
    assert trainer.global_step == 2


class HookedScheduler(Scheduled):
    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        scheduler.step()


@pytest.mark.parametrize(
    "case, message",
    [
        ("hook", r"HookedScheduler.lr_scheduler_step is overridden"),
        ("loss_scale", r"holds after an update skipped on overflow, which is known on the device only after a call"),
    ],
)
def test_a_scheduler_a_call_cannot_follow_runs_one_window_per_call_and_says_why(case, message, several_calls):
    """The module's ``lr_scheduler_step`` hook runs at each update; a skipping loss scale decides on the device
    whether the scheduler steps. Both: one line at the build, then the result of one micro-batch per call."""
    runs = []
    for calls in (4, 1):
        model = HookedScheduler("adamw", "warmup_cosine") if case == "hook" else Scheduled("adamw", "warmup_cosine")
        plugins = None
        if case == "loss_scale":
            plugins = [LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**8, scale_window=2))]
        trainer = trainer_for(2, 10, 3, calls, plugins=plugins)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # (with the loss scale, one window overflows and is skipped: the scheduler holds there)
            trainer.fit(model, loader(dataset(poison_at=(5,) if case == "loss_scale" else ())))
        said = [str(w.message) for w in caught if "micro_steps_per_call=4: one micro-batch per call" in str(w.message)]
        assert len(said) == (1 if calls == 4 else 0), said
        if calls == 4:
            assert re.search(message, said[0]), said[0]
        runs.append(model)
    assert several_calls == []
    assert torch.equal(flat(runs[0].net), flat(runs[1].net))


@pytest.mark.parametrize("calls", [1, 4])
def test_a_step_scheduler_does_not_warn_that_it_stepped_before_the_optimizer(calls, caplog, several_calls):
    """A program's update does not call the optimizer's ``step``, which is what tells torch's schedulers that the
    optimizer stepped: the programs tell them instead, so that a scheduler stepping after the first update (a
    fresh optimizer, one micro-batch per call or several) does not warn as though the user called it first."""
    trainer = trainer_for(1, 10, 1, calls)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"
        )
        fit(trainer, Scheduled("adamw", "warmup_cosine"), dataset(), caplog)
    assert trainer.global_step == 10
    assert (several_calls != []) == (calls > 1)  # the route each call length takes: run_several only for several
