"""The device-staged dataset (here on the CPU, where the same code runs): the memory budget, the index upload, the
on-device gathering, and programs that read their batches from it against the plain loop."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_sink.compiled import ProgramSettings, StepPrograms, Unavailable, build_step_programs
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from tests.compiled.models import OPTIMIZERS, Classifier, eager_loop, max_relative_difference

CPU = torch.device("cpu")


def dataset(samples: int = 48) -> TensorDataset:
    generator = torch.Generator().manual_seed(3)
    return TensorDataset(
        torch.randn(samples, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )


def test_staged_only_within_the_budget():
    data = dataset()
    size = 48 * 8 * 4 + 48 * 8  # float32 inputs, int64 labels
    staged = DeviceDataset.stage(data, CPU, budget_bytes=size)
    assert isinstance(staged, DeviceDataset)
    assert all(torch.equal(a, b) for a, b in zip(staged.tensors, data.tensors))
    refused = DeviceDataset.stage(data, CPU, budget_bytes=size - 1)
    assert isinstance(refused, Unavailable)
    assert refused.reason.startswith(
        f"the dataset's tensors take {size} bytes, over the device memory budget of {size - 1}"
    )


def test_only_an_in_memory_tensor_dataset_is_staged():
    refused = DeviceDataset.stage([1, 2, 3], CPU, budget_bytes=10**6)
    assert isinstance(refused, Unavailable) and "not an in-memory TensorDataset" in refused.reason


@pytest.mark.parametrize("budget", [-1, 1.5, True])
def test_a_bad_budget_is_refused(budget):
    with pytest.raises(ValueError, match=rf"budget_bytes={budget!r} is not valid: pass an int >= 0 \(bytes\)"):
        DeviceDataset.stage(dataset(), CPU, budget_bytes=budget)


def test_gathering_follows_the_uploaded_indices_and_moves_the_cursor():
    data = dataset()
    staged = DeviceDataset.stage(data, CPU, budget_bytes=10**6)
    sink = SinkIndices(capacity=4, batch_size=3, device=CPU)
    rows = [[5, 1, 40], [0, 0, 7], [47, 2, 3]]
    sink.load(rows)
    for row in rows:
        x, y = DeviceDataset.gather(staged.tensors, sink.rows, sink.cursor)
        assert torch.equal(x, data.tensors[0][row]) and torch.equal(y, data.tensors[1][row])
    assert sink.cursor.item() == 3 and sink.loaded == 3
    sink.load(rows[:1])  # the next sink starts from its first row
    assert sink.cursor.item() == 0


def test_indices_that_do_not_fit_are_refused():
    sink = SinkIndices(capacity=2, batch_size=3, device=CPU)
    with pytest.raises(ValueError, match=r"a sink of 3 micro-batches does not fit capacity=2"):
        sink.load([[0, 1, 2]] * 3)
    with pytest.raises(ValueError, match=r"gather exactly batch_size=3 samples"):
        sink.load([[0, 1]])


def test_programs_reading_the_staged_dataset_match_the_plain_loop():
    data = dataset(96)
    generator = torch.Generator().manual_seed(5)
    rows = torch.randperm(96, generator=generator).view(16, 6).tolist()  # one shuffled epoch, batches of 6
    model, reference = Classifier(), Classifier()
    optimizer, reference_optimizer = (
        OPTIMIZERS["adamw"](model.parameters()),
        OPTIMIZERS["adamw"](reference.parameters()),
    )
    staged = DeviceDataset.stage(data, CPU, budget_bytes=10**6)
    sink = SinkIndices(capacity=8, batch_size=6, device=CPU)
    programs = build_step_programs(model, optimizer, None, ProgramSettings(backend="aot_eager", data=(staged, sink)))
    assert isinstance(programs, StepPrograms)
    for start in (0, 8):  # two sinks of 8 micro-batches, windows of 2
        sink.load(rows[start : start + 8])
        for step in range(8):
            programs.update() if step % 2 else programs.accumulate()
    windows = [[(data.tensors[0][r], data.tensors[1][r]) for r in rows[i : i + 2]] for i in range(0, 16, 2)]
    eager_loop(reference, reference_optimizer, windows)
    assert max_relative_difference(model, reference) < 1e-5
