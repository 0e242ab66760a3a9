"""The loop over windows kept on disk (``compiled/saved_loop.py``, on unless ``LIGHTNING_SINK_SAVED_LOOP=0``): a
second identical fit in a new process loads it instead of tracing it and trains exactly as a fit that compiled it as
usual (saving off); a fit that differs in what the trace relied on (a dropout's ``p``, an edited ``training_step``)
or finds a damaged file builds again and trains as its own code says. Each fit is a fresh Python process, as a
user's next run is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sink.compiled import loop_store

MODULE = """
import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


class Net(pl.LightningModule):
    def __init__(self, p):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(p), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y) * SCALE

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
CONFIG"""

FIT = """
import sys
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_sink import SinkStrategy
from net_module import Net

generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
trainer = pl.Trainer(
    accelerator="cpu", strategy=SinkStrategy(sink_size=8, graph_mode="compile"), max_epochs=3, logger=False,
    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
)


class ChangeP(pl.Callback):
    def on_train_epoch_end(self, trainer, module):
        module.net[2].p = 0.5  # (from the second sink on)


torch.manual_seed(2)  # (the dropout masks)
module = Net(float(sys.argv[2]))
if sys.argv[3] == "change p":
    trainer.callbacks.append(ChangeP())
trainer.fit(module, DataLoader(data, batch_size=4))
torch.save(module.state_dict(), sys.argv[1])
"""

LOADED = "the loop loaded from the program a fit of the same module and settings saved"
SAVED = "the loop saved for a later fit"


class Fits:
    """Fits of ``net_module.Net`` in new processes sharing one Inductor cache folder."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.cache, self.count = folder, folder / "inductor_cache", 0
        self.output: list[str] = []  # the last fit's lines
        (folder / "fit.py").write_text(FIT)
        self.write_module(scale="1.0")

    def write_module(self, scale: str, config: str = "") -> None:
        (self.folder / "net_module.py").write_text(MODULE.replace("SCALE", scale).replace("CONFIG", config))

    def run(self, p: float = 0.25, change: str = "", **env: str) -> tuple[str, dict[str, torch.Tensor]]:
        """The fit's build line and trained parameters."""
        return self.finish(self.start(p, change, **env))[0]

    def start(self, p: float = 0.25, change: str = "", **env: str) -> tuple[subprocess.Popen, Path]:
        """A fit started in a new process (``finish`` waits for it)."""
        self.count += 1
        out = self.folder / f"fit{self.count}.pt"
        path = os.pathsep.join([str(self.folder), str(Path.cwd())])
        environment = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(self.cache),
            "PYTHONPATH": path,
            "LIGHTNING_SINK_SAVED_LOOP": "",  # (the default)
            **env,
        }
        command = [sys.executable, str(self.folder / "fit.py"), str(out), str(p), change]
        process = subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return process, out

    def finish(self, *started: tuple[subprocess.Popen, Path]) -> list[tuple[str, dict[str, torch.Tensor]]]:
        """Each started fit's build line and trained parameters, once all have ended."""
        results = []
        for (process, out), (stdout, stderr) in zip(started, _ended([process for process, _ in started])):
            assert process.returncode == 0, stderr[-3000:]
            self.output = (stdout + stderr).splitlines()
            lines = [line for line in self.output if "programs are compiled whole" in line]
            assert len(lines) == 1, stdout[-3000:] + stderr[-3000:]
            assert "one loop over its windows" in lines[0], lines[0]  # (the loop over windows is what is saved)
            results.append((lines[0], torch.load(out)))
        return results

    @property
    def loops(self) -> Path:
        """The saved loops' folder in this fits' Inductor cache."""
        return self.cache / "lightning_sink_loops"

    def saved_files(self) -> list[Path]:
        return sorted(self.loops.glob("*"))


def _ended(processes: list[subprocess.Popen]) -> list[tuple[str, str]]:
    """Each process's output once all have ended; none outlives a timeout or a failure here."""
    try:
        return [process.communicate(timeout=900) for process in processes]
    finally:
        for process in processes:
            process.kill()  # (no-op once it ended)


