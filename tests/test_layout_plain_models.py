"""``lightning-sink layout`` on LightningModules as users write them for one device: no ``configure_model``, and a
``configure_optimizers`` that reads the Trainer (``estimated_stepping_batches`` for OneCycleLR). The layout of the
parameters comes out with one line saying the optimizer state was left out; the one-device checkpoint reshards with
it; every failure is one ``error:`` line."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_sink.cli import main
from lightning_sink.layout import load_layout
from lightning_sink.layout_inference import infer_layout
from tests.helpers import loader, make_dataset, quiet_trainer

MODEL = "tests.test_layout_plain_models.OneCycleNet"


class OneCycleNet(pl.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        total = self.trainer.estimated_stepping_batches  # needs a Trainer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=int(total))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class BrokenInit(OneCycleNet):
    def __init__(self) -> None:
        raise RuntimeError("no config file found")


def layout_cli(tmp_path, capsys, *extra: str, model: str = MODEL, dp: int = 2, tp: int = 1) -> tuple[int, str]:
    code = main(
        [
            "layout",
            "--model",
            model,
            "--data-parallel-size",
            str(dp),
            "--tensor-parallel-size",
            str(tp),
            "--output",
            str(tmp_path / "layout.json"),
            *extra,
        ]
    )
    return code, capsys.readouterr().err


def test_a_trainer_reading_module_gets_its_parameters_layout_and_one_line_why(tmp_path, capsys):
    code, err = layout_cli(tmp_path, capsys)
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"note: optimizer state left out: {MODEL}.configure_optimizers")
    assert "needs a Trainer" in lines[0] and "--no-optimizer" in lines[0]
    layout = load_layout(tmp_path / "layout.json")
    assert sorted(layout.tensors) == [f"state_dict.net.{i}.{p}" for i in (0, 2) for p in ("bias", "weight")]
    weight = layout.tensors["state_dict.net.0.weight"]  # 16 x 8: fully_shard splits the rows over the 2 ranks
    assert [(c.rank, c.offsets, c.sizes) for c in weight.chunks] == [(0, (0, 0), (8, 8)), (1, (8, 0), (8, 8))]
    assert not dist.is_initialized()


def test_no_optimizer_asks_nothing_and_says_nothing(tmp_path, capsys):
    code, err = layout_cli(tmp_path, capsys, "--no-optimizer")
    assert (code, err) == (0, "")


def test_the_python_api_warns_once_and_returns_the_parameters_layout():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layout = infer_layout(OneCycleNet, 2, 1)
    assert [str(w.message) for w in caught if "optimizer state left out" in str(w.message)]
    assert not any(key.startswith("optimizer_0.") for key in layout.tensors)


@pytest.mark.parametrize(
    "model, tp, expected",
    [
        (MODEL, 2, r"does not override configure_model, so there is no tensor-parallel plan"),
        ("tests.test_layout_plain_models.BrokenInit", 1, r"building it raised RuntimeError: no config file found"),
        ("tests.test_layout_plain_models.Missing", 1, r"has no attribute 'Missing'"),
    ],
)
def test_every_failure_is_one_error_line(tmp_path, capsys, model, tp, expected):
    import re

    code, err = layout_cli(tmp_path, capsys, model=model, tp=tp)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and re.search(expected, err), err
    assert not (tmp_path / "layout.json").exists()


def test_a_one_device_checkpoint_reshards_with_the_predicted_layout(tmp_path, capsys):
    """The recipe of docs/resharding.md: train on one device, predict the target layout, reshard the .ckpt."""
    model = OneCycleNet()
    trainer = quiet_trainer(max_epochs=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(make_dataset(num_samples=16), 4))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert layout_cli(tmp_path, capsys, "--no-optimizer")[0] == 0
    code = main(
        [
            "reshard",
            "--src-checkpoints-dir",
            str(tmp_path / "last.ckpt"),
            "--dst-checkpoints-dir",
            str(tmp_path / "dp2"),
            "--dst-strategy-file",
            str(tmp_path / "layout.json"),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    weight = model.net[0].weight.detach()
    for rank in (0, 1):
        saved = torch.load(tmp_path / "dp2" / f"rank_{rank}" / f"checkpoint_{rank}.pt", weights_only=True)
        assert torch.equal(saved["tensors"]["state_dict.net.0.weight"], weight[8 * rank : 8 * rank + 8])
