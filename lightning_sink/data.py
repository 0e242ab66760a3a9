"""Where the training data stands: the micro-batches trained in the current pass, and how that pass was shuffled.

A resume must see the same batches in the same order as the uninterrupted run. Two things decide that for a loader
that is not itself resumable (a plain ``DataLoader``):

- how many batches of the current pass were already trained (the resumed run fetches and discards them), and
- the state of the loader's random generators when the pass started: a ``RandomSampler`` draws its permutation, and
  every ``DataLoader`` iterator its workers' base seed, from them when the pass starts. A ``DistributedSampler``
  needs only its epoch, which is set before the pass starts.

Both are recorded in ``DataPosition`` and ride in the strategy's checkpoint state. A loader that checkpoints itself
(torchdata's ``StatefulDataLoader``) is left to Lightning outside sink mode, which saves and reloads its state.
A sampler that shuffles without a generator (``DataLoader(shuffle=True)`` with no ``generator=``) draws from torch's
global generator when a pass starts, which the checkpoint holds as it was at the save (``random_state.py``), not
as it was at that pass's start: pass a generator for an exact resume.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, SequentialSampler

__all__ = [
    "DataPosition",
    "loader_generators",
    "capture_generator_states",
    "restore_generator_states",
    "set_sampler_epoch",
    "set_stale_sampler_epoch",
    "has_reproducible_order",
    "pass_length",
    "is_stateful_loader",
]


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators that decide a loader's order and worker seeds: the loader's, its sampler's, its batch sampler's
    (and that one's sampler's), each once."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    owners = (loader, getattr(loader, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    generators: list[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not seen for seen in generators):
            generators.append(generator)
    return generators


def capture_generator_states(loader: Any) -> list[Tensor]:
    return [generator.get_state() for generator in loader_generators(loader)]


def restore_generator_states(loader: Any, states: list[Tensor]) -> None:
    generators = loader_generators(loader)
    if len(generators) != len(states):
        raise ValueError(
            f"Cannot resume the shuffling of the training loader: the checkpoint holds the state of {len(states)}"
            f" random generator(s) of the loader and its sampler, but the loader now has {len(generators)}. Resume"
            " with the same loader setup (shuffle, sampler, generator=...)."
        )
    for generator, state in zip(generators, states):
        generator.set_state(state)


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch`` on the loader's (batch) sampler where it has one, as Lightning does at each epoch start."""
    for owner in (loader, getattr(loader, "batch_sampler", None)):
        set_epoch = getattr(getattr(owner, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def set_stale_sampler_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's (batch) samplers whose epoch is not ``epoch`` yet.

    For a pass about to start: Lightning sets the epoch only after it has created the pass's first iterator, too late
    for loader workers (they copy the sampler when the iterator is created) and for batches a resume skips. A sampler
    that does not show its ``epoch`` is taken to be at 0, where a fresh one starts, so a fresh fit sees only
    Lightning's own calls."""
    for owner in (loader, getattr(loader, "batch_sampler", None)):
        sampler = getattr(owner, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch) and getattr(sampler, "epoch", 0) != epoch:
            set_epoch(epoch)


def pass_length(loader: Any) -> int | None:
    """The batches Lightning takes from ``loader`` in an epoch (without ``limit_train_batches``): its length, or
    ``None`` where it has none (then a pass runs until the loader stops)."""
    try:
        return len(loader)
    except (TypeError, NotImplementedError):
        return None


def whole_batches_in_pass(loader: Any, length: int | None) -> int | None:
    """Of a data pass of ``length`` batches, how many come before a partial last one (a ``DataLoader`` that keeps
    the remainder of its samples as a smaller batch: ``drop_last=False``), where that is known; else ``length``."""
    batch_size = getattr(loader, "batch_size", None)
    if length is None or not isinstance(loader, DataLoader) or batch_size is None or loader.drop_last:
        return length
    try:
        partial = len(_index_sampler(loader)) % batch_size != 0 and length == len(loader)
    except (TypeError, NotImplementedError):
        return length
    return length - 1 if partial else length


def _index_sampler(loader: DataLoader) -> Any:
    """What decides the order of a ``DataLoader``'s indices: its sampler, or a custom batch sampler."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None or isinstance(batch_sampler, BatchSampler):
        return batch_sampler.sampler if batch_sampler is not None else loader.sampler
    return batch_sampler


def has_reproducible_order(loader: Any) -> bool:
    """Whether a pass over ``loader`` yields the same batches in the same order again once the generators it drew
    from are restored and its sampler's epoch is set: a ``DataLoader`` over a map-style dataset whose sampler is
    sequential, a ``DistributedSampler`` (seed and epoch), or one that shuffles with a generator of its own.

    Any other loader (``shuffle=True`` without ``generator=``, a custom iterable, an ``IterableDataset``) may yield
    another order on a second pass, so skipping the batches an interrupted pass had trained would not resume it."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return False
    sampler = _index_sampler(loader)
    if isinstance(sampler, SequentialSampler):
        return True
    if type(sampler) is DistributedSampler:  # (Lightning's DistributedSamplerWrapper draws from the sampler it wraps)
        return True
    return isinstance(getattr(sampler, "generator", None), torch.Generator)


def is_stateful_loader(loader: Any) -> bool:
    """Whether the loader saves and restores its own position (``state_dict``/``load_state_dict``), as Lightning
    tells a resumable loader."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class DataPosition:
    """Micro-batches trained in the current pass, the generator states each pass started from, and what a resume
    still has to apply (a skip, the generator states of the interrupted pass).

    ``pass_index`` counts completed data passes in sink mode (there it is the sampler epoch of the pass being
    trained); outside sink mode Lightning's epoch is the pass and it stays 0. Pass starts may be recorded ahead of
    training by sink mode's prefetch thread, hence the lock. In sink mode ``trained_in_sink`` (micro-batches of the
    sink being trained) and ``trained_total`` (of the fit) place the schedule points (``sink/schedule.py``) and let a
    resume continue an interrupted sink to its planned end.
    """

    def __init__(self) -> None:
        self.pass_index = 0
        self.trained_in_pass = 0
        self.trained_in_sink = 0
        self.trained_total = 0
        self.sink_mode = False  # whether the two sink counters are saved (set by a sink-mode fit)
        self.sink_open = False  # sink mode: the sink in flight has not reached its planned end (set at segment ends)
        self._pending_skip = 0
        self._pending_generator_states: list[Tensor] | None = None
        self._start_states: dict[int, list[Tensor]] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Lightning deep-copies loops (and with them the trainer and its strategy); a lock cannot be copied.
        return {key: value for key, value in vars(self).items() if key != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ a pass
    def start_pass(self) -> int:
        """A new pass starts; returns how many batches of it were already trained before a resume."""
        skip, self._pending_skip = self._pending_skip, 0
        self.trained_in_pass = skip
        return skip

    def begin_pass(self, loader: Any, pass_index: int) -> None:
        """Before the pass ``pass_index`` is iterated: restore the generators of an interrupted pass, or note theirs."""
        pending = self._pending_generator_states if pass_index == self.pass_index else None
        if pending is not None:
            restore_generator_states(loader, pending)
            self._pending_generator_states = None
        self.record_pass_start(pass_index, capture_generator_states(loader))

    def record_pass_start(self, pass_index: int, states: list[Tensor]) -> None:
        with self._lock:
            self._start_states[pass_index] = states

    def advance(self, batches: int = 1) -> None:
        self.trained_in_pass += batches
        self.trained_in_sink += batches
        self.trained_total += batches

    def end_pass(self) -> None:
        self.trained_in_pass = 0

    def next_pass(self) -> None:
        self.pass_index += 1
        self.trained_in_pass = 0
        with self._lock:
            for index in [index for index in self._start_states if index < self.pass_index]:
                del self._start_states[index]

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"pass_index": self.pass_index, "trained_in_pass": self.trained_in_pass}
        if self.sink_mode:  # sink mode's counters (absent outside it and in older checkpoints: read as 0)
            state["trained_in_sink"], state["trained_total"] = self.trained_in_sink, self.trained_total
            state["sink_open"] = self.sink_open
        with self._lock:
            states = self._start_states.get(self.pass_index)
        if states:  # absent for loaders without generators, so their state stays two counters
            state["pass_start_generators"] = [generator_state.clone() for generator_state in states]
        return state

    def cancel_resume(self) -> None:
        """The loader cannot be resumed exactly: nothing of the checkpoint's position is applied to it."""
        self._pending_skip = 0
        self._pending_generator_states = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pass_index = int(state.get("pass_index", 0))
        self._pending_skip = int(state["trained_in_pass"])
        self.trained_in_pass = self._pending_skip
        self._pending_generator_states = state.get("pass_start_generators")
        self.trained_in_sink = int(state.get("trained_in_sink", 0))
        self.trained_total = int(state.get("trained_total", 0))
        self.sink_open = bool(state.get("sink_open", False))
