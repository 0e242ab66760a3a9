"""``lightning-sink reshard`` and ``verify`` run without importing Lightning or torchmetrics, and ``import
lightning_sink`` still registers the strategies with Lightning, whichever of the two a script imports first.

Each case runs in a fresh interpreter: this test process has Lightning loaded already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sink.layout import MeshLayout, layout_on_mesh, save_layout
from lightning_sink.reshard import transform_checkpoints
from lightning_sink.reshard.open_source import open_source
from tests.reshard.conftest import rows

pytestmark = pytest.mark.slow

HEAVY = ("lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics")

# Runs the command line in-process and reports which of HEAVY were imported by the time it returned.
_RUN_CLI = f"""
import json, sys
from lightning_sink.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
loaded = sorted({{name.split(".")[0] for name in sys.modules}} & set({HEAVY!r}))
print(json.dumps({{"status": status, "loaded": loaded}}))
"""


def run_cli(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _RUN_CLI, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "out": done.stdout}


@pytest.fixture
def one_device(tmp_path: Path) -> tuple[Path, Path]:
    """A plain ``torch.save`` state dict and a two-rank row layout for it."""
    source = tmp_path / "model.pt"
    torch.save({"w": torch.arange(24.0).reshape(6, 4), "b": torch.ones(6)}, source)
    target = layout_on_mesh(open_source(source, None).layout, MeshLayout.one_dimensional(2), rows)
    return source, save_layout(target, tmp_path / "two.json")


def test_verify_does_not_import_lightning(one_device: tuple[Path, Path], tmp_path: Path):
    source, layout = one_device
    transform_checkpoints(source, tmp_path / "out", "ckpt_", None, layout)
    result = run_cli("verify", str(tmp_path / "out"))
    assert result["status"] == 0 and "OK:" in result["out"]
    assert result["loaded"] == []
    help_result = run_cli("verify", "--help")
    assert help_result["status"] == 0 and help_result["loaded"] == []


def test_reshard_does_not_import_lightning(one_device: tuple[Path, Path], tmp_path: Path):
    source, layout = one_device
    result = run_cli(
        "reshard",
        "--src-checkpoints-dir",
        str(source),
        "--dst-checkpoints-dir",
        str(tmp_path / "out"),
        "--dst-strategy-file",
        str(layout),
        "--ckpt-prefix",
        "ckpt_",
        "--no-progress",
    )
    assert result["status"] == 0
    assert result["loaded"] == []
    assert torch.equal(
        torch.load(tmp_path / "out" / "rank_1" / "ckpt_1.pt", weights_only=True)["tensors"]["w"],
        torch.arange(24.0).reshape(6, 4)[3:],
    )


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning_sink\nimport lightning.pytorch as pl",
        "import lightning.pytorch as pl\nimport lightning_sink",
        "import lightning_sink\nimport lightning as L\npl = L.pytorch",
        "from lightning_sink import SinkStrategy\nimport lightning.pytorch as pl",
        "from lightning_sink import LossScalePrecision\nimport lightning.pytorch as pl",
        "from lightning_sink.callbacks import LossMonitor\nimport lightning.pytorch as pl",
    ],
    ids=["sink-first", "lightning-first", "lightning-root", "strategy-first", "precision-first", "callbacks-first"],
)
def test_importing_the_package_registers_the_strategies_in_any_order(imports: str):
    """Whichever import loads Lightning first, every name is registered and builds its strategy."""
    code = f"""{imports}
from lightning.pytorch.strategies import StrategyRegistry
from lightning_sink import SinkDDPStrategy, SinkStrategy
names = ("sink", "sink_ddp", "sink_ddp_spawn", "sink_model_parallel")
assert all(name in StrategyRegistry for name in names), sorted(StrategyRegistry)
quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
assert type(pl.Trainer(strategy="sink", **quiet).strategy) is SinkStrategy
spawn = pl.Trainer(strategy="sink_ddp_spawn", accelerator="cpu", devices=2, **quiet).strategy
assert type(spawn) is SinkDDPStrategy and spawn._start_method == "spawn", (type(spawn), spawn._start_method)
print("registered")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("registered")


def test_the_registered_names_are_the_strategies_own():
    """What ``import lightning_sink`` registers (names, descriptions, arguments) is what each strategy class's own
    ``register_strategies`` says."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_sink import SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy
    from lightning_sink._registration import STRATEGY_NAMES

    own = type(StrategyRegistry)()
    for strategy in (SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy):
        strategy.register_strategies(own)
    assert {name: (e["strategy"].__name__, e["description"], e["init_params"]) for name, e in own.items()} == (
        STRATEGY_NAMES
    )
