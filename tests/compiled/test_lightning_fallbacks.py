"""``SinkStrategy(sink_size=K, graph_mode="compile")`` where the whole-step programs cannot be built: the fit says
so in one line at its start, naming the reason and what to change, and runs the step it runs today (the
forward-compiled ``training_step`` and the eager step programs), with the same result as ``graph_mode="eager"``.

Today's forward compilation is given the ``aot_eager`` backend here (the same graphs run by eager kernels: fast to
build, and the eager run's numbers)."""

from __future__ import annotations

import random
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy
import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_sink.sink.programs.compiled_choice as compiled_choice
import lightning_sink.strategies.fit_lifecycle as fit_lifecycle
from tests.compiled.test_lightning_fit import Net, dataset, flat, loader, relative_error, trainer_for


@pytest.fixture(autouse=True)
def quick_backends(monkeypatch):
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(
        fit_lifecycle,
        "step_function",
        lambda step, graph_mode: step if graph_mode == "eager" else torch.compile(step, backend="aot_eager"),
    )
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RMSpropNet(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


class BeforeStepNet(Net):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen = getattr(self, "seen", 0) + 1


class OptimizerStepNet(Net):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)


class HostReadNet(Net):
    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss if loss.item() > 0 else -loss  # a host read: the step cannot be one graph


class GlobalStepNet(Net):
    """A warm-up weight from ``self.global_step``, as a KL or auxiliary-loss warm-up is written."""

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * min(1.0, (self.global_step + 1) / 3)


class EpochNet(Net):
    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) / (1 + self.current_epoch)


class LearningRateNet(Net):
    """Logs the scheduler's learning rate from ``training_step``."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer, step_lr=0.9)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return super().training_step(batch, batch_idx)


class OptimizerLearningRateNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer, step_lr=0.9)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * self.optimizers().param_groups[0]["lr"] * 100


class CounterNet(Net):
    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().training_step(batch, batch_idx)


class KeptLossesNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss


class ReassignedBufferNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        self.register_buffer("count", torch.zeros(()))

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        self.count = self.count + 1  # (a new tensor: the programs had dropped it, the count stayed 0)
        return super().training_step(batch, batch_idx) * (1 + 0.01 * self.count)


class OwnGeneratorNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        self.noise = torch.Generator().manual_seed(0)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        # (the build's runs had drawn from it too: the fit's draws came after three extra ones)
        return super().training_step(batch, batch_idx) * (1 + 0.1 * torch.rand((), generator=self.noise))


class PythonRandomNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        random.seed(0)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (0.5 + random.random())


class NumpyRandomNet(Net):
    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        numpy.random.seed(0)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * float(0.5 + numpy.random.rand())


class AfterBackward(Callback):
    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        pass


# name: (module class, Trainer arguments, what the one line says)
CASES: dict[str, tuple[type[Net], dict[str, Any], str]] = {
    "unsupported optimizer": (RMSpropNet, {}, "the optimizer RMSprop has no compiled update rule"),
    "module hook": (BeforeStepNet, {}, "LightningModule.on_before_optimizer_step overridden"),
    "optimizer_step override": (OptimizerStepNet, {}, "LightningModule.optimizer_step overridden"),
    "callback hook": (Net, {"callbacks": [AfterBackward()]}, "AfterBackward.on_after_backward overridden"),
    "graph break": (HostReadNet, {}, "training_step did not compile to one graph"),
    "half precision": (Net, {"precision": "bf16-true"}, "runs training_step in a context other than autocast"),
    "profiler": (Net, {"profiler": "simple"}, "Lightning's hooks are dispatched here (a profiler records them"),
    # Python state the host changes as the fit runs: a compiled call of several micro-batches would keep one value
    "global_step": (GlobalStepNet, {}, "reads self.global_step (the trainer's global_step), which changes"),
    "current_epoch": (EpochNet, {}, "reads self.current_epoch (the trainer's current_epoch)"),
    "scheduler read": (LearningRateNet, {}, "reads self.lr_schedulers() (the trainer's lr_scheduler_configs)"),
    "optimizer read": (OptimizerLearningRateNet, {}, "reads self.optimizers() or self.trainer.strategy"),
    "counter": (CounterNet, {}, "training_step changes self.calls (absent -> 1) at each call"),
    "kept list": (KeptLossesNet, {}, "training_step changes self.losses (a list of 0 -> a list of 1)"),
    "reassigned buffer": (ReassignedBufferNet, {}, "training_step assigns self.count a new tensor at each call"),
    "python random": (PythonRandomNet, {}, "training_step draws from Python's random module"),
    "numpy random": (NumpyRandomNet, {}, "training_step draws from NumPy's global random generator"),
    "own generator": (OwnGeneratorNet, {}, "training_step draws from self.noise (a torch.Generator of the module's)"),
}


HOST_STATE = ("global_step", "current_epoch", "scheduler read", "optimizer read", "counter", "kept list")
HOST_STATE += ("python random", "numpy random", "reassigned buffer", "own generator")


@pytest.mark.parametrize("case", list(CASES))
def test_each_reason_is_one_line_and_the_fit_is_the_eager_one(case):
    module_class, trainer_kwargs, says = CASES[case]
    params, kept = {}, {}
    for graph_mode in ("eager", "compile"):
        model = module_class("adamw")
        trainer = trainer_for(graph_mode, 3, 7, 2, **dict(trainer_kwargs))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        lines = [str(w.message) for w in caught if "no whole-step programs" in str(w.message)]
        params[graph_mode] = flat(model.net)
        kept[graph_mode] = (
            getattr(model, "calls", None),
            len(getattr(model, "losses", [])),
            float(getattr(model, "count", 0)),
        )
    assert kept["compile"] == kept["eager"]  # (the side effects as often as the eager step makes them)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    # a step reading host state runs uncompiled: a compiled forward would compile again for each new value
    path = "the module's own training_step, uncompiled" if case in HOST_STATE else "the forward-compiled"
    assert lines[0].startswith(f"SinkStrategy(graph_mode='compile'): no whole-step programs, {path}")
    assert says in lines[0]
    assert "graph_mode='eager'" in lines[0] or "run without" in lines[0]  # what to change
    if case == "graph break":  # the user's line that broke the graph, and what it did
        assert "in training_step: return loss if loss.item() > 0" in lines[0], lines[0]
        assert "a tensor's value was used as a Python number" in lines[0], lines[0]
    assert trainer.global_step == 4
    tolerance = 1e-2 if trainer_kwargs.get("precision") == "bf16-true" else 1e-5  # bf16 rounding: the forward runs
    assert relative_error(params["compile"], params["eager"]) <= tolerance  # through dynamo's graphs under "compile"


def test_a_step_reading_host_state_falls_back_to_its_own_uncompiled_step_with_no_recompile():
    # a compiled forward would compile again for each new global_step, up to TorchDynamo's limit and past it
    params, messages = {}, []
    for graph_mode in ("eager", "compile"):
        model = GlobalStepNet("adamw")
        trainer = trainer_for(graph_mode, 1, 8, 6)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        messages = [str(w.message) for w in caught]
        params[graph_mode] = flat(model.net)
    assert trainer.global_step == 48  # (six times TorchDynamo's limit of versions of one frame)
    lines = [message for message in messages if "no whole-step programs" in message]
    assert len(lines) == 1 and "the module's own training_step, uncompiled, runs instead" in lines[0], lines
    assert not [message for message in messages if "recompile" in message], messages
    assert torch.equal(params["compile"], params["eager"])  # the same step, run the same way


class CurriculumNet(Net):
    """A loss weight a hook sets at each epoch's start (a curriculum): the same during a sink, new at the next."""

    alpha = 0.0

    def on_train_epoch_start(self) -> None:
        self.alpha = 0.1 * self.current_epoch

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * (1 + self.alpha)


