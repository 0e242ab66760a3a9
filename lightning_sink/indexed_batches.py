"""Training reads of an in-memory ``TensorDataset``: one indexing per tensor for a whole batch.

A ``DataLoader`` builds a batch of a ``TensorDataset`` from B item reads, each indexing every tensor, and
``default_collate`` stacking them: Python work per item, a large share of a small model's step
(``benchmarks/common_path.py`` measures it).
Indexing each tensor once with the batch's indices yields the same batch: the same values, dtypes, shapes and
(contiguous) strides, in the list ``default_collate`` returns. The indices still come from the loader's own
iterator, so its sampler, its generators and its base-seed draw advance exactly as in a plain pass.

Only a loader whose pass is exactly that is read this way (``reads_by_indexing``): a ``DataLoader`` itself, reading
in this process without pinning, batching with a plain ``BatchSampler`` over one of torch's samplers that yield
integers, collating with ``default_collate``, over a ``TensorDataset`` (or a ``Subset`` of one) of plain,
contiguous tensors that do not require grad. Anything else is iterated as the loader is.

Sink mode's stream iterates ``pass_batches``. Outside sink mode Lightning iterates the loader itself, and
``IndexedLoaderReads`` gives the loader, for the fit, an iterator of its own kind that reads this way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    TensorDataset,
    WeightedRandomSampler,
    default_collate,
)

from lightning_sink import _torch_compat as compat

__all__ = ["reads_by_indexing", "batch_reader", "indexed_batches", "pass_batches", "IndexedLoaderReads"]

# Samplers that yield Python ints: indexing a tensor with them reads the rows ``dataset[i]`` reads.
_INTEGER_SAMPLERS = (SequentialSampler, RandomSampler, DistributedSampler, WeightedRandomSampler)


def _plain_tensor(tensor: Any) -> bool:
    return (
        type(tensor) is Tensor
        and tensor.layout == torch.strided
        and tensor.is_contiguous()
        and not tensor.requires_grad
    )


def _tensor_dataset(dataset: Any) -> TensorDataset | None:
    """The ``TensorDataset`` a batch is read from: ``dataset`` itself, or the one a ``Subset`` selects from."""
    source = dataset.dataset if type(dataset) is Subset else dataset
    if type(source) is not TensorDataset or not all(_plain_tensor(tensor) for tensor in source.tensors):
        return None
    return source


def reads_by_indexing(loader: Any) -> bool:
    """Whether a pass over ``loader`` yields what indexing its ``TensorDataset`` with each batch's indices yields."""
    if type(loader) is not DataLoader:
        return False
    batch_sampler = loader.batch_sampler
    return (
        loader.num_workers == 0
        and not loader.pin_memory
        and loader.collate_fn is default_collate
        and type(batch_sampler) is BatchSampler
        and type(batch_sampler.sampler) in _INTEGER_SAMPLERS
        and _tensor_dataset(loader.dataset) is not None
    )


def _rows(dataset: Any) -> Tensor | None:
    """For a ``Subset``: the rows of its ``TensorDataset`` that its indices 0, 1, ... stand for."""
    if type(dataset) is not Subset:
        return None
    return torch.as_tensor(list(dataset.indices), dtype=torch.long)


def batch_reader(loader: DataLoader) -> Callable[[Sequence[int]], list[Tensor]]:
    """For a loader for which ``reads_by_indexing`` holds: the batch of a list of sampler indices, read by indexing.
    The dataset's ``tensors`` are looked up at each read, as ``TensorDataset.__getitem__`` does."""
    source = _tensor_dataset(loader.dataset)
    assert source is not None, "batch_reader is for loaders that reads_by_indexing accepts"
    rows = _rows(loader.dataset)

    def read(indices: Sequence[int]) -> list[Tensor]:
        index = torch.as_tensor(indices, dtype=torch.long)
        if rows is not None:
            index = rows[index]
        return [tensor[index] for tensor in source.tensors]

    return read


def indexed_batches(loader: DataLoader) -> Iterator[list[Tensor]]:
    """One pass over ``loader`` (for which ``reads_by_indexing`` holds), each batch read by indexing."""
    return compat.batch_reading_iterator(loader, batch_reader(loader))


def pass_batches(loader: Any) -> Iterable[Any]:
    """What one pass over ``loader`` iterates: its batches read by indexing where that yields the same batches."""
    return indexed_batches(loader) if reads_by_indexing(loader) else loader


def _reader_at_pass_start(loader: DataLoader) -> Callable[[Sequence[int]], list[Tensor]] | None:
    return batch_reader(loader) if reads_by_indexing(loader) else None


class IndexedLoaderReads:
    """Outside sink mode Lightning iterates the user's loader itself; for a fit, the loaders taken here read each
    batch by indexing (where ``reads_by_indexing`` holds at a pass's start) behind their own iterator, so Lightning,
    ``trainer.train_dataloader`` and the loader's sampler and generators see the loader as it is."""

    def __init__(self) -> None:
        self._loaders: list[DataLoader] = []

    def take(self, loader: Any) -> None:
        if reads_by_indexing(loader) and compat.read_batches_with(loader, _reader_at_pass_start):
            self._loaders.append(loader)

    def release(self) -> None:
        """At the end of fit: the loaders read as they did before."""
        for loader in self._loaders:
            compat.restore_batch_reads(loader)
        self._loaders.clear()
