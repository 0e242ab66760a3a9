"""Sink mode's reads of an in-memory ``TensorDataset``: one indexing per tensor for a whole batch.

A ``DataLoader`` builds a batch of a ``TensorDataset`` from B item reads, each indexing every tensor, and
``default_collate`` stacking them: about 0.1 ms of Python for a batch of 32, a third of a small model's step.
Indexing each tensor once with the batch's indices yields the same batch: the same values, dtypes, shapes and
(contiguous) strides, in the list ``default_collate`` returns. The indices still come from the loader's own
iterator, so its sampler, its generators and its base-seed draw advance exactly as in a plain pass.

Only a loader whose pass is exactly that is read this way (``reads_by_indexing``): a ``DataLoader`` itself, reading
in this process without pinning, batching with a plain ``BatchSampler`` over one of torch's samplers that yield
integers, collating with ``default_collate``, over a ``TensorDataset`` (or a ``Subset`` of one) of plain,
contiguous tensors that do not require grad. Anything else is iterated as the loader is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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

__all__ = ["reads_by_indexing", "indexed_batches", "pass_batches"]

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


def indexed_batches(loader: DataLoader) -> Iterator[list[Tensor]]:
    """One pass over ``loader`` (for which ``reads_by_indexing`` holds), each batch read by indexing."""
    tensors = _tensor_dataset(loader.dataset).tensors
    rows = _rows(loader.dataset)
    iterator = iter(loader)  # draws the base seed and starts the sampler, as a plain pass does
    while True:
        try:
            indices = compat.next_batch_indices(iterator)
        except StopIteration:
            return
        index = torch.as_tensor(indices, dtype=torch.long)
        if rows is not None:
            index = rows[index]
        yield [tensor[index] for tensor in tensors]


def pass_batches(loader: Any) -> Iterable[Any]:
    """What one pass over ``loader`` iterates: its batches read by indexing where that yields the same batches."""
    return indexed_batches(loader) if reads_by_indexing(loader) else loader
