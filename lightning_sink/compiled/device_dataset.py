"""An in-memory ``TensorDataset`` staged on the training device once, its batches gathered there.

A sink of K micro-steps then needs one small upload, the sampler's K x B indices, and no per-step host-to-device
copy: each program call reads its row of indices at a device-side cursor, gathers its batch with ``index_select``
and moves the cursor on, all inside the (compiled, on CUDA captured) program. The dataset is staged only when its
tensors fit the memory budget given (an argument, in bytes: the caller chooses what share of the device it may
take); otherwise the caller keeps its usual loader path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_sink.compiled.support import Unavailable

__all__ = ["DeviceDataset", "SinkIndices"]


class SinkIndices:
    """The indices of up to ``capacity`` micro-batches of ``batch_size`` samples, on the device, and the cursor of
    the next one. Its tensors keep their addresses across sinks (a captured program reads them)."""

    def __init__(self, capacity: int, batch_size: int, device: torch.device) -> None:
        self.capacity, self.batch_size = capacity, batch_size
        self.rows = torch.zeros((capacity, batch_size), dtype=torch.int64, device=device)
        self.cursor = torch.zeros((), dtype=torch.int64, device=device)
        self._host = torch.zeros((capacity, batch_size), dtype=torch.int64, pin_memory=device.type == "cuda")
        # the upload from pinned memory is asynchronous: the host buffer is rewritten only once it has been read
        self._uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.loaded = 0

    def load(self, batches: Tensor | Sequence[Sequence[int]]) -> None:
        """Upload one sink's indices (one copy, asynchronous on CUDA) and rewind the cursor."""
        if not 1 <= len(batches) <= self.capacity:
            raise ValueError(f"a sink of {len(batches)} micro-batches does not fit capacity={self.capacity}")
        rows = torch.as_tensor(batches, dtype=torch.int64)
        if rows.shape[1:] != (self.batch_size,):
            raise ValueError(
                f"micro-batches of shape {tuple(rows.shape[1:])} indices: the staged programs gather exactly"
                f" batch_size={self.batch_size} samples (a partial last batch goes the loader's way)"
            )
        if self._uploaded is not None:
            self._uploaded.synchronize()  # waits only if the device is still a whole sink behind
        self._host[: len(rows)].copy_(rows)
        self.rows.copy_(self._host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        self.cursor.zero_()
        self.loaded = len(rows)


class DeviceDataset:
    """A ``TensorDataset``'s tensors on the device (build with ``DeviceDataset.stage``)."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.tensors = tensors

    @staticmethod
    def stage(dataset: object, device: torch.device | str, budget_bytes: int) -> DeviceDataset | Unavailable:
        """Copy ``dataset``'s tensors to ``device`` if it is a ``TensorDataset`` whose tensors together take at
        most ``budget_bytes``; otherwise ``Unavailable`` saying why (the caller keeps its loader)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r} is not valid: pass an int >= 0 (bytes)")
        if not isinstance(dataset, TensorDataset):
            return Unavailable(f"the dataset is a {type(dataset).__qualname__}, not an in-memory TensorDataset")
        size = sum(tensor.numel() * tensor.element_size() for tensor in dataset.tensors)
        if size > budget_bytes:
            return Unavailable(
                f"the dataset's tensors take {size} bytes, over the device memory budget of {budget_bytes} bytes:"
                " raise the budget or keep the loader's prefetch path"
            )
        return DeviceDataset([tensor.to(device) for tensor in dataset.tensors])

    @staticmethod
    def gather(tensors: list[Tensor], rows: Tensor, cursor: Tensor) -> tuple[Tensor, ...]:
        """The batch at ``cursor`` (one row of ``rows``), and the cursor moved on; traceable, no host read."""
        indices = rows.index_select(0, cursor.view(1)).view(-1)
        cursor.add_(1)
        return tuple(tensor.index_select(0, indices) for tensor in tensors)
