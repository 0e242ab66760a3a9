"""torch's ``DataLoader`` internals the indexed reads rely on: a single-process iterator that reads each batch by
its indices, and the per-loader switch to it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

__all__ = ["batch_reading_iterator", "read_batches_with", "restore_batch_reads"]


class _BatchReadingIterator(_SingleProcessDataLoaderIter):
    """A single-process ``DataLoader`` iterator that reads each batch as ``read(indices)``; everything else (the
    sampler, the base-seed draw, the yield counter, the profiler's record) is the loader's own iterator."""

    def __init__(self, loader: DataLoader, read: Callable[[Any], Any]) -> None:
        super().__init__(loader)
        self._read = read

    def _next_data(self) -> Any:
        return self._read(self._next_index())

    def __next__(self) -> Any:
        if self._sampler_iter is None or torch.autograd._profiler_enabled():
            return super().__next__()
        # The loader's own __next__ for a map-style dataset (the only kind read this way) without its profiling
        # scope when no profiler is on to record it: opening and closing that scope is a large share of reading a
        # small batch by indexing, and the sampler, the yield counter and the batch are the same.
        data = self._next_data()
        self._num_yielded += 1
        return data


def batch_reading_iterator(loader: DataLoader, read: Callable[[Any], Any]) -> Iterator[Any]:
    """One pass over the single-process ``loader``: its own iterator, each batch read as ``read(indices)``."""
    return _BatchReadingIterator(loader, read)


def _start_pass(loader: DataLoader, reader_for: Callable[[DataLoader], Callable[[Any], Any] | None]) -> Any:
    read = reader_for(loader)
    if read is None:  # the loader no longer reads that way (its collate_fn was replaced): its own iterator
        return DataLoader._get_iterator(loader)
    return batch_reading_iterator(loader, read)


def read_batches_with(loader: DataLoader, reader_for: Callable[[DataLoader], Callable[[Any], Any] | None]) -> bool:
    """Every later pass over ``loader`` (a single-process ``DataLoader``) reads its batches with the function
    ``reader_for(loader)`` returns at the pass's start (``None``: the loader's own reads), until
    ``restore_batch_reads``. ``iter(loader)`` calls ``loader._get_iterator()``; an attribute of that name on the
    loader object shadows the method. Returns False, changing nothing, where such an attribute is already there."""
    if "_get_iterator" in vars(loader):
        return False
    vars(loader)["_get_iterator"] = functools.partial(_start_pass, loader, reader_for)
    return True


def restore_batch_reads(loader: DataLoader) -> None:
    """Undo ``read_batches_with``: the loader's own ``_get_iterator`` again."""
    loader.__dict__.pop("_get_iterator", None)
