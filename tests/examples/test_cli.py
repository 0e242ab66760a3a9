"""examples/cli.py (LightningCLI) run as a user runs it, in a subprocess, on scikit-learn's digits (offline)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.conftest import clean_subprocess_env
from tests.examples.output_checks import unexpected_warnings

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "examples" / "configs"
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$")
TIME_LINE = re.compile(r"^epoch time: [0-9.]+ ms, per step time: [0-9.]+ ms, throughput: [0-9.]+ samples/s$")
DIGITS = ["--data.source=digits"]  # 1497 training samples: 46 batches of 32 per epoch


def cli(tmp_path: Path, *args: str) -> str:
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="2")
    command = [sys.executable, str(REPO / "examples" / "cli.py"), *args]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert unexpected_warnings(done.stdout + done.stderr) == []
    return done.stdout


def loss_lines(stdout: str) -> list[tuple[int, int, str]]:
    return [(int(m[1]), int(m[2]), m[3]) for m in map(LOSS_LINE.match, stdout.splitlines()) if m]


@pytest.mark.slow
def test_accumulate_config_prints_and_logs_the_same_loss(tmp_path):
    stdout = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "accumulate.yaml"),
        *DIGITS,
        "--data.max_train_samples=320",
        "--trainer.max_epochs=2",
        "--trainer.callbacks.per_print_times=4",
        "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={tmp_path}",
    )
    # 10 steps per epoch, a line every 4 steps of the run.
    lines = loss_lines(stdout)
    assert [(e, s) for e, s, _ in lines] == [(1, 4), (1, 8), (2, 2), (2, 6), (2, 10)]
    assert all(str(np.float32(float(value))) == value for _, _, value in lines)
    assert sum(map(bool, map(TIME_LINE.match, stdout.splitlines()))) == 2  # one per epoch
    events = EventAccumulator(str(tmp_path / "lightning_logs" / "version_0"))  # the default TensorBoardLogger
    events.Reload()
    # Lightning's step axis: windows of 4, 4, 2 per epoch are updates 1-3 and 4-6; the lines at micro-batches 4 and
    # 8 close updates 1 and 2 (steps 0, 1), those at 12, 16 and 20 lie in updates 4, 5 and 6 (steps 3, 4, 5).
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [
        (s, np.float32(float(v))) for s, (_, _, v) in zip((0, 1, 3, 4, 5), lines)
    ]
    assert [e.step for e in events.Scalars("time/step_ms")] == [2, 5]  # each epoch's last update
    # LearningRateMonitor: Lightning's step (updates so far) at every batch start; windows of 4, 4, 2 per epoch.
    assert Counter(e.step for e in events.Scalars("lr-SGD")) == {0: 4, 1: 4, 2: 2, 3: 4, 4: 4, 5: 2}


@pytest.mark.slow
def test_loss_scale_config_runs_fp16_with_the_loss_scale_plugin(tmp_path):
    stdout = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "loss_scale.yaml"),
        *DIGITS,
        "--data.max_train_samples=128",
        "--trainer.log_every_n_steps=1",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert sum(map(bool, map(TIME_LINE.match, stdout.splitlines()))) == 1
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    (plugin,) = saved["trainer"]["plugins"]
    assert plugin["class_path"] == "lightning_sink.LossScalePrecision"
    assert plugin["init_args"]["precision"] == "16-mixed"
    assert [c["class_path"] for c in saved["trainer"]["callbacks"]] == [
        "lightning_sink.callbacks.LossScaleMonitor",
        "lightning_sink.callbacks.TimeMonitor",
        "lightning_sink.callbacks.LossMonitor",
    ]


@pytest.mark.slow
def test_printed_config_runs_again_unchanged(tmp_path):
    printed = cli(
        tmp_path,
        "fit",
        "--config",
        str(CONFIGS / "sink.yaml"),
        *DIGITS,
        "--trainer.strategy.init_args.sink_size=5",
        "--trainer.max_epochs=3",
        f"--trainer.default_root_dir={tmp_path}",
        "--print_config",
    )
    config = yaml.safe_load(printed)
    assert config["trainer"]["strategy"] == {
        "class_path": "lightning_sink.SinkStrategy",
        "init_args": {
            "accumulation_steps": 1,
            "partial_window": "scale",
            "sink_size": 5,
            "prefetch_depth": None,  # the default: no reading thread on CPU (sink.yaml runs on the CPU)
            "graph_mode": "eager",
            "device": None,
            "accelerator": None,
            "checkpoint_io": None,
            "precision_plugin": None,
            "checkpoint_random_state": True,
            "checkpoint_digests": True,
            "device_data_budget": None,
            "micro_steps_per_call": None,  # the default: decided at the build from the step's size
        },
    }
    callbacks = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert callbacks == ["lightning_sink.callbacks.TimeMonitor", "lightning_sink.callbacks.LossMonitor"]
    (tmp_path / "printed.yaml").write_text(printed)
    again = cli(tmp_path, "fit", "--config", str(tmp_path / "printed.yaml"))
    assert [(e, s) for e, s, _ in loss_lines(again)] == [
        (1, 5),
        (2, 5),
        (3, 5),
    ]  # once per sink, as MindSpore's sink mode
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert saved == config  # the run's own saved config is the printed one


@pytest.mark.slow
def test_string_shortcuts(tmp_path):
    stdout = cli(
        tmp_path,
        "fit",
        "--trainer.strategy=sink",
        "--trainer.accumulate_grad_batches=2",
        "--trainer.callbacks+=lightning_sink.callbacks.LossMonitor",
        "--trainer.callbacks.per_print_times=3",
        *DIGITS,
        "--data.max_train_samples=320",
        "--trainer.max_epochs=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=5",
        f"--trainer.default_root_dir={tmp_path}",
    )
    assert [(e, s) for e, s, _ in loss_lines(stdout)] == [(1, 3), (1, 6), (1, 9)]  # 10 steps
    saved = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert saved["trainer"]["strategy"] == "sink" and saved["trainer"]["accumulate_grad_batches"] == 2


@pytest.mark.parametrize("config", ["accumulate.yaml", "sink.yaml", "loss_scale.yaml"])
def test_per_print_times_on_the_command_line_reaches_the_loss_monitor(config, capsys, monkeypatch):
    """The documented override works with every shipped config (jsonargparse applies it to the last callback)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from cli import main

    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(CONFIGS / config), "--trainer.callbacks.per_print_times=10", "--print_config"])
    assert exited.value.code == 0
    callbacks = yaml.safe_load(capsys.readouterr().out)["trainer"]["callbacks"]
    (monitor,) = [c for c in callbacks if c["class_path"] == "lightning_sink.callbacks.LossMonitor"]
    assert monitor["init_args"]["per_print_times"] == 10