def test_a_value_a_hook_changes_at_every_sink_hands_over_to_the_eager_pair_before_torchdynamos_limit():
    # each new alpha is a new program version; at TorchDynamo's limit a program compiled whole would stop the fit
    params, lines = {}, []
    for graph_mode in ("eager", "compile"):
        model = CurriculumNet("adamw")
        trainer = trainer_for(graph_mode, 1, 4, 12)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        lines = [str(w.message) for w in caught if "no whole-step programs" in str(w.message)]
        params[graph_mode] = flat(model.net)
    assert trainer.global_step == 48
    assert len(lines) == 1 and "TorchDynamo compiled the programs again" in lines[0] and "alpha" in lines[0], lines
    assert "the module's own training_step, uncompiled" in lines[0]  # (a compiled forward would compile again)
    assert not [w for w in caught if "recompiled training_step" in str(w.message)]
    assert relative_error(params["compile"], params["eager"]) <= 1e-5


class UnfreezeAtEpoch(Callback):
    """Trains the first layer only from the given epoch on (as a finetuning callback does)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        module.net[0].requires_grad_(trainer.current_epoch >= self.epoch)


# sinks of 7 with windows of 3: the window is open at each sink's end, where the parameters are unfrozen; the eager
# pair continues the sum the programs began (a .grad of None would have started it again)
@pytest.mark.parametrize(("sink_size", "updates"), [(6, 8), (7, 9)], ids=["windows closed", "a window open"])
def test_a_change_of_the_trainable_parameters_hands_over_to_the_eager_pair_exactly(sink_size, updates):
    params, lines = {}, []
    for graph_mode in ("eager", "compile"):
        model = Net("sgd")
        model.net[0].requires_grad_(False)
        trainer = trainer_for(graph_mode, 3, sink_size, 4, callbacks=[UnfreezeAtEpoch(2)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, loader(dataset()))
        lines = [str(w.message) for w in caught if "no whole-step programs" in str(w.message)]
        params[graph_mode] = flat(model.net)
    assert len(lines) == 1 and "the optimizer's trainable parameters changed" in lines[0], lines
    assert trainer.global_step == updates
    assert not torch.equal(params["eager"][:144], flat(Net("sgd").net)[:144])  # the first layer did train
    assert relative_error(params["compile"], params["eager"]) <= 1e-5
