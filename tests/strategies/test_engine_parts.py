"""The engine's parts checked on their own: every gradient store and reducer has its whole protocol, the sink's step
programs agree with each other, and the logging rule the sink loop copies from Lightning is Lightning's."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_sink import LossScalePrecision, SinkStrategy
from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import GradientAccumulator, SingleStepGradients
from lightning_sink.sink.logging import _logs_at_update
from lightning_sink.sink.programs.eager import (
    DirectAccumulate,
    DirectUpdate,
    HookedAccumulate,
    HookedUpdate,
    SingleStepUpdate,
)
from lightning_sink.strategies.fsdp_window import FSDPWindow
from lightning_sink.window import FlatAllReduce, GradientStore, NoGradients, NoReduction, OverflowFlagAllReduce, Reducer
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer

# ------------------------------------------------------------------ protocols


def _members(protocol: type) -> dict[str, object]:
    """Every member a protocol declares: its methods and properties, and its annotated attributes."""
    declared = {name: value for name, value in vars(protocol).items() if not name.startswith("_")}
    declared.update(dict.fromkeys(getattr(protocol, "__annotations__", {})))
    return declared


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(3, 2).parameters())


STORES = {
    "GradientAccumulator": GradientAccumulator,
    "SingleStepGradients": SingleStepGradients,
    "NoGradients": lambda params: NoGradients(),
    "FSDPWindow": lambda params: FSDPWindow(nn.Linear(3, 2), params, data_parallel_size=1),
}
REDUCERS = {
    "NoReduction": lambda params: NoReduction(),
    "FlatAllReduce": lambda params: FlatAllReduce(lambda: []),
    "OverflowFlagAllReduce": lambda params: OverflowFlagAllReduce(world_size=1),
}


@pytest.mark.parametrize(
    "protocol, make",
    [(GradientStore, make) for make in STORES.values()] + [(Reducer, make) for make in REDUCERS.values()],
    ids=list(STORES) + list(REDUCERS),
)
def test_every_store_and_reducer_has_its_whole_protocol(protocol, make):
    implementation = make(_params())
    assert isinstance(implementation, protocol)  # every member is there
    for name, declared in _members(protocol).items():
        assert hasattr(implementation, name), name
        if inspect.isfunction(declared):  # ... and each method takes the protocol's arguments
            wanted = list(inspect.signature(declared).parameters)[1:]
            assert list(inspect.signature(getattr(implementation, name)).parameters) == wanted, name


@pytest.mark.parametrize("make", STORES.values(), ids=STORES.keys())
def test_every_store_answers_has_overflow_with_a_device_flag(make):
    params = _params()
    store = make(params)
    store.begin_micro_step()
    (sum(param.sum() for param in params) * float("inf")).backward()
    store.end_micro_step()
    flag = store.has_overflow()
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.numel() == 1
    assert bool(flag) is (type(store) is not NoGradients)  # (NoGradients has no gradient to overflow)


# ------------------------------------------------------------------ the step programs against each other


class RecordsPrograms(Callback):
    def __init__(self):
        self.programs = set()

    def on_train_batch_end(self, trainer, *args):
        programs = trainer.strategy.sink_fit.sink_loop.programs
        self.programs.add((type(programs.accumulate), type(programs.update), programs.update.loss_divisor))


class HooksZeroGrad(Callback):
    """Overrides a hook the direct programs skip, so the hooked ones run."""

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        pass


def fit_sinks(model, steps, callbacks=(), plugins=()):
    record = RecordsPrograms()
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=steps, sink_size=6),
        max_epochs=4,
        callbacks=[record, *callbacks],
        plugins=list(plugins),
    )
    trainer.fit(model, loader(make_dataset(num_samples=48), 4))
    return record.programs, trainer


def test_hooked_and_direct_programs_train_alike():
    hooked, direct = TinyClassifier(optimizer="adamw", lr=0.01), TinyClassifier(optimizer="adamw", lr=0.01)
    hooked_programs, hooked_trainer = fit_sinks(hooked, 3, callbacks=[HooksZeroGrad()])
    direct_programs, direct_trainer = fit_sinks(direct, 3)
    assert hooked_programs == {(HookedAccumulate, HookedUpdate, 3)}  # each loss divided by N, as Lightning's closure
    assert direct_programs == {(DirectAccumulate, DirectUpdate, 3)}  # the same division, without the dispatch
    assert hooked_trainer.global_step == direct_trainer.global_step == 8
    assert torch.equal(flat_params(direct), flat_params(hooked))  # so the sums round alike


def test_single_step_and_direct_programs_train_alike():
    single = TinyClassifier(optimizer="sgd", lr=0.05)
    direct = copy.deepcopy(single)
    single_programs, _ = fit_sinks(single, 1)
    # an unscaled LossScalePrecision keeps the window's store (and so the direct update) for windows of one
    direct_programs, _ = fit_sinks(direct, 1, plugins=[LossScalePrecision("32-true")])
    assert single_programs == {(DirectAccumulate, SingleStepUpdate, 1)}
    assert direct_programs == {(DirectAccumulate, DirectUpdate, 1)}
    assert torch.equal(flat_params(direct), flat_params(single))


# ------------------------------------------------------------------ the logging rule copied from Lightning


class ComparesLoggingRules(Callback):
    """Inside a fit (Lightning's fit loop active): the copied rule against Lightning's ``should_update_logs``."""

    def __init__(self):
        self.compared = 0

    def on_train_batch_start(self, trainer, *args):
        if self.compared:
            return
        saved = trainer.log_every_n_steps, trainer.should_stop
        try:
            for every_n in (0, 1, 3, 50):
                for should_stop in (False, True):
                    trainer.log_every_n_steps, trainer.should_stop = every_n, should_stop
                    for update in range(1, 12):
                        # Lightning asks at the update's batch, when the logging step is the update before it
                        with compat.logging_step_set_to(trainer, update - 1):
                            lightnings = trainer._logger_connector.should_update_logs or bool(trainer.fast_dev_run)
                        assert _logs_at_update(trainer, update) == lightnings, (every_n, should_stop, update)
                        self.compared += 1
        finally:
            trainer.log_every_n_steps, trainer.should_stop = saved


@pytest.mark.parametrize("fast_dev_run", [False, 2])
def test_the_copied_logging_rule_is_lightnings(fast_dev_run):
    compare = ComparesLoggingRules()
    trainer = quiet_trainer(max_epochs=1, callbacks=[compare], fast_dev_run=fast_dev_run)
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    assert compare.compared == 4 * 2 * 11
