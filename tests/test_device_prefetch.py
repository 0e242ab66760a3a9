"""Data sinking on CUDA: batches reach the GPU from the prefetch thread (pinned memory, side stream)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_sink.data import DataPosition
from lightning_sink.device_prefetch import CudaBatchCopier
from lightning_sink.sink_data import PASS_END, MicroBatchStream
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
