"""The standalone ``pytorch_lightning`` package: its Trainer takes the strategies by name and by class, and trains as
its own accumulation does, with the precision plugin and the callbacks of ``lightning_sink.pytorch_lightning``."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("pytorch_lightning")  # in the `test` extra; the package itself does not need it

import lightning_sink  # noqa: E402
from lightning_sink import _namespace_mirror  # noqa: E402
from lightning_sink.pytorch_lightning import (  # noqa: E402
    DynamicLossScale,
    LossScalePrecision,
    SinkDDPStrategy,
    SinkModelParallelStrategy,
    SinkStrategy,
)
from lightning_sink.pytorch_lightning.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor  # noqa: E402

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 8, generator=generator), torch.randint(0, 4, (128,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def fit(model: pl.LightningModule, epochs: int, **trainer_args: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", max_epochs=epochs, **QUIET, **trainer_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pytorch_lightning's advice on loader workers
        trainer.fit(model, data())
    return trainer


def parameters(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_classes_are_built_on_pytorch_lightning_and_the_loss_scales_are_shared():
    import lightning.pytorch

    assert issubclass(SinkStrategy, pl.strategies.SingleDeviceStrategy)
    assert issubclass(SinkDDPStrategy, pl.strategies.DDPStrategy)
    assert issubclass(SinkModelParallelStrategy, pl.strategies.ModelParallelStrategy)
    assert issubclass(LossScalePrecision, pl.plugins.precision.Precision)
    for callback in (LossMonitor, LossScaleMonitor, TimeMonitor):
        assert issubclass(callback, pl.Callback) and not issubclass(callback, lightning.pytorch.Callback)
    assert not issubclass(SinkStrategy, lightning.pytorch.strategies.Strategy)
    # Classes that never touch Lightning are one class in both namespaces: a loss scale made for one serves both.
    assert DynamicLossScale is lightning_sink.DynamicLossScale


@pytest.mark.parametrize(
    "name, devices, expected",
    [("sink", 1, SinkStrategy), ("sink_ddp", 2, SinkDDPStrategy), ("sink_ddp_spawn", 2, SinkDDPStrategy)],
)
def test_registered_names_build_pytorch_lightning_strategies(name, devices, expected):
    trainer = pl.Trainer(strategy=name, accelerator="cpu", devices=devices, **QUIET)
    assert type(trainer.strategy) is expected


def test_accumulation_equals_pytorch_lightnings_own_with_the_plugin_and_the_callbacks(capsys):
    stock = Classifier()
    sink = copy.deepcopy(stock)
    fit(stock, epochs=2, accumulate_grad_batches=4)
    trainer = fit(
        sink,
        epochs=4,  # 4 sinks of 16 micro-batches = 2 passes over the 32 micro-batches, as stock's 2 epochs
        strategy=SinkStrategy(accumulation_steps=4, sink_size=16),
        plugins=[LossScalePrecision("32-true", DynamicLossScale())],
        callbacks=[LossMonitor(), LossScaleMonitor(), TimeMonitor()],
    )
    assert trainer.global_step == 16  # 64 micro-batches / 4
    assert torch.equal(parameters(sink), parameters(stock))
    printed = capsys.readouterr().out
    assert re.findall(r"^epoch: (\d) step: 16, loss is [0-9.]+$", printed, re.MULTILINE) == ["1", "2", "3", "4"]
    scale = float(DynamicLossScale().init_scale)  # fp32 never overflows: the scale stays where it starts
    assert printed.count(f"step: 16, loss scale is {scale}, overflow is False, skipped updates is 0") == 4
    assert printed.count("epoch time: ") == 4  # TimeMonitor
    assert trainer.precision_plugin.skipped_updates == 0


def test_a_misspelt_name_is_answered_with_the_close_one():
    with pytest.raises(ValueError, match="Did you mean 'sink'"):
        pl.Trainer(strategy="sinkk", **QUIET)


IMPORT_ORDERS = {
    "sink-first": "import lightning_sink\nimport pytorch_lightning as pl",
    "pytorch_lightning-first": "import pytorch_lightning as pl\nimport lightning_sink",
    "namespace-only": "import pytorch_lightning as pl\nfrom lightning_sink.pytorch_lightning import SinkStrategy",
}


@pytest.mark.slow
@pytest.mark.parametrize("imports", IMPORT_ORDERS.values(), ids=IMPORT_ORDERS.keys())
def test_registration_in_any_import_order_without_loading_the_other_namespace(imports: str):
    code = f"""{imports}
import sys
from lightning_sink.pytorch_lightning import SinkStrategy
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
assert type(pl.Trainer(strategy="sink", **quiet).strategy) is SinkStrategy
assert "lightning.pytorch" not in sys.modules, "the lightning namespace was loaded for a pytorch_lightning user"
print("registered")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("registered")


@pytest.mark.slow
def test_lightning_users_never_load_pytorch_lightning():
    code = """import sys
import lightning.pytorch as pl
import lightning_sink
assert type(pl.Trainer(strategy="sink", logger=False).strategy) is lightning_sink.SinkStrategy
assert "pytorch_lightning" not in sys.modules
print("alone")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("alone")


@pytest.mark.parametrize(
    "source, refused",
    [
        ("import lightning.pytorch\n", "write `import lightning.pytorch as NAME`"),
        ("import lightning\n", "cannot mirror an import of 'lightning'"),
        ("from . import precision\n", "relative imports are not mirrored"),
    ],
)
def test_import_forms_the_renaming_would_change_are_refused_naming_the_line(tmp_path: Path, source, refused):
    path = tmp_path / "module.py"
    path.write_text("x = 1\n" + source)
    with pytest.raises(_namespace_mirror.MirrorError, match=rf"module\.py:2: .*{refused}"):
        _namespace_mirror.mirrored_source(path)


def test_only_import_statements_are_renamed(tmp_path: Path):
    import ast

    path = tmp_path / "module.py"
    path.write_text(
        "import lightning.pytorch as pl\n"
        "from lightning.fabric.utilities import apply_func\n"
        "from lightning_sink import _lightning_compat, loss_scale\n"
        "from lightning_sink.layout import load_layout\n"
        "NAME = 'lightning.pytorch'  # lightning.pytorch\n"
    )
    assert ast.unparse(_namespace_mirror.mirrored_source(path)).splitlines() == [
        "import pytorch_lightning as pl",
        "from lightning_fabric.utilities import apply_func",
        "from lightning_sink.pytorch_lightning import _lightning_compat, loss_scale",
        "from lightning_sink.layout import load_layout",
        "NAME = 'lightning.pytorch'",
    ]


def test_every_lightning_bound_module_of_the_package_can_be_mirrored():
    bound = _namespace_mirror.bound_modules()
    assert {"lightning_sink.strategies.engine", "lightning_sink.precision", "lightning_sink.callbacks"} <= bound
    assert "lightning_sink.loss_scale" not in bound and "lightning_sink._registration" not in bound  # shared
    for name in sorted(bound):
        _namespace_mirror.mirrored_source(_namespace_mirror._module_files()[name])  # raises MirrorError if not
