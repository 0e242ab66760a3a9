"""What a compiled fit says about its build (issue 39, item 8): at its start, how long the last identical build took
(a record kept beside Inductor's on-disk cache, ``TORCHINDUCTOR_CACHE_DIR``), and, where the fit is too short to
repay the build, one warning. The record is someone else's file: anything malformed in it means no figures, never an
error, and it stays bounded."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import types
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from lightning_sink.compiled.build_record import (
    MAX_ENTRIES,
    MAX_RECORD_BYTES,
    RECORD_NAME,
    BuildFigures,
    BuildRecord,
    build_key,
)
from lightning_sink.sink.programs import compiled_choice

SINK, EPOCHS = 4, 3


class Net(pl.LightningModule):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(caplog: pytest.LogCaptureFixture, epochs: int = EPOCHS) -> tuple[list[str], list[str]]:
    """One compiled fit of ``epochs`` sinks of ``SINK`` micro-batches: its info lines and its warnings."""
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=SinkStrategy(sink_size=SINK, graph_mode="compile", micro_steps_per_call=1),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(), DataLoader(data, batch_size=4))
    return [r.getMessage() for r in caplog.records], [str(w.message) for w in caught]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")  # (what is said, not the kernels)
    return tmp_path / "inductor"


def the_entry(cache: Path) -> dict[str, Any]:
    entries = json.loads((cache / RECORD_NAME).read_text())
    assert len(entries) == 1, entries
    return next(iter(entries.values()))


def test_the_second_fit_says_how_long_the_first_build_took(cache: Path, caplog: pytest.LogCaptureFixture):
    lines, _ = fit(caplog)
    starts = [line for line in lines if "the first sink compiles the step programs of Net with AdamW" in line]
    assert len(starts) == 1 and "no earlier build of the same module, optimizer and settings" in starts[0], lines
    entry = the_entry(cache)  # written by the first fit, beside Inductor's cache
    assert entry["build_seconds"] > 0 and entry["compiled_step_seconds"] > 0 and entry["eager_step_seconds"] > 0
    built = [line for line in lines if "programs are compiled whole" in line]
    assert len(built) == 1 and "ms eager," in built[0] and "ms compiled)" in built[0], built

    lines, _ = fit(caplog)
    starts = [line for line in lines if "the first sink compiles the step programs of Net" in line]
    assert len(starts) == 1, lines
    assert f"the last build of the same module, optimizer and settings took {entry['build_seconds']:.1f} s" in starts[0]
    assert f"{entry['eager_step_seconds'] * 1e3:.3g} ms eager" in starts[0]


def write_figures(cache: Path, **figures: Any) -> None:
    path = cache / RECORD_NAME
    entries = json.loads(path.read_text())
    (key,) = entries
    path.write_text(json.dumps({key: {**entries[key], **figures}}))


def too_short(warned: list[str]) -> list[str]:
    return [line for line in warned if "too short to repay the build" in line]


def test_a_fit_too_short_to_repay_the_last_build_says_so_in_one_line(cache: Path, caplog: pytest.LogCaptureFixture):
    fit(caplog)
    # a build of 1000 s gaining 1 ms a micro-step repays after 1,000,000 micro-batches; this fit trains 12
    write_figures(cache, build_seconds=1000.0, eager_step_seconds=0.002, compiled_step_seconds=0.001)
    _, warned = fit(caplog)
    said = too_short(warned)
    assert len(said) == 1 and "\n" not in said[0], warned
    assert said[0].startswith("SinkStrategy(graph_mode='compile'): this fit's 12 micro-batches left")
    assert "the last build took 1000.0 s and repays after about 1,000,000 micro-batches" in said[0]
    assert "graph_mode='eager' would finish sooner" in said[0]

    write_figures(cache, build_seconds=1000.0, eager_step_seconds=0.001, compiled_step_seconds=0.002)
    _, warned = fit(caplog)
    said = too_short(warned)
    assert len(said) == 1 and "compiled micro-steps were no faster than eager ones at the last build" in said[0]


def test_after_a_build_that_kept_its_loop_the_fit_is_judged_by_its_own_build(
    cache: Path, caplog: pytest.LogCaptureFixture
):
    # the last build took long but kept its loop on disk: this fit most likely loads it, so the long build says
    # nothing about this fit's cost; the start says what was kept, and only this fit's own build is judged
    fit(caplog)
    write_figures(cache, build_seconds=1000.0, eager_step_seconds=0.002, compiled_step_seconds=0.001, loop_kept=True)
    lines, warned = fit(caplog)
    starts = [line for line in lines if "the first sink compiles the step programs of Net" in line]
    assert len(starts) == 1 and "took 1000.0 s" in starts[0], lines
    assert (
        "kept its loop on disk, which this fit loads unless the module, its code or its settings changed" in starts[0]
    )
    assert all("the last build" not in line and "its build" in line for line in too_short(warned)), warned
    assert the_entry(cache)["loop_kept"] is False  # (this fit's build, aot_eager, kept no loop: recorded as such)


def test_a_fit_long_enough_to_repay_the_build_is_not_warned(cache: Path, caplog: pytest.LogCaptureFixture):
    fit(caplog)
    write_figures(cache, build_seconds=0.001, eager_step_seconds=0.002, compiled_step_seconds=0.001)  # repays after 1
    _, warned = fit(caplog)
    assert too_short(warned) == [], warned


# -- the record file, from someone else ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2, 3]",
        b"[" * 100_000,
        b'{"k": {"build_seconds": "10"}}',
        b'{"k": {"build_seconds": NaN}}',
        b'{"k": {"build_seconds": -1}}',
        b'{"k": {"build_seconds": true}}',
        b'{"k": {"build_seconds": 1, "eager_step_seconds": Infinity}}',
        b'{"k": {"eager_step_seconds": 1}}',
        b'{"k": 5}',
        b'{"k": {"build_seconds": 1}}' + b" " * MAX_RECORD_BYTES,
        b"\xff\xfe",
    ],
)
def test_a_malformed_record_gives_no_figures_and_is_replaced_by_a_good_one(tmp_path: Path, content: bytes):
    (tmp_path / RECORD_NAME).write_bytes(content)
    record = BuildRecord(tmp_path)
    assert record.load("k") is None
    assert record.save("k", BuildFigures(2.0, 0.003, 0.001))
    assert record.load("k") == BuildFigures(2.0, 0.003, 0.001)


def test_only_a_true_loop_kept_counts(tmp_path: Path):
    record = BuildRecord(tmp_path)
    assert record.save("kept", BuildFigures(2.0, 0.003, 0.001, loop_kept=True))
    assert record.load("kept") == BuildFigures(2.0, 0.003, 0.001, loop_kept=True)
    (tmp_path / RECORD_NAME).write_text('{"a": {"build_seconds": 1, "loop_kept": "yes"}, "b": {"build_seconds": 1}}')
    assert record.load("a") == record.load("b") == BuildFigures(1.0)


def test_the_record_keeps_only_the_newest_builds(tmp_path: Path):
    record = BuildRecord(tmp_path)
    for number in range(MAX_ENTRIES + 5):
        assert record.save(f"key{number}", BuildFigures(float(number)))
    entries = json.loads((tmp_path / RECORD_NAME).read_text())
    assert len(entries) == MAX_ENTRIES
    assert "key0" not in entries and record.load(f"key{MAX_ENTRIES + 4}") == BuildFigures(float(MAX_ENTRIES + 4))
    assert [path.name for path in tmp_path.iterdir()] == [RECORD_NAME]  # no temporary file left


def test_a_folder_that_cannot_be_written_means_no_record_and_no_error(tmp_path: Path):
    (tmp_path / "taken").write_text("a file where the folder would be")
    record = BuildRecord(tmp_path / "taken")
    assert record.save("k", BuildFigures(1.0)) is False
    assert record.load("k") is None


def test_repaying_is_the_build_over_the_gain_per_micro_step():
    assert BuildFigures(10.0, 0.003, 0.001).repays_after() == pytest.approx(5000)
    assert BuildFigures(10.0, 0.001, 0.001).repays_after() == math.inf
    assert BuildFigures(10.0).repays_after() is None


def test_builds_are_the_same_for_the_same_module_class_shapes_optimizer_and_settings():
    def key(width: int = 16, optimizer: type = torch.optim.AdamW, **settings: Any) -> str:
        module = Net(width)
        return build_key(module, optimizer(module.parameters()), {"graph_mode": "compile", **settings})

    assert key() == key()
    assert len({key(), key(width=32), key(optimizer=torch.optim.SGD), key(accumulation_steps=4)}) == 4


def test_two_scripts_run_as_main_with_a_class_of_the_same_name_are_not_the_same_build(tmp_path, monkeypatch):
    keys = []
    for script in ("first.py", "second.py"):
        main = types.ModuleType("__main__")
        main.__file__ = str(tmp_path / script)
        monkeypatch.setitem(sys.modules, "__main__", main)
        module = type("Net", (Net,), {"__module__": "__main__"})(16)
        keys.append(build_key(module, torch.optim.AdamW(module.parameters()), {"graph_mode": "compile"}))
    assert keys[0] != keys[1]


def test_a_fifo_or_a_link_in_place_of_the_record_gives_no_figures_and_never_blocks(tmp_path: Path):
    outside = tmp_path / "outside.json"
    outside.write_text('{"k": {"build_seconds": 1}}')  # (a well-formed record elsewhere: not read through a link)
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / RECORD_NAME).symlink_to(outside)
    assert BuildRecord(folder).load("k") is None
    (folder / RECORD_NAME).unlink()
    os.mkfifo(folder / RECORD_NAME)  # (no writer: a plain open would wait for one forever)
    record = BuildRecord(folder)
    answers: list[BuildFigures | None] = []
    reader = threading.Thread(target=lambda: answers.append(record.load("k")), daemon=True)
    reader.start()
    reader.join(timeout=30)
    assert answers == [None], "the record's reader blocked on a FIFO"
    assert record.save("k", BuildFigures(2.0)) and record.load("k") == BuildFigures(2.0)
    assert outside.read_text() == '{"k": {"build_seconds": 1}}'
