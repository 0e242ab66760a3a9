"""``self.log`` / ``self.log_dict`` in every argument form inside a compiled ``training_step``: bound against the
real ``LightningModule.log`` signature (Python's own ``inspect.Signature.bind`` is the reference), and, in a fit,
what reaches the logger, the progress bar and ``callback_metrics`` against the same fit with
``graph_mode="eager"``."""

from __future__ import annotations

import inspect
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink.compiled.logged_values import LoggedValues
from tests.compiled.test_lightning_fit import Net, RecordingLogger, dataset, fit, trainer_for

# (args after the name and value, keyword arguments) of self.log calls; each a form LightningModule.log accepts
LOG_CALLS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    ((), {}),
    ((True,), {}),  # prog_bar
    ((False, True, False, True), {}),  # prog_bar, logger, on_step, on_epoch
    ((True,), {"on_epoch": True, "reduce_fx": "max"}),
    ((False, None, True, True, "sum", False, False, None, True, 4), {}),  # ... through batch_size
    ((), {"prog_bar": True, "batch_size": 2, "rank_zero_only": False}),
]


@pytest.mark.parametrize("args, kwargs", LOG_CALLS)
def test_a_log_call_binds_as_lightning_module_log_does(args, kwargs):
    signature = inspect.signature(pl.LightningModule.log)
    value = torch.tensor(1.5)
    expected = signature.bind(None, "x", value, *args, **kwargs).arguments  # (self, name, value, ...)
    expected = {k: v for k, v in expected.items() if k not in ("self", "name", "value")}
    recorder = LoggedValues()
    with recorder.installed_on(Net()):
        recorder.log("x", value, *args, **kwargs)
    assert recorder.call_options["x"] == expected
    assert torch.equal(recorder.values["x"], value)


def test_name_and_value_by_keyword_and_log_dict_positional_options():
    recorder = LoggedValues()
    module = Net()
    with recorder.installed_on(module):
        module.log(value=torch.tensor(2.0), name="k", on_step=False)
        module.log_dict({"a": torch.tensor(1.0), "b": 3}, True, None, False, True)  # prog_bar, logger, on_step, ...
        module.log_dict(dictionary={"c": torch.tensor(4.0)}, prog_bar=True)
    assert recorder.call_options == {
        "k": {"on_step": False},
        "a": {"prog_bar": True, "logger": None, "on_step": False, "on_epoch": True},
        "b": {"prog_bar": True, "logger": None, "on_step": False, "on_epoch": True},
        "c": {"prog_bar": True},
    }
    assert {name: float(value) for name, value in recorder.values.items()} == {"k": 2.0, "a": 1.0, "b": 3.0, "c": 4.0}
    assert "log" not in module.__dict__ and "log_dict" not in module.__dict__  # the module's own methods are back


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13), {}),  # one positional argument too many
        ((True,), {"prog_bar": False}),  # twice
        ((), {"progress_bar": True}),  # no such option
    ],
)
def test_a_call_log_would_refuse_is_refused_as_python_refuses_it(args, kwargs):
    signature = inspect.signature(pl.LightningModule.log)
    with pytest.raises(TypeError):
        signature.bind(None, "x", 1.0, *args, **kwargs)
    recorder = LoggedValues()
    with recorder.installed_on(Net()), pytest.raises(TypeError):
        recorder.log("x", 1.0, *args, **kwargs)


class EveryLogForm(Net):
    """Logs through each argument form of ``log`` and ``log_dict``."""

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        mean = logits.mean()
        self.log("positional_prog_bar", loss, True)
        self.log("positional_step_epoch", 2 * mean, False, True, False, True)  # on_epoch only
        self.log(name="keywords", value=mean.abs(), on_step=True, on_epoch=True, prog_bar=True)
        self.log("mixed", loss.detach() * 3, True, reduce_fx="max", on_epoch=True)
        self.log_dict({"dict_a": mean, "dict_b": loss + 1}, True, True, True, True)  # ... on_step, on_epoch
        self.log_dict(dictionary={"dict_keywords": 2 * loss}, on_step=False, on_epoch=True)
        return loss


def test_every_log_form_reaches_lightning_as_in_the_eager_fit(caplog, monkeypatch):
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")
    results = {}
    for graph_mode in ("eager", "compile"):
        torch._dynamo.reset()
        logger = RecordingLogger()
        trainer = trainer_for(graph_mode, 2, 5, 2, logger=logger, log_every_n_steps=1)
        fit(trainer, EveryLogForm("sgd"), dataset(), caplog)
        results[graph_mode] = (
            logger.points,
            {k: float(v) for k, v in trainer.callback_metrics.items()},
            {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        )
    (eager_points, eager_metrics, eager_bar), (points, metrics, bar) = results["eager"], results["compile"]
    assert [step for step, _ in points] == [step for step, _ in eager_points] and len(points) >= 4
    for (_, point), (_, eager_point) in zip(points, eager_points):
        assert point.keys() == eager_point.keys()
        assert point == pytest.approx(eager_point, rel=1e-5, abs=1e-7)
    # the options took effect: positional prog_bar, on_step/on_epoch given positionally, log_dict's likewise
    assert {"positional_prog_bar", "mixed_step", "dict_a_step", "keywords_epoch"} <= bar.keys()
    assert {"positional_step_epoch", "dict_keywords"} <= metrics.keys()
    assert "positional_step_epoch_step" not in metrics
    assert bar.keys() == eager_bar.keys() and bar == pytest.approx(eager_bar, rel=1e-5, abs=1e-7)
    assert metrics.keys() == eager_metrics.keys() and metrics == pytest.approx(eager_metrics, rel=1e-5, abs=1e-7)
