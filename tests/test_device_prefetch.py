"""Data sinking on CUDA: batches reach the GPU from the prefetch thread (pinned memory, side stream)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_sink.data import DataPosition
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.sink_data import PASS_END, MicroBatchStream, default_prefetch_depth
from tests.helpers import make_dataset

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the device prefetch queue copies to a GPU")


def test_the_copier_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="copies to a CUDA device; got device=cpu"):
        CudaBatchCopier(torch.device("cpu"))


@needs_cuda
def test_prefetched_batches_arrive_on_the_gpu_equal_to_the_host_batches():
    dataset = make_dataset(num_samples=40)
    loader = DataLoader(dataset, batch_size=4)
    stream = MicroBatchStream(loader, DataPosition(), depth=3, copier=CudaBatchCopier(torch.device("cuda", 0)))
    try:
        received = [stream.next() for _ in range(11)]
    finally:
        stream.close()
    assert received[10] is PASS_END
    for (x, y), (host_x, host_y) in zip(received[:10], loader):
        assert x.device.type == "cuda" and y.device.type == "cuda"
        assert torch.equal(x.cpu(), host_x) and torch.equal(y.cpu(), host_y)


class ItemsDataset(torch.utils.data.Dataset):
    """A map-style dataset read item by item (not a TensorDataset): its reads are worth hiding on a thread."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.full((2,), float(index))


@pytest.mark.parametrize(
    ("device", "loader", "depth"),
    [
        ("cuda", DataLoader(make_dataset(num_samples=8), batch_size=4, shuffle=True), 0),  # in memory: no thread
        ("cuda", DataLoader(make_dataset(num_samples=8), batch_size=4, pin_memory=True), 2),  # not read by indexing
        ("cuda", DataLoader(ItemsDataset(), batch_size=4), 2),
        ("cpu", DataLoader(make_dataset(num_samples=8), batch_size=4), 0),
        ("cpu", DataLoader(ItemsDataset(), batch_size=4), 0),
    ],
)
def test_prefetch_depth_none_reads_ahead_on_cuda_unless_the_loader_is_read_by_indexing(device, loader, depth):
    assert default_prefetch_depth(torch.device(device), loader) == depth
