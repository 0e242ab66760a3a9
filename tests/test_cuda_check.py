"""CUDA's availability check during a fit: where NVML's library is missing, a sink strategy's fit asks the CUDA
runtime directly (``PYTORCH_NVML_BASED_CUDA_CHECK=0``), the answer torch reached through its failed NVML load anyway;
Lightning's setting is given back at the fit's end, also when the fit fails."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import SinkStrategy
from lightning_sink.cuda_check import VARIABLE, CudaCheckDuringFit, nvml_loads
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer


class SeenDuringTraining(pl.Callback):
    """The variable's value and torch's CUDA answer at each training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[str | None, bool]] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.seen.append((os.environ.get(VARIABLE), torch.cuda.is_available()))


def test_lightning_sets_the_nvml_check_this_module_changes():
    assert os.environ.get(VARIABLE) == "1"  # (set by ``import lightning``: what the module's docstring relies on)


@pytest.mark.parametrize("strategy", ["stock", "sink", "sink_compile"])
def test_a_fit_asks_the_cuda_runtime_directly_where_nvml_is_missing_and_gives_the_setting_back(strategy, monkeypatch):
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")  # (quicker to build; the same fit)
    answer = torch.cuda.is_available()
    seen = SeenDuringTraining()
    chosen: Any = "auto"
    if strategy != "stock":
        chosen = SinkStrategy(sink_size=4, graph_mode="compile" if strategy == "sink_compile" else "eager")
    trainer = quiet_trainer(strategy=chosen, max_steps=8, callbacks=[seen])
    trainer.fit(TinyClassifier(), DataLoader(make_dataset(), batch_size=4))
    expected = "1" if strategy == "stock" or nvml_loads() else "0"
    assert seen.seen and all(value == (expected, answer) for value in seen.seen), seen.seen
    assert os.environ.get(VARIABLE) == "1"


class FailsInTraining(TinyClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("the user's step failed")


def test_a_failed_fit_gives_the_setting_back():
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=4), max_steps=8)
    with pytest.raises(RuntimeError, match="the user's step failed"):
        trainer.fit(FailsInTraining(), DataLoader(make_dataset(), batch_size=4))
    assert os.environ.get(VARIABLE) == "1"


@pytest.mark.parametrize(
    "before, loads, during",
    [("1", False, "0"), ("1", True, "1"), ("0", False, "0"), (None, False, None), ("yes", False, "yes")],
)
def test_only_lightnings_setting_changes_and_only_where_nvml_cannot_load(monkeypatch, before, loads, during):
    if before is None:
        monkeypatch.delenv(VARIABLE)
    else:
        monkeypatch.setenv(VARIABLE, before)
    check = CudaCheckDuringFit(lambda: loads)
    check.begin()
    check.begin()  # (a second begin changes nothing more)
    assert os.environ.get(VARIABLE) == during
    check.end()
    assert os.environ.get(VARIABLE) == before


def test_a_setting_changed_during_the_fit_is_left_as_it_was_changed(monkeypatch):
    monkeypatch.setenv(VARIABLE, "1")
    check = CudaCheckDuringFit(lambda: False)
    check.begin()
    os.environ[VARIABLE] = "2"  # the user's own, during the fit
    check.end()
    assert os.environ.get(VARIABLE) == "2"
