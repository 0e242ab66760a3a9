"""Sink mode's training data staged on the device: the compiled step programs gather each micro-batch themselves.

With ``graph_mode="compile"`` or ``"cuda_graph"`` and the whole-step programs (``sink/programs/compiled_choice.py``), a training
loader over an in-memory ``TensorDataset`` can be read without reading it: its tensors are copied to the training
device once per fit (``DeviceDataset``), and for each run of micro-batches the sampler's indices are uploaded in one
copy (``SinkIndices.load``); each program call gathers its batch on the device with ``index_select``. The stream
still iterates the loader's own iterator, with each batch "read" as its indices (``StagedBatch``), so the sampler,
its generators, the sampler epoch per data pass and the base-seed draw advance exactly as on the loader path.

Which loaders are staged (``plan_staging``; any other keeps the loader path, and the fit's info line on the compiled
programs says why):

- sink mode, ``graph_mode`` ``"compile"`` or ``"cuda_graph"`` (under DDP each process stages the dataset and
  gathers the batches of its own share, the indices its ``DistributedSampler`` draws);
- a loader that sink mode reads by indexing (``indexed_batches.reads_by_indexing``: a ``DataLoader`` reading in
  this process without pinning, ``default_collate``, a plain ``BatchSampler`` over one of torch's integer samplers)
  whose dataset is a ``TensorDataset`` itself (not a ``Subset``), with a length;
- the micro-batches read in the training thread (``prefetch_depth`` 0, the default for such loaders);
- no batch-transfer hook overridden and a precision plugin that does not convert each batch (``"16-true"`` does);
- full batches: with ``"cuda_graph"`` every batch of a pass (``drop_last=True`` or a sampler length that is a
  multiple of the batch size), since the captured programs read a batch of one shape; with ``"compile"`` a pass's
  partial last batch is read on the host and trained as on the loader path (the program compiled for its shape);
- the dataset's tensors fit ``device_data_budget`` (bytes; default ``default_device_data_budget``).

A run of gathered micro-batches never crosses a data pass's end: the next pass's iterator (and what it draws from
the global generator) starts when the loader path starts it, after the previous pass's last batch was trained. Nothing
else of the run changes: ``self.log`` values, the log buffer's batch size (a ``StagedBatch`` has one index per
sample), the data position (counted per trained micro-batch, as before) and so a resume mid-sink.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import numpy
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import _torch_compat as compat
from lightning_sink.compiled import Unavailable
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.data import DataPosition, pass_length, whole_batches_in_pass
from lightning_sink.indexed_batches import batch_reader, reads_by_indexing
from lightning_sink.sink_data import PASS_END, MicroBatchStream

__all__ = [
    "StagedBatch",
    "StagedData",
    "StagingConditions",
    "default_device_data_budget",
    "plan_staging",
    "CUDA_BUDGET_SHARE",
]

CUDA_BUDGET_SHARE = 4  # on CUDA the default budget is a quarter of the device's memory: the rest is the model's


@dataclass(slots=True)
class StagedBatch:
    """A micro-batch the programs gather on the device: the sampler's indices of its samples (on the host), row
    ``row`` of the indices taken with it.

    The row is viewed only where it is read (a host read, a second upload, the batch's size): a call of several
    gathers its batches on the device, so most rows are never viewed on the host at all."""

    rows: Tensor
    row: int

    @property
    def indices(self) -> Tensor:
        """One index per sample."""
        return self.rows[self.row]


def default_device_data_budget(device: torch.device) -> int:
    """What ``device_data_budget=None`` means: on CUDA a quarter of the device's memory; on the CPU no limit, since
    the dataset is already in memory there and staging copies nothing (the batch is only gathered inside the
    program instead of by Python indexing, measured faster in ``benchmarks/compiled_fit.py --staged``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // CUDA_BUDGET_SHARE
    if device.type == "cpu":
        return 2**63 - 1
    return 0  # another device kind: not staged unless a budget is given


@dataclass(frozen=True)
class StagingConditions:
    """The fit's facts that decide, besides its loader, whether its training data can be staged (this module's
    docstring gives the rules)."""

    graph_mode: str
    """The strategy's ``graph_mode``: only ``"compile"`` and ``"cuda_graph"`` run the programs that gather."""
    prefetch_depth: int
    """The stream's settled ``prefetch_depth``: staging reads in the training thread (0)."""
    direct_transfer: bool
    """No batch-transfer hook is overridden (a hook would not see the gathered batches)."""
    converts_input: bool
    """The precision plugin converts each batch (``"16-true"`` does), which the gathered batches would skip."""


def plan_staging(
    loader: Any,
    conditions: StagingConditions,
    *,
    budget: int,
    position: DataPosition,
    device: torch.device,
    sink_size: int,
) -> StagedData | Unavailable:
    """The fit's staged data, or why its loader keeps the loader path (the rules in this module's docstring)."""
    graph_mode, prefetch_depth = conditions.graph_mode, conditions.prefetch_depth
    if graph_mode not in ("compile", "cuda_graph"):
        return Unavailable(f"graph_mode={graph_mode!r} runs no whole-step programs")
    if not reads_by_indexing(loader) or type(loader.dataset) is not TensorDataset:
        return Unavailable(
            "the training loader is not a DataLoader over a TensorDataset read by indexing (default_collate, no"
            " workers, no pinning, a BatchSampler over one of torch's samplers)"
        )
    if prefetch_depth != 0:
        return Unavailable(f"prefetch_depth={prefetch_depth} reads the batches in a background thread")
    if not conditions.direct_transfer:
        return Unavailable("a batch-transfer hook is overridden (it would not see the gathered batches)")
    if conditions.converts_input:
        return Unavailable("the precision plugin converts each batch")
    batches = pass_length(loader)
    batch_size = loader.batch_size
    if batches is None or batch_size is None:
        return Unavailable("the training loader has no length or no fixed batch size")
    whole = whole_batches_in_pass(loader, batches)
    assert whole is not None  # (batches is known)
    if whole < batches and graph_mode == "cuda_graph":
        return Unavailable(
            "a data pass ends with a partial batch, which the captured programs cannot read: use drop_last=True"
        )
    size = sum(tensor.numel() * tensor.element_size() for tensor in loader.dataset.tensors)
    if size > budget:
        return Unavailable(
            f"the dataset's tensors take {size} bytes, over device_data_budget={budget}: raise the budget to stage it"
        )
    whole = max(1, whole)  # (a call of several gathers whole batches: a partial one is read apart)
    capacity = min(whole, sink_size) if sink_size > 0 else whole
    return StagedData(loader, position, device, budget, capacity, batches)


class StagedData:
    """One fit's staged dataset and the micro-batches of its segments (``batches``, the sink loop's seam)."""

    def __init__(
        self, loader: DataLoader, position: DataPosition, device: torch.device, budget: int, capacity: int, batches: int
    ) -> None:
        self._loader, self._position, self._device, self._budget = loader, position, device, budget
        self._capacity, self._pass_batches = capacity, batches
        self.batch_size = cast(int, loader.batch_size)  # (plan_staging checked it is set)
        self._read = batch_reader(loader)
        self._tensors: list[Tensor] = list(cast(TensorDataset, loader.dataset).tensors)
        self._data: tuple[DeviceDataset, SinkIndices] | None = None
        # Set by the compiled programs at each segment's start: whether this segment's programs gather their batches.
        self.gathering = False
        # Micro-batches taken from the stream and not yet trained (their indices uploaded, in order).
        self._pending: deque[Any] = deque()

    # ------------------------------------------------------------------ the stream's reads
    def read_pass(self, loader: Any) -> Iterator[Any]:
        """One pass over the loader (the stream's reader): the loader's own iterator, each batch as its indices."""
        return compat.batch_reading_iterator(loader, _SampledIndices)

    def read(self, batch: StagedBatch | _SampledIndices) -> list[Tensor]:
        """The batch the loader path reads for those indices, on the host."""
        return self._read(cast(Any, batch.indices))  # (a tensor of indices indexes as their list does)

    # ------------------------------------------------------------------ the device copy
    def data(self) -> tuple[DeviceDataset, SinkIndices]:
        """The dataset on the device and the sink-indices buffer, made once per fit (when the programs are built)."""
        if self._data is None:
            staged = DeviceDataset.stage(self._loader.dataset, self._device, self._budget)
            assert isinstance(staged, DeviceDataset)  # (plan_staging checked the kind and the budget)
            self._data = (staged, SinkIndices(self._capacity, self.batch_size, self._device))
        return self._data

    @property
    def staged_bytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self._tensors)

    # ------------------------------------------------------------------ the sink loop's seam
    def batches(self, stream: MicroBatchStream, length: float) -> Callable[[], Any]:
        """The next-micro-batch function of a segment of ``length`` micro-batches: ``StagedBatch`` items for the
        programs to gather where this segment's programs do, host batches (as the loader path reads) otherwise."""
        if not self.gathering:
            return lambda: self._host(self._pending.popleft() if self._pending else stream.next())
        given = 0
        if self._pending:  # taken before an early stop: their indices again, the cursor at the first
            self._upload([item for item in self._pending if isinstance(item, StagedBatch)])

        def next_batch() -> Any:
            nonlocal given
            if not self._pending:
                self._take(stream, length - given)
            item = self._pending.popleft() if self._pending else stream.next()
            if item is not PASS_END:
                given += 1
            return item

        return next_batch

    def _host(self, item: Any) -> Any:
        return self.read(item) if isinstance(item, (StagedBatch, _SampledIndices)) else item

    def _take(self, stream: MicroBatchStream, wanted: float) -> None:
        """Take the next micro-batches of the segment up to the data pass's end and upload their indices in one
        copy; a partial batch (a pass's last) is read on the host instead, as the loader path reads it."""
        left_in_pass = self._pass_batches - self._position.trained_in_pass
        count = int(min(wanted, left_in_pass, self._capacity))
        if count <= 0:
            return  # the pass's end: the stream's next item is PASS_END
        items: list[Any] = []
        for _ in range(count):
            items.append(stream.next())
            if items[-1] is PASS_END:
                break  # (a loader that ended its pass early: the stream's position already moved on)
        full = [
            i
            for i, item in enumerate(items)
            if isinstance(item, _SampledIndices) and len(item.indices) == self.batch_size
        ]
        if full:
            # the segment's indices as one tensor (one conversion, not one per micro-batch; numpy reads a flat run of
            # ints several times faster than torch reads nested lists), uploaded in one copy; each micro-batch keeps
            # its row
            flat = itertools.chain.from_iterable(items[i].indices for i in full)
            shape = (len(full), self.batch_size)
            rows = torch.from_numpy(numpy.fromiter(flat, dtype=numpy.int64, count=shape[0] * shape[1])).view(shape)
            self.data()[1].load(rows)
            for row, i in enumerate(full):
                items[i] = StagedBatch(rows, row)
        self._pending.extend(item if isinstance(item, StagedBatch) else self._host(item) for item in items)

    def _upload(self, gathered: list[StagedBatch]) -> None:
        if gathered:  # one copy; the device-side cursor back at the first
            self.data()[1].load(torch.stack([item.indices for item in gathered]))


@dataclass(slots=True)
class _SampledIndices:
    """A micro-batch as the stream reads it: the sampler's indices as drawn (made a ``StagedBatch`` once taken)."""

    indices: Any