def _equal(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


@pytest.fixture(scope="module")
def fits(tmp_path_factory) -> Fits:
    return Fits(tmp_path_factory.mktemp("saved_loop"))


@pytest.fixture(scope="module")
def usual(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The fit compiled as usual: Inductor's caches, and with them saving, switched off."""
    line, state = Fits(tmp_path_factory.mktemp("usual")).run(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
    assert "the loop is not saved for a later fit (Inductor's caches are switched off)" in line, line
    return state


@pytest.mark.slow
def test_a_second_identical_fit_loads_the_saved_loop_and_trains_as_the_usual_build(fits: Fits, usual):
    first_line, first = fits.run()
    assert SAVED in first_line, first_line
    assert [path.suffix for path in fits.saved_files()] == [".json", ".program"]
    second_line, second = fits.run()
    assert LOADED in second_line, second_line
    assert _equal(first, usual) and _equal(second, usual)
    # the second fit's start knows the loop was kept: the first build's cost is not held against it
    (start,) = [line for line in fits.output if "the first sink compiles the step programs of Net" in line]
    assert "kept its loop on disk" in start, start
    assert not [line for line in fits.output if "too short to repay" in line and "the last build" in line]


@pytest.mark.slow
def test_with_the_variable_at_0_no_loop_is_saved_or_loaded(fits: Fits, usual):
    if not fits.saved_files():
        fits.run()  # (a loop saved for this module, there to be left alone)
    before = {path.name: path.read_bytes() for path in fits.saved_files()}
    line, state = fits.run(LIGHTNING_SINK_SAVED_LOOP="0")  # (a loop is saved for it: not read, not written)
    assert "saved" not in line and "loaded" not in line, line
    assert _equal(state, usual)
    assert {path.name: path.read_bytes() for path in fits.saved_files()} == before


@pytest.mark.slow
def test_a_changed_dropout_p_is_not_served_by_the_saved_loop(fits: Fits, usual):
    fits.run()  # (saved, or loaded from the test before)
    line, state = fits.run(p=0.5)
    assert LOADED not in line and SAVED in line, line
    assert not _equal(state, usual)  # (the other p's masks: a loaded loop would have trained with 0.25)


@pytest.mark.slow
def test_a_p_changed_between_sinks_runs_the_usual_build_from_that_sink_on(fits: Fits, tmp_path_factory):
    """The saved loop's guards are checked before every call, as a compiled program's are: a callback that changes
    a dropout's ``p`` after the first sink sends the later calls to the loop compiled as usual (with the new p)."""
    _, usual = Fits(tmp_path_factory.mktemp("usual_change")).run(
        change="change p", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1"
    )
    fits.run()  # (saved, or loaded)
    line, state = fits.run(change="change p")
    assert LOADED in line, line
    assert _equal(state, usual)


@pytest.mark.slow
def test_an_edited_training_step_is_not_served_by_the_saved_loop(fits: Fits):
    fits.write_module(scale="1.0")
    _, before = fits.run()
    fits.write_module(scale="2.0")  # (the file TorchDynamo traced reads differently now)
    try:
        line, after = fits.run()
    finally:
        fits.write_module(scale="1.0")
    assert LOADED not in line and SAVED in line, line
    assert not _equal(before, after)


# training_step reads an object whose class is defined inside a function: torch cannot save the loop's guards
LOCAL_CONFIG = """
    def on_fit_start(self):
        self.config = _config()


def _config():
    class Config:
        weight = 1.0

    return Config()
"""


@pytest.mark.slow
def test_a_loop_torch_cannot_save_is_compiled_as_usual_and_not_tried_again(tmp_path: Path, usual):
    fits = Fits(tmp_path)
    fits.write_module(scale="self.config.weight", config=LOCAL_CONFIG)
    first_line, first = fits.run()
    assert "the loop is not saved for a later fit (TypeError: " in first_line, first_line
    second_line, second = fits.run()
    assert "the loop is not saved for a later fit (an earlier fit found: TypeError: " in second_line, second_line
    assert _equal(first, usual) and _equal(second, usual)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped program byte", "truncated program", "entry not JSON", "entry format"])
def test_a_damaged_saved_loop_is_built_again(fits: Fits, usual, damage: str):
    shutil.rmtree(fits.loops, ignore_errors=True)  # (an edited module saved its own loop)
    fits.run()
    entry_path, program_path = fits.saved_files()
    program, entry = program_path.read_bytes(), entry_path.read_text()
    if damage == "flipped program byte":
        program_path.write_bytes(program[:1000] + bytes([program[1000] ^ 1]) + program[1001:])
    elif damage == "truncated program":
        program_path.write_bytes(program[:-10])
    elif damage == "entry not JSON":
        entry_path.write_text(entry[:-5])
    else:
        entry_path.write_text(json.dumps({**json.loads(entry), "format": loop_store.FORMAT + 1}))
    line, state = fits.run()
    assert LOADED not in line and SAVED in line, line
    assert _equal(state, usual)


# what training_step reads beside the module's own attributes, each set from the environment of the fit's process:
# a module-level value, an enum member the module holds, a hook on a submodule, a module-level function that a
# callback replaces after the first sink
READS_BESIDE = """
    GAIN = 1.0

    def on_fit_start(self):
        self.mode = Mode[os.environ.get("NET_MODE", "A")]
        self.helper = Helper()
        if os.environ.get("NET_HOOK"):
            self.net[0].register_forward_hook(lambda module, args, out: out * 0.5)
        if os.environ.get("NET_CLASS_GAIN"):
            type(self).GAIN = 2.0
        if os.environ.get("NET_HELPER_GAIN"):
            Helper.GAIN = 2.0
        if os.environ.get("NET_DEFAULTS"):
            scaled.__defaults__ = (2.0,)
        if os.environ.get("NET_LINEAR_FORWARD"):
            nn.Linear.forward = lambda self, x: F.linear(x, self.weight, self.bias) * 0.5

    def on_train_epoch_end(self):
        global act
        if os.environ.get("NET_REPLACE"):
            act = torch.tanh


import enum
import os


class Mode(enum.Enum):
    A = 1
    B = 2


WEIGHT = float(os.environ.get("NET_WEIGHT", "1.0"))
act = torch.relu


class Helper:
    GAIN = 1.0

    def gain(self):
        return self.GAIN


def scaled(x, factor=1.0):
    return x * factor
"""

# what each change below sets, and what it was called when it was found
CHANGES = {
    "module-level value": {"NET_WEIGHT": "2.0"},
    "enum member": {"NET_MODE": "B"},
    "hook on a submodule": {"NET_HOOK": "1"},
    "function replaced between sinks": {"NET_REPLACE": "1"},
    "the module's class attribute": {"NET_CLASS_GAIN": "1"},
    "a helper class's attribute": {"NET_HELPER_GAIN": "1"},
    "a function's defaults": {"NET_DEFAULTS": "1"},
    "a torch method replaced on its class": {"NET_LINEAR_FORWARD": "1"},
}


class ReadsBeside:
    """Fits of the module that reads ``READS_BESIDE``'s values, in one folder: its first fit, with nothing changed,
    saved the loop (kept apart as ``saved``, put back before each fit, so that every change meets that loop).
    ``usual`` holds each change's fit compiled as usual (saving off, so the saved loop is never read), run two at a
    time (they share nothing but Inductor's cache, which takes concurrent writers)."""

    def __init__(self, folder: Path) -> None:
        self.fits = Fits(folder)
        mode = "(2.0 if self.mode is Mode.B else 1.0)"
        gains = "self.GAIN * self.helper.gain() * scaled(1.0)"
        self.fits.write_module(scale=f"WEIGHT * act(torch.tensor(1.0)) * {mode} * {gains}", config=READS_BESIDE)
        first_line, self.first = self.fits.run()
        assert SAVED in first_line, first_line
        self.saved = folder / "loops_saved_by_the_first_fit"
        shutil.copytree(self.fits.loops, self.saved)
        self.usual: dict[str, dict[str, torch.Tensor]] = {}
        names = list(CHANGES)
        for pair in (names[i : i + 2] for i in range(0, len(names), 2)):
            started = [self.fits.start(LIGHTNING_SINK_SAVED_LOOP="0", **CHANGES[name]) for name in pair]
            for name, (_, state) in zip(pair, self.fits.finish(*started)):
                self.usual[name] = state

    def run(self, **env: str) -> tuple[str, dict[str, torch.Tensor]]:
        shutil.rmtree(self.fits.loops)
        shutil.copytree(self.saved, self.fits.loops)
        return self.fits.run(**env)


@pytest.fixture(scope="module")
def reads_beside(tmp_path_factory) -> ReadsBeside:
    return ReadsBeside(tmp_path_factory.mktemp("reads_beside"))


@pytest.mark.slow
def test_with_nothing_changed_the_loop_the_first_fit_saved_serves_again(reads_beside):
    line, state = reads_beside.run()
    assert LOADED in line, line
    assert _equal(state, reads_beside.first)


@pytest.mark.slow
@pytest.mark.parametrize("name", CHANGES)
def test_what_the_step_reads_beside_the_module_is_checked_before_a_saved_loop_serves(reads_beside, name):
    """TorchDynamo builds a loaded program's guards on globals, class attributes and defaults again from the loading
    process's values, names an enum member only by its class, and sets no guard on hooks or on a method looked up
    through a class: each such change trained the saved loop's model."""
    change, usual = CHANGES[name], reads_beside.usual[name]  # (compiled as usual, the changed setting)
    assert not _equal(usual, reads_beside.first)  # (the change changes the training)
    line, state = reads_beside.run(**change)
    assert _equal(state, usual), line
    if "NET_REPLACE" in change:  # (the same at the first call: loaded, and the later calls compiled as usual)
        assert LOADED in line, line


@pytest.mark.slow
def test_a_step_reading_a_value_assumed_constant_is_not_saved(tmp_path: Path, usual):
    """TorchDynamo keeps what an ``assume_constant_result`` function returned while tracing, with no guard."""
    fits = Fits(tmp_path)
    marked = "\n\n@torch._dynamo.assume_constant_result\ndef factor():\n    return 1.0\n"
    fits.write_module(scale="factor()", config=marked)
    line, state = fits.run()
    assert (
        "the loop is not saved for a later fit (ValueError: net_module.factor is marked assume_constant_result" in line
    )
    assert _equal(state, usual)


TWO_FITS = """
import sys
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning_sink import SinkStrategy
from net_module import Net

generator = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
torch.manual_seed(2)  # (the dropout masks and the shuffle)
module = Net(0.25)
for epochs in (2, 4):  # the second fit goes on training the same module, in the same process
    trainer = pl.Trainer(
        accelerator="cpu", strategy=SinkStrategy(sink_size=8, graph_mode="compile"), max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))
torch.save(module.state_dict(), sys.argv[1])
"""


@pytest.mark.slow
def test_a_second_fit_in_the_same_process_loads_the_loop_the_first_saved_and_trains_as_without_saving(
    tmp_path: Path,
):
    started = []  # (saving on and off in folders and caches of their own, so both run at once)
    for setting in ("", "0"):
        folder = tmp_path / f"saving_{setting or 'on'}"
        folder.mkdir()
        fits = Fits(folder)
        (fits.folder / "two_fits.py").write_text(TWO_FITS)
        out = fits.folder / "trained.pt"
        environment = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(fits.cache),
            "PYTHONPATH": os.pathsep.join([str(fits.folder), str(Path.cwd())]),
            "LIGHTNING_SINK_SAVED_LOOP": setting,
        }
        run = [sys.executable, str(fits.folder / "two_fits.py"), str(out)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        started.append((subprocess.Popen(run, env=environment, text=True, **pipes), out))
    states, outputs = [], []
    for (process, out), (stdout, stderr) in zip(started, _ended([process for process, _ in started])):
        assert process.returncode == 0, stderr[-3000:]
        outputs.append(stdout + stderr)
        states.append(torch.load(out))
    saving, not_saving = outputs
    assert saving.index(SAVED) < saving.index(LOADED), saving[-3000:]
    assert SAVED not in not_saving and LOADED not in not_saving
    assert _equal(*states)
