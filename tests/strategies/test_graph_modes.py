"""Graph sinking: graph_mode="compile" (and "cuda_graph" on a GPU) against the plain PyTorch loop."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch._dynamo.utils import counters

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, make_dataset, quiet_trainer, reference_train, relative_error
from tests.strategies.test_sink_loop import SAMPLES, continuous_micro_batches, shuffled_loader, windows_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="graph_mode='cuda_graph' needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled_frames() -> int:
    return counters["stats"].get("unique_graphs", 0)


@pytest.mark.slow
@pytest.mark.parametrize("sink_size", [None, 7])  # per-batch step programs, and sinks
def test_compiled_step_programs_match_the_plain_loop(sink_size):
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9)
    reference = copy.deepcopy(model)
    strategy = SinkStrategy(accumulation_steps=3, sink_size=sink_size, graph_mode="compile", partial_window="carry")
    epochs = 5 if sink_size else 4  # 35 micro-batches in sinks of 7; 4 passes of 10 with windows carried over
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs)
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
    micro = 35 if sink_size else 40
    lrs = reference_train(reference, make_dataset(num_samples=SAMPLES), windows_of(continuous_micro_batches(micro), 3))
    assert trainer.global_step == micro // 3
    assert model.seen_lrs == pytest.approx(lrs, rel=1e-12)
    # Inductor's fused kernels may round differently from eager, never by more than float32 noise.
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-5
    assert compiled_frames() >= 1  # training_step really went through TorchDynamo


def test_graph_mode_must_be_known():
    with pytest.raises(ValueError, match=r"graph_mode='graph' is not valid: choose one of 'eager', 'compile'"):
        SinkStrategy(graph_mode="graph")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_graph_without_cuda_says_what_to_use_instead():
    with pytest.raises(
        ValueError,
        match=r"graph_mode='cuda_graph' .* CUDA is not available here: use "
        r"graph_mode='compile'",
    ):
        SinkStrategy(sink_size=4, graph_mode="cuda_graph")


@needs_cuda
def test_cuda_graph_on_the_cpu_of_a_cuda_machine_is_an_error():
    model = TinyClassifier()
    trainer = quiet_trainer(
        strategy=SinkStrategy(sink_size=4, graph_mode="cuda_graph"), accelerator="cpu", max_epochs=1
    )
    with pytest.raises(ValueError, match="needs the model on a CUDA device, but this run trains on cpu"):
        trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))


@needs_cuda
@pytest.mark.parametrize("graph_mode", ["compile", "cuda_graph"])
def test_gpu_graph_modes_match_eager_on_the_gpu(graph_mode):
    results = {}
    for mode in ("eager", graph_mode):
        torch._dynamo.reset()
        model = TinyClassifier(optimizer="adamw_fused", lr=0.01, step_lr_gamma=0.9)
        strategy = SinkStrategy(accumulation_steps=3, sink_size=7, graph_mode=mode)
        losses = LoggedLosses()
        trainer = quiet_trainer(strategy=strategy, accelerator="gpu", devices=1, max_epochs=5, callbacks=[losses])
        trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
        results[mode] = (trainer.global_step, flat_params(model).cpu(), torch.tensor(losses.values))
    assert results["eager"][0] == results[graph_mode][0] == 11
    assert relative_error(results[graph_mode][1], results["eager"][1]) <= 1e-5
    # the sink's losses and self.log values outlive the replays that made them (a CUDA graph reuses its buffers)
    assert len(results[graph_mode][2]) == 5 and relative_error(results[graph_mode][2], results["eager"][2]) <= 1e-5


class LoggedLosses(pl.Callback):
    """Per sink, the loss Lightning's loop got and the module's logged ``train_loss``."""

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append([outputs["loss"].item(), trainer.callback_metrics["train_loss"].item()])
