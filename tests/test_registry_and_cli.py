"""Strategy registry names and LightningCLI configs (class_path and string shortcuts)."""

from __future__ import annotations

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI

from lightning_sink import SinkDDPStrategy, SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer


class CliModel(TinyClassifier):
    def train_dataloader(self):
        return loader(make_dataset(num_samples=32), 4)


def test_registry_names_build_the_strategies():
    assert isinstance(quiet_trainer(strategy="sink").strategy, SinkStrategy)
    ddp = quiet_trainer(strategy="sink_ddp", devices=2).strategy
    assert isinstance(ddp, SinkDDPStrategy) and len(ddp.parallel_devices) == 2
    spawn = quiet_trainer(strategy="sink_ddp_spawn", devices=2).strategy
    assert isinstance(spawn, SinkDDPStrategy) and spawn._start_method == "spawn"


@pytest.mark.parametrize("misspelt, meant", [("sinkk", "sink"), ("snik", "sink"), ("sink-ddp", "sink_ddp")])
def test_a_close_misspelling_of_a_registered_name_is_answered_with_the_name(misspelt, meant):
    with pytest.raises(ValueError, match=rf"`strategy={misspelt!r}`\. Did you mean {meant!r}\?"):
        quiet_trainer(strategy=misspelt)


def test_names_far_from_ours_get_lightnings_own_message():
    with pytest.raises(ValueError, match="You selected an invalid strategy name") as refused:
        quiet_trainer(strategy="ddpp")
    assert "Did you mean" not in str(refused.value)  # Lightning's message, untouched


def test_cli_class_path_config(tmp_path):
    config = {
        "trainer": {
            "strategy": {
                "class_path": "lightning_sink.SinkStrategy",
                "init_args": {"accumulation_steps": 4, "partial_window": "carry"},
            },
            "max_epochs": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(CliModel, args=["fit", "--config", str(path)], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, SinkStrategy)
    assert (strategy.accumulation_steps, strategy.partial_window) == (4, "carry")
    assert cli.trainer.global_step == 2 * 8 // 4


@pytest.mark.parametrize("strategy_flag", ["sink", "sink_ddp"])
def test_cli_string_shortcut(strategy_flag):
    args = [
        "--trainer.strategy",
        strategy_flag,
        "--trainer.accumulate_grad_batches=2",
        "--trainer.devices=1",
        "--trainer.max_epochs=1",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.accelerator=cpu",
    ]
    cli = LightningCLI(CliModel, args=["fit", *args], save_config_callback=None)
    assert cli.trainer.strategy.strategy_name == strategy_flag
    assert cli.trainer.global_step == 4


@pytest.mark.parametrize(
    "loss_scale",
    [
        {"class_path": "lightning_sink.DynamicLossScale", "init_args": {"init_scale": 1024.0, "scale_window": 7}},
        {"init_scale": 1024.0, "scale_window": 7},  # a dataclass also parses from its fields
    ],
)
def test_cli_loss_scale_plugin_config(tmp_path, loss_scale):
    from lightning_sink import DynamicLossScale, LossScalePrecision

    config = {
        "trainer": {
            "strategy": {"class_path": "lightning_sink.SinkStrategy", "init_args": {"accumulation_steps": 2}},
            "plugins": [
                {
                    "class_path": "lightning_sink.LossScalePrecision",
                    "init_args": {"precision": "32-true", "loss_scale": loss_scale},
                }
            ],
            "max_epochs": 1,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
        }
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(CliModel, args=["fit", "--config", str(path)], save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, LossScalePrecision)
    assert plugin.loss_scale == DynamicLossScale(init_scale=1024.0, scale_window=7)
    assert cli.trainer.global_step == 4 and plugin.scale == 1024.0
