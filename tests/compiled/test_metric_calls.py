"""torchmetrics Metrics in a compiled ``training_step`` (``lightning_sink/compiled/metric_calls.py``): their calls
are recorded in the program and made on the real Metric after it, eagerly; what a program cannot hold is refused
in one line naming the attribute and the call. Built with ``aot_eager`` (fast to build)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_sink.compiled import ProgramSettings, Unavailable, build_step_programs
from tests.compiled.models import make_batches


class MetricStep(nn.Module):
    """Logs the Metric's forward result (the batch accuracy) and the Metric itself."""

    def __init__(self, use: str = "log") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 4)
        self.acc = MulticlassAccuracy(num_classes=4)
        self.use = use

    def log(self, name: str, value: Any, **kwargs: Any) -> None:  # replaced while a program runs
        pass

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        batch_acc = self.acc(logits, y)
        if self.use == "arithmetic":
            return F.cross_entropy(logits, y) * (1 - batch_acc)
        self.log("batch_acc", batch_acc)
        self.log("acc", self.acc, on_epoch=True)
        return F.cross_entropy(logits, y)


def test_the_metric_sees_the_eager_steps_calls_and_logs_resolve_to_them():
    module = MetricStep()
    eager_net, eager_acc = nn.Linear(8, 4), MulticlassAccuracy(num_classes=4)
    eager_net.load_state_dict(module.net.state_dict())
    programs = build_step_programs(
        module, torch.optim.SGD(module.parameters(), lr=0.1), make_batches(1)[0], ProgramSettings(backend="aot_eager")
    )
    assert not isinstance(programs, Unavailable), programs
    eager_optimizer = torch.optim.SGD(eager_net.parameters(), lr=0.1)
    for x, y in make_batches(4):
        logs = programs.host_logs(programs.update((x, y)))
        logits = eager_net(x)
        expected = eager_acc(logits.detach(), y)
        eager_optimizer.zero_grad()
        F.cross_entropy(logits, y).backward()
        eager_optimizer.step()
        assert list(logs) == ["batch_acc", "acc"]  # in the order logged
        assert logs["acc"] is module.acc  # the Metric itself, as Lightning takes it
        assert torch.equal(logs["batch_acc"], expected)
        assert programs.logged.options["acc"] == {"on_epoch": True}
    assert torch.equal(module.acc.compute(), eager_acc.compute())  # four updates, as eager's
    assert "forward" not in vars(module.acc)  # the recorders are gone after each call


def test_a_forward_result_used_in_arithmetic_is_refused_naming_the_metric():
    module = MetricStep(use="arithmetic")
    programs = build_step_programs(
        module, torch.optim.SGD(module.parameters(), lr=0.1), make_batches(1)[0], ProgramSettings(backend="aot_eager")
    )
    assert isinstance(programs, Unavailable)
    assert programs.reason.startswith("training_step uses the result of torchmetrics Metric `self.acc`(...)")
