"""Data sinking: an endless stream of micro-batches, prefetched by a background thread, one sink per epoch.

MindSpore's ``dataset_sink_mode`` traverses the dataset continuously: with ``sink_size=K`` epoch e trains batches
e*K .. e*K+K-1 of an endless pass. Read in the training thread, a pass over an in-memory ``TensorDataset`` takes each
batch by one indexing per tensor (``indexed_batches``): the same batches for a fraction of the ``DataLoader``'s cost.
``SinkLoader`` is what Lightning iterates: placeholder ``SinkToken`` items, one per epoch (so a Lightning epoch is
one Lightning batch), or one per segment where the fit's schedule ends a sink early (``sink/schedule.py``); it has
no length, since the segments of a sink are known only as it runs. The strategy pulls the sink's micro-batches from ``MicroBatchStream``, whose iterator survives
epochs and whose sampler epoch advances at each new data pass. ``SinkLoader`` is therefore what
``trainer.train_dataloader`` returns in sink mode; it forwards the user loader's attributes (``batch_size``,
``dataset``, ``num_workers``, ...) and the loader itself is its ``loader`` attribute.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from lightning_sink import _lightning_compat as compat
from lightning_sink.data import DataPosition, pass_length, set_sampler_epoch
from lightning_sink.device_prefetch import CopiedBatch, CudaBatchCopier
from lightning_sink.indexed_batches import pass_batches, reads_by_indexing

__all__ = [
    "SinkToken",
    "SinkLoader",
    "MicroBatchStream",
    "PASS_END",
    "default_prefetch_depth",
]

PASS_END = object()  # a data pass ended; the next item starts a new pass


class SinkToken:
    """What Lightning sees as the batch of a sink epoch; the micro-batches come from the strategy's stream.

    A plain class (not a dataclass), so Lightning's batch-transfer helpers pass it through untouched.
    """

    def __init__(self, sink_index: int) -> None:
        self.sink_index = sink_index

    def __repr__(self) -> str:
        return f"SinkToken({self.sink_index})"


# Not forwarded by SinkLoader. With a ``sampler`` Lightning would set the sampler's epoch to the sink index at each
# sink, racing the stream, which sets it per data pass. With ``state_dict``/``load_state_dict`` Lightning would save
# the position of a stateful loader, which the stream reads ahead of training; the strategy saves its own.
_NOT_FORWARDED = frozenset({"sampler", "batch_sampler", "state_dict", "load_state_dict"})
_OWN_ATTRIBUTES = frozenset({"loader", "_sinks", "sink_continues"})


class SinkLoader:
    """One ``SinkToken`` per Lightning epoch, standing in for the user's loader (its ``loader``) towards Lightning.

    Public attributes other than the sampler and state methods (see ``_NOT_FORWARDED``) are read from and written
    to the user's loader, so ``trainer.train_dataloader.batch_size`` is the loader's batch size and a
    ``worker_init_fn`` Lightning installs reaches the loader that starts the workers.
    """

    def __init__(self, loader: Any) -> None:
        # Not ``iter(loader) is loader``: starting a DataLoader iterator draws its base seed from the loader's
        # generator, which would shift the shuffling of every later pass.
        if isinstance(loader, Iterator):
            raise ValueError(
                f"The training loader {type(loader).__name__} is an iterator and cannot be iterated again; sink mode"
                " traverses the data pass after pass. Pass a DataLoader or another re-iterable object."
            )
        self.loader = loader
        self._sinks = 0
        # Asked before each segment runs: whether another segment of the same sink follows (set by the fit).
        self.sink_continues: Callable[[], bool] = lambda: False

    def __getattr__(self, name: str) -> Any:  # only called for names not found on the SinkLoader itself
        if name.startswith("_") or name in _NOT_FORWARDED:
            raise AttributeError(f"{type(self).__name__} does not forward {name!r} of the training loader")
        return getattr(self.loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self.loader, name, value)

    def __iter__(self) -> Iterator[SinkToken]:
        self._sinks += 1
        yield SinkToken(self._sinks - 1)
        while self.sink_continues():
            yield SinkToken(self._sinks - 1)


def default_prefetch_depth(device: torch.device, loader: Any) -> int:
    """What ``prefetch_depth=None`` means: 2 on CUDA, where a thread reads ahead while the GPU computes and copies
    each batch from pinned memory on a side stream; 0 (the training thread reads) on the CPU, and on CUDA for a
    loader read by indexing (in-memory tensors), whose reads are too cheap to hide: there the thread only adds GIL
    hand-offs to a step that is mostly Python and kernel launches (``benchmarks/common_path.py --device cuda``)."""
    return 2 if device.type == "cuda" and not reads_by_indexing(loader) else 0


class MicroBatchStream:
    """Micro-batches of consecutive data passes, read ahead by a daemon thread into a queue of ``depth`` items.

    ``next()`` returns a batch or ``PASS_END``; the caller records consumption in its ``DataPosition``, which is
    what a checkpoint saves (batches read ahead but not trained are read again after a resume).
    """

    def __init__(
        self,
        loader: Any,
        position: DataPosition,
        depth: int = 2,
        copier: CudaBatchCopier | None = None,
        read_pass: Callable[[Any], Iterable[Any]] | None = None,
    ) -> None:
        """``depth=0`` reads in the training thread instead (no thread, no queue). A ``copier`` moves each batch to
        the GPU in the reading thread (then ``next()`` returns batches already on the device). ``read_pass``: how a
        pass over the loader is iterated with ``depth=0`` (default ``pass_batches``; staged data reads indices)."""
        self.loader, self.position, self.copier = loader, position, copier
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        # The reading thread starts a pass only when the training thread asks for its first batch (see ``_items``):
        # what the pass's start draws from torch's global generator is then drawn while the training thread waits.
        self._pass_wanted = threading.Event()
        self._next_is_pass_start = True
        first_pass, skip = position.pass_index, position.start_pass()
        # Only the training thread reads by indexing. Indexing a large batch runs OpenMP threads, and from a reading
        # thread those form a second team that competes with the training thread's for the cores (LeNet-5 on two
        # cores: 0.57x the hand-written loop, against 1.0x with the loader's own reads), so there it keeps those.
        self._read_pass = (read_pass or pass_batches) if depth == 0 else iter
        self._inline = self._items(first_pass, skip) if depth == 0 else None
        self._thread = None
        if depth > 0:
            self._thread = threading.Thread(
                target=self._produce, args=(first_pass, skip), daemon=True, name="lightning-sink-prefetch"
            )
            self._thread.start()

    def _items(self, pass_index: int, skip: int) -> Iterator[Any]:
        """Batches of consecutive passes, with ``PASS_END`` between passes.

        A pass takes what Lightning's loop takes from the loader in an epoch, and draws the same random numbers in
        the same order: its iterator is created only once the pass is asked for (after the previous pass's last
        batch was trained, as Lightning creates it at the next epoch's start), and a loader with a length is read
        for that many batches, never once more. One more ``next()`` would not find another batch but would run the
        sampler on (a ``RandomSampler`` draws the next permutation from its generator before it finds it is done),
        which Lightning, knowing the length, never does."""
        while True:
            if not self._pass_requested():
                return
            set_sampler_epoch(self.loader, pass_index)
            self.position.begin_pass(self.loader, pass_index)  # after a resume: the interrupted pass's generators
            length = pass_length(self.loader)
            produced = 0
            for index, batch in enumerate(self._read_pass(self.loader)):
                if index >= skip:
                    produced += 1
                    yield self.copier.copy(batch) if self.copier is not None else batch
                if length is not None and index + 1 >= length:
                    break
            if produced == 0 and skip == 0:
                raise ValueError("The training loader yielded no batches in a data pass; sink mode needs data.")
            skip = 0
            yield PASS_END
            pass_index += 1

    def _pass_requested(self) -> bool:
        """In the reading thread, wait until the training thread asks for the next pass (False: the stream closed).
        Read in the training thread, the pass is asked for by the ``next()`` that resumes ``_items``."""
        if self._thread is None:
            return True
        while not self._pass_wanted.wait(timeout=0.1):
            if self._stop.is_set():
                return False
        self._pass_wanted.clear()
        return True

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, pass_index: int, skip: int) -> None:
        try:
            for item in self._items(pass_index, skip):
                if not self._put(item):
                    return
        except BaseException as error:  # surfaced to the training thread by next()
            self._put(error)

    def next(self) -> Any:
        if self._inline is not None:
            item = next(self._inline)
        else:
            if self._next_is_pass_start:
                self._next_is_pass_start = False
                self._pass_wanted.set()
            item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is PASS_END:
            self._next_is_pass_start = True
            self.position.next_pass()
        elif isinstance(item, CopiedBatch):
            assert self.copier is not None  # (only a copier makes CopiedBatch items)
            return self.copier.receive(item)
        return item

    def close(self) -> None:
        """Stop reading; then shut the loader's workers down, as Lightning does with a training loader at fit end."""
        self._stop.set()
        self._inline = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # still inside the loader (a slow batch): its daemon thread ends with the process
        compat.shut_down_loader_workers(self.loader)
