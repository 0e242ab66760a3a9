"""Batch-transfer hooks and the profiler, side by side with stock Lightning.

The strategy moves batches itself when no transfer hook is overridden; a hook overridden on the LightningModule
or on the LightningDataModule (which Lightning calls instead), and a profiler (which records every hook Lightning
dispatches), make it dispatch them as stock Lightning does.
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.profilers import SimpleProfiler

from lightning_sink import SinkStrategy
from lightning_sink.sink_data import SinkToken
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer, relative_error

MICRO = 4
SAMPLES = 8 * MICRO


class DataWithTransferHooks(pl.LightningDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def train_dataloader(self) -> Any:
        return loader(make_dataset(num_samples=SAMPLES), MICRO)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        self.calls.append("transfer_batch_to_device")
        x, y = super().transfer_batch_to_device(batch, device, dataloader_idx)
        return x * 0.5, y  # visible in the parameters if it is skipped

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.calls.append("on_after_batch_transfer")
        return batch


def fit_with(module: Any, strategy: Any, datamodule: Any = None, **kwargs: Any) -> pl.Trainer:
    trainer = quiet_trainer(strategy=strategy, max_epochs=1, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if datamodule is None:
            trainer.fit(module, loader(make_dataset(num_samples=SAMPLES), MICRO))
        else:
            trainer.fit(module, datamodule=datamodule)
    return trainer


@pytest.mark.parametrize(
    ("stock_kwargs", "sink"),
    [
        ({"accumulate_grad_batches": 2}, lambda: SinkStrategy()),
        ({"accumulate_grad_batches": 2}, lambda: SinkStrategy(accumulation_steps=2, sink_size=SAMPLES // MICRO)),
    ],
    ids=["windows", "one_sink"],
)
def test_a_datamodules_transfer_hooks_run_as_with_stock(stock_kwargs, sink):
    stock, ours = TinyClassifier(lr=0.05), None
    ours = copy.deepcopy(stock)
    stock_data, our_data = DataWithTransferHooks(), DataWithTransferHooks()
    fit_with(stock, "auto", stock_data, **stock_kwargs)
    sink_strategy = sink()
    fit_with(ours, sink_strategy, our_data, **({} if sink_strategy.sink_size else stock_kwargs))
    assert Counter(stock_data.calls) == {"transfer_batch_to_device": 8, "on_after_batch_transfer": 8}
    assert Counter(our_data.calls) == Counter(stock_data.calls)
    assert relative_error(flat_params(ours), flat_params(stock)) < 1e-6


class RealBatchesOnly(TinyClassifier):
    """Records the batches ``on_before_batch_transfer`` sees: real ones (a tuple) and a sink's placeholder."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[str] = []

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, SinkToken):
            self.seen.append("placeholder")
            return batch
        self.seen.append("batch")
        x, y = batch
        return x * 0.5, y  # visible in the parameters if a real batch skips it


def test_on_before_batch_transfer_sees_every_real_micro_batch_in_a_sink():
    stock = RealBatchesOnly(lr=0.05)
    ours = copy.deepcopy(stock)
    fit_with(stock, "auto", accumulate_grad_batches=2)
    fit_with(ours, SinkStrategy(accumulation_steps=2, sink_size=SAMPLES // MICRO))
    assert stock.seen == ["batch"] * 8
    # Lightning's loop also hands the sink's placeholder to the hook, once per sink (documented)
    assert ours.seen == ["placeholder"] + ["batch"] * 8
    assert relative_error(flat_params(ours), flat_params(stock)) < 1e-6


@pytest.mark.parametrize("sink_size", [None, SAMPLES // MICRO], ids=["windows", "one_sink"])
def test_true_half_precision_converts_every_batch_as_with_stock(sink_size):
    stock = TinyClassifier(lr=0.05)
    ours = copy.deepcopy(stock)
    fit_with(stock, "auto", precision="bf16-true", accumulate_grad_batches=2)
    fit_with(ours, SinkStrategy(accumulation_steps=2, sink_size=sink_size), precision="bf16-true")
    assert next(ours.parameters()).dtype == torch.bfloat16
    assert relative_error(flat_params(ours).float(), flat_params(stock).float()) < 1e-2


class WithoutStepHook(TinyClassifier):
    on_before_optimizer_step = pl.LightningModule.on_before_optimizer_step  # (Lightning's own: not overridden)


def profiled_actions(strategy: Any, **kwargs: Any) -> dict[str, int]:
    profiler = SimpleProfiler()
    trainer = fit_with(WithoutStepHook(), strategy, profiler=profiler, **kwargs)
    strategy_name = type(trainer.strategy).__name__
    return {
        action.replace(strategy_name, "<strategy>"): len(times) for action, times in profiler.recorded_durations.items()
    }


def test_a_profiler_records_the_hooks_stock_records_as_often():
    """Each hook as often as stock dispatches it (``on_before_optimizer_step`` and ``configure_gradient_clipping``,
    once per update, had been left out of the record where the module did not override them)."""
    stock = profiled_actions("auto", accumulate_grad_batches=2)
    assert stock["[LightningModule]WithoutStepHook.transfer_batch_to_device"] == SAMPLES // MICRO
    assert stock["[LightningModule]WithoutStepHook.on_before_optimizer_step"] == SAMPLES // MICRO // 2
    assert stock["[LightningModule]WithoutStepHook.configure_gradient_clipping"] == SAMPLES // MICRO // 2
    assert profiled_actions(SinkStrategy(), accumulate_grad_batches=2) == stock


def scheduler_run(strategy: Any, profiler: Any, **kwargs: Any) -> tuple[pl.LightningModule, Counter[str]]:
    module = TinyClassifier(step_lr_gamma=0.5)  # the rate halves at every update
    trainer = fit_with(module, strategy, profiler=profiler, **kwargs)
    recorded = profiler.recorded_durations if profiler is not None else {}
    counts = Counter({action: len(times) for action, times in recorded.items() if "lr_scheduler_step" in action})
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == SAMPLES // MICRO // 2
    return module, counts


@pytest.mark.parametrize("profiled", [False, True], ids=["no_profiler", "profiler"])
def test_sinks_step_the_schedulers_as_stock_with_and_without_a_profiler(profiled):
    """Sinks step a step scheduler directly where nothing would see the hook call (Lightning's own hook, no
    profiler) and through Lightning's hook call otherwise: the same rates and parameters either way, and a profiler
    records every ``lr_scheduler_step`` stock Lightning records."""
    stock, stock_counts = scheduler_run("auto", SimpleProfiler() if profiled else None, accumulate_grad_batches=2)
    ours, our_counts = scheduler_run(
        SinkStrategy(accumulation_steps=2, sink_size=SAMPLES // MICRO), SimpleProfiler() if profiled else None
    )
    assert our_counts == stock_counts
    if profiled:
        assert stock_counts == {"[LightningModule]TinyClassifier.lr_scheduler_step": SAMPLES // MICRO // 2}
    assert ours.seen_lrs == stock.seen_lrs == [0.1 * 0.5**update for update in range(SAMPLES // MICRO // 2)]
    assert relative_error(flat_params(ours), flat_params(stock)) < 1e-6
