"""graph_mode="compile" in sink mode: a training_step that makes TorchDynamo recompile at every step (a list on self
that grows) is named in one warning with the fix; a clean step, and the same step with the fix the warning gives,
get none. What the watch counts is checked against TorchDynamo's own behaviour: the bad step really reaches
TorchDynamo's recompile limit, the fixed one does not, and both train as the same steps run eagerly."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer, relative_error

# 22 samples in micro-batches of 4: a last micro-batch of 2, and batch_idx used in the step, so the clean steps
# also make the recompiles TorchDynamo's automatic dynamic shapes settle in one each (a size, a Python int).
SAMPLES, MICRO = 22, 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Clean(TinyClassifier):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y) * (1.0 + 0.0 * batch_idx)
        self.log("train_loss", loss)
        return loss


class AppendsToAList(Clean):
    """Keeps every loss in a Python list (issue 27: ``len(self.rec_losses) == 7`` hit the recompile limit)."""

    def __init__(self):
        super().__init__()
        self.rec_losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.rec_losses.append(loss.detach())
        return loss


class AppendsOutsideTheGraph(AppendsToAList):
    """The warning's fix: the bookkeeping in a method that TorchDynamo does not compile."""

    def training_step(self, batch, batch_idx):
        loss = Clean.training_step(self, batch, batch_idx)
        self.record(loss.detach())
        return loss

    @torch.compiler.disable
    def record(self, loss):
        self.rec_losses.append(loss)


def fit(module, graph_mode: str) -> list[str]:
    strategy = SinkStrategy(sink_size=8, accumulation_steps=2, graph_mode=graph_mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=strategy, max_epochs=2).fit(module, loader(make_dataset(num_samples=SAMPLES), MICRO))
    return [str(warning.message) for warning in caught if "recompile" in str(warning.message)]


def test_a_step_that_appends_to_a_list_gets_one_warning_naming_recompiles_and_the_fix():
    module = AppendsToAList()
    with torch._dynamo.config.patch(recompile_limit=4):  # (half the default: half the compiles; the watch reads it)
        messages = fit(module, "compile")
    assert len(messages) == 1, messages
    message = messages[0]
    assert "TorchDynamo recompiled training_step" in message and "rec_losses" in message  # the failing guard
    assert "after 4 versions" in message
    assert "@torch.compiler.disable" in message and "docs/sink_mode.md" in message
    assert counters["frames"]["total"] > counters["frames"]["ok"]  # TorchDynamo really refused to compile more
    assert len(module.rec_losses) == 16


@pytest.mark.parametrize("module_class", [Clean, AppendsOutsideTheGraph])
def test_a_clean_step_and_the_fixed_step_get_no_warning_and_train_as_eager(module_class):
    eager = module_class()
    assert fit(eager, "eager") == []
    torch._dynamo.reset()
    compiled = module_class()
    assert fit(compiled, "compile") == []
    assert counters["frames"]["total"] == counters["frames"]["ok"]  # no compile was refused
    assert counters["stats"]["unique_graphs"] >= 1  # the step really went through TorchDynamo
    assert relative_error(flat_params(compiled), flat_params(eager)) <= 1e-5  # Inductor may round differently
