"""When no program can be built: one line naming the reason and what to change, nothing of the run changed (the
caller's eager step then gives exactly the eager result), and bad arguments refused at the call."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch

from lightning_sink.compiled import ProgramSettings, ProgramUnavailable, StepPrograms, Unavailable, build_step_programs
from tests.compiled.models import OPTIMIZERS, Classifier, eager_loop, make_batches, max_relative_difference, windows_of


class LightningClassifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Classifier()
        self.net = self.inner.net

    def loss(self, batch):
        return self.inner.loss(batch)

    def training_step(self, batch, batch_idx):
        return self.inner.loss(batch)[0]


class WithBackwardHook(LightningClassifier):
    def on_after_backward(self) -> None:
        pass


class ManualOptimization(LightningClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class SGDSubclass(torch.optim.SGD):
    pass


def host_read_step(model: Classifier):
    def training_step(batch, batch_idx):
        loss, _ = model.loss(batch)
        return loss if loss.item() > 0 else -loss  # a host read inside the step: no single graph

    return training_step


def with_parameter_hook(model):
    model.net[0].weight.register_hook(lambda grad: grad * 2)
    return model


def with_step_hook(optimizer):
    optimizer.register_step_pre_hook(lambda *args: None)
    return optimizer


CASES = {  # name: (module factory, optimizer factory, what the reason says)
    "closure optimizer": (Classifier, lambda p: torch.optim.LBFGS(p), "LBFGS needs a closure"),
    "unknown optimizer": (Classifier, lambda p: torch.optim.RMSprop(p), "RMSprop has no compiled update rule"),
    "optimizer subclass": (Classifier, lambda p: SGDSubclass(p, lr=0.1), "SGDSubclass has no compiled update rule"),
    "dampening": (Classifier, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening=0"),
    "overridden hook": (WithBackwardHook, OPTIMIZERS["sgd"], "overrides on_after_backward"),
    "manual optimization": (ManualOptimization, OPTIMIZERS["sgd"], "manual optimization"),
    "parameter hook": (lambda: with_parameter_hook(Classifier()), OPTIMIZERS["sgd"], "gradient hook on parameter"),
    "optimizer hook": (Classifier, lambda p: with_step_hook(OPTIMIZERS["adam"](p)), "step hook on the Adam"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_unsupported_case_says_why_and_leaves_the_eager_run_as_it_was(case):
    make_module, make_optimizer, says = CASES[case]
    module = make_module()
    optimizer = make_optimizer(module.parameters())
    result = build_step_programs(module, optimizer, make_batches(1)[0], ProgramSettings(backend="aot_eager"))
    assert isinstance(result, Unavailable)
    assert says in result.reason and "\n" not in result.reason
    if case in ("closure optimizer", "manual optimization"):
        return  # the plain loop below does not apply to these
    # the caller's eager step: the same as on a module and optimizer that never saw the builder
    windows = windows_of(make_batches(8), 2)
    reference = make_module()
    reference_optimizer = make_optimizer(reference.parameters())
    eager_loop(module, optimizer, windows)
    eager_loop(reference, reference_optimizer, windows)
    assert max_relative_difference(module, reference) == 0


def test_a_graph_break_is_refused_at_build_and_changes_nothing():
    model = Classifier()
    model.training_step = host_read_step(model)
    optimizer = OPTIMIZERS["adam"](model.parameters())
    before = copy.deepcopy(model.state_dict())
    result = build_step_programs(model, optimizer, make_batches(1)[0], ProgramSettings(backend="aot_eager"))
    assert isinstance(result, Unavailable)
    assert result.reason.startswith("training_step did not compile to one graph (")
    assert result.reason.endswith("make it traceable or use graph_mode='eager'")
    assert optimizer.state_dict()["state"] == {}  # the state the builder created is gone again
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))


def test_a_flag_changed_after_the_build_stops_the_update_program():
    model = Classifier()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    programs = build_step_programs(model, optimizer, make_batches(1)[0], ProgramSettings(backend="aot_eager"))
    assert isinstance(programs, StepPrograms)
    optimizer.param_groups[0]["nesterov"] = False
    with pytest.raises(ProgramUnavailable, match=r"param_groups\[0\]\['nesterov'\] changed from True to False"):
        programs.update(make_batches(1)[0])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"gradient_clip_algorithm": "max"},
            r"gradient_clip_algorithm='max' is not valid: pass one of \('norm', 'value'\)",
        ),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val=-1.0 is not valid: pass a number > 0 or None"),
        ({"gradient_clip_val": True}, r"gradient_clip_val=True is not valid"),
        ({"cuda_graph": True}, r"cuda_graph=True needs the module on a CUDA device; its parameters are on cpu"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    model = Classifier()
    with pytest.raises(ValueError, match=message):
        build_step_programs(model, OPTIMIZERS["sgd"](model.parameters()), make_batches(1)[0], ProgramSettings(**kwargs))
