"""A module that holds one parameter under two names (tied weights, as a language model's input embedding and
output projection are): the compiled programs must train the one tensor with the gradient of both uses, as eager
PyTorch does. Against a plain PyTorch loop written here, and against the same fit with ``graph_mode="eager"``."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from tests.compiled.test_lightning_fit import quick_backend  # noqa: F401  (the fixture: aot_eager)
from tests.helpers import quiet_trainer

MICRO_BATCHES, BATCH = 12, 4


def tied_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    net[4].weight = net[2].weight  # one tensor, two names
    return net


class TiedNet(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = tied_net()

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    samples = MICRO_BATCHES * BATCH
    return TensorDataset(
        torch.randn(samples, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )


def plain_loop(net: nn.Module) -> None:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for x, y in DataLoader(data(), batch_size=BATCH):
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def fitted(graph_mode: str, caplog: Any) -> nn.Sequential:
    model = TiedNet()
    strategy = SinkStrategy(sink_size=MICRO_BATCHES // 2, graph_mode=graph_mode)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_train_batches=MICRO_BATCHES // 2)
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer.fit(model, DataLoader(data(), batch_size=BATCH))
    assert trainer.global_step == MICRO_BATCHES
    if graph_mode == "compile":  # the programs built, not a fallback
        assert any("programs are compiled whole" in record.getMessage() for record in caplog.records)
    return model.net


def flat(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def test_a_tied_weight_trains_with_the_gradient_of_both_uses(caplog):
    compiled, eager = fitted("compile", caplog), fitted("eager", caplog)
    assert compiled[4].weight is compiled[2].weight  # still one tensor
    reference = copy.deepcopy(tied_net())
    plain_loop(reference)
    error = (flat(compiled) - flat(reference)).norm() / flat(reference).norm()
    assert float(error) <= 1e-5, float(error)
    assert torch.allclose(flat(compiled), flat(eager), rtol=0, atol=1e-6)
