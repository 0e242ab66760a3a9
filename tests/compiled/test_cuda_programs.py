"""On a GPU: the programs captured as CUDA graphs, over batches copied in and over the dataset staged on the device,
against the plain loop; no host synchronization inside a sink; a scheduler moving the learning rate between
replays. Skipped without CUDA (CI has none): benchmarks/gpu_check.sh runs these on a lent GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_sink.compiled import ProgramSettings, StepPrograms, build_step_programs
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.loss_scale import DynamicLossScale
from tests.compiled.models import OPTIMIZERS, Classifier, eager_loop, make_batches, max_relative_difference, windows_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
CUDA = torch.device("cuda", 0)


@needs_cuda
def test_cuda_graph_programs_over_the_staged_dataset_match_the_plain_loop_without_host_syncs():
    batches = make_batches(64)
    batches[9][0][0, 0] = float("inf")  # an overflow in the third window: skipped
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    model, reference = Classifier().to(CUDA), Classifier().to(CUDA)
    optimizer, reference_optimizer = OPTIMIZERS["sgd"](model.parameters()), OPTIMIZERS["sgd"](reference.parameters())
    staged = DeviceDataset.stage(TensorDataset(x, y), CUDA, budget_bytes=1 << 20)
    sink = SinkIndices(capacity=32, batch_size=6, device=CUDA)
    programs = build_step_programs(
        model,
        optimizer,
        None,
        ProgramSettings(
            loss_scale=DynamicLossScale(init_scale=2.0**10, scale_window=3), cuda_graph=True, data=(staged, sink)
        ),
    )
    assert isinstance(programs, StepPrograms), programs
    rows = [list(range(6 * i, 6 * i + 6)) for i in range(64)]
    for start in (0, 32):  # two sinks of 32 micro-batches, windows of 4
        sink.load(rows[start : start + 32])
        torch.cuda.set_sync_debug_mode("error")  # any host synchronization inside the sink raises
        try:
            for step in range(32):
                programs.update() if step % 4 == 3 else programs.accumulate()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3)
    windows = windows_of([(b[0].to(CUDA), b[1].to(CUDA)) for b in batches], 4)
    eager_loop(reference, reference_optimizer, windows, scaler=scaler)
    assert programs.scaler.skipped.item() == 1 and programs.scaler.scale.item() == scaler.get_scale()
    assert max_relative_difference(model, reference) < 1e-4


@needs_cuda
def test_cuda_graph_programs_follow_a_step_scheduler_without_recapture():
    batches = [(x.to(CUDA), y.to(CUDA)) for x, y in make_batches(40)]
    model, reference = Classifier().to(CUDA), Classifier().to(CUDA)
    optimizer, reference_optimizer = (
        OPTIMIZERS["adamw"](model.parameters()),
        OPTIMIZERS["adamw"](reference.parameters()),
    )
    # aot_eager: the capture and the refresh are what this test is about (the other test compiles with inductor)
    programs = build_step_programs(model, optimizer, batches[0], ProgramSettings(cuda_graph=True, backend="aot_eager"))
    assert isinstance(programs, StepPrograms), programs
    graphs = dict(programs.captured)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    logged = []
    for batch in batches:
        logged.append(programs.update(batch).logs["double_loss"].item())
        scheduler.step()
    assert programs.captured == graphs  # the same captured graphs throughout
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=4, gamma=0.5)
    expected = eager_loop(reference, reference_optimizer, windows_of(batches, 1), scheduler=reference_scheduler)
    assert max_relative_difference(model, reference) < 1e-4
    assert logged == pytest.approx([row["double_loss"] for row in expected], rel=1e-4)
