"""The loss-scale update and the window mean are each one function, run by the eager path and traced into the
compiled programs alike: a change of that one function moves both paths."""

from __future__ import annotations

import torch

import lightning_sink.loss_scale as loss_scale
import lightning_sink.window.state as window_state
from lightning_sink import SinkStrategy
from lightning_sink.compiled import ProgramSettings, StepPrograms, build_step_programs
from lightning_sink.loss_scale import DynamicLossScale, LossScaler
from tests.compiled.models import Classifier, make_batches
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer


def tripling_rule(config, state, overflow) -> None:
    state["scale"].mul_(3.0)


def compiled_programs(model: torch.nn.Module, example, **kwargs) -> StepPrograms:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    programs = build_step_programs(model, optimizer, example, ProgramSettings(backend="aot_eager", **kwargs))
    assert isinstance(programs, StepPrograms), programs
    return programs


def test_a_changed_loss_scale_rule_moves_the_eager_scaler_and_the_compiled_update(monkeypatch):
    monkeypatch.setattr(loss_scale, "scale_rule", tripling_rule)
    scaler = LossScaler(DynamicLossScale(init_scale=4.0))
    scaler.update(torch.zeros(()))
    assert scaler.scale.item() == 12.0
    batches = make_batches(2)
    programs = compiled_programs(Classifier(), batches[0], loss_scale=DynamicLossScale(init_scale=4.0))
    programs.update(batches[0])
    assert programs.scaler is not None and programs.scaler.scale.item() == 12.0


def eager_update(steps: int) -> torch.Tensor:
    """One update of a SinkStrategy fit (SGD, its first step: the parameters move by lr times the mean gradient)."""
    model = TinyClassifier(lr=0.1)
    before = flat_params(model)
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=steps), max_steps=1)
    trainer.fit(model, loader(make_dataset(), 8))
    return flat_params(model) - before


def compiled_update() -> torch.Tensor:
    model = Classifier()
    before = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    batches = make_batches(2)
    programs = compiled_programs(model, batches[0])
    programs.accumulate(batches[0])
    programs.update(batches[1])
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]) - before


def test_a_changed_window_mean_moves_the_eager_and_the_compiled_update(monkeypatch):
    eager, compiled = eager_update(2), compiled_update()
    mean = window_state.window_mean_divisor
    monkeypatch.setattr(
        window_state, "window_mean_divisor", lambda passes, ranks, divisor: 2 * mean(passes, ranks, divisor)
    )
    halved_eager, halved_compiled = eager_update(2), compiled_update()
    assert torch.allclose(halved_eager, eager / 2, rtol=1e-3, atol=1e-6)
    assert torch.allclose(halved_compiled, compiled / 2, rtol=1e-3, atol=1e-6)
