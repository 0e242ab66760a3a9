"""The training loader wrapper that lets a run resume at the exact micro-batch it stopped at.

Lightning's own resume of a loader is tied to its prefetching and to ``fit_loop.restarting``, so
the strategy counts the micro-batches it has *trained* in the current pass and saves that number in its own
checkpoint state. On resume the wrapper skips that many batches of the pass before yielding.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

__all__ = ["DataPosition", "ResumableLoader"]


class DataPosition:
    """Micro-batches trained in the current pass over the loader, and a pending skip after a resume."""

    def __init__(self) -> None:
        self.pass_index = 0  # data passes completed (sink mode: the sampler epoch of the current pass)
        self.trained_in_pass = 0
        self._pending_skip = 0

    def start_pass(self) -> int:
        """A new pass starts; returns how many batches of it were already trained before a resume."""
        skip, self._pending_skip = self._pending_skip, 0
        self.trained_in_pass = skip
        return skip

    def advance(self, batches: int = 1) -> None:
        self.trained_in_pass += batches

    def end_pass(self) -> None:
        self.trained_in_pass = 0

    def next_pass(self) -> None:
        self.pass_index += 1
        self.trained_in_pass = 0

    def state_dict(self) -> dict[str, int]:
        return {"pass_index": self.pass_index, "trained_in_pass": self.trained_in_pass}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pass_index = int(state.get("pass_index", 0))
        self._pending_skip = int(state["trained_in_pass"])
        self.trained_in_pass = self._pending_skip


class ResumableLoader:
    """Wraps a training loader; forwards what Lightning inspects (length, samplers), skips on resume."""

    def __init__(self, loader: Any, position: DataPosition, whole_windows_of: int | None = None) -> None:
        """``whole_windows_of=N`` ends each pass after the last whole window of N batches (``"drop"``)."""
        self.loader = loader
        self.position = position
        self.whole_windows_of = whole_windows_of

    def __len__(self) -> int:
        length = len(self.loader)
        if self.whole_windows_of:
            length -= length % self.whole_windows_of
        return length

    @property
    def sampler(self) -> Any:
        # Lightning calls ``set_epoch`` on the sampler it finds here, so shuffling changes every epoch.
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def __iter__(self) -> Iterator[Any]:
        skip = self.position.start_pass()
        iterator = iter(self.loader)
        for index in range(skip):
            try:
                next(iterator)
            except StopIteration:
                raise ValueError(
                    f"Cannot resume: the checkpoint was saved after {skip} batches of the current pass, but the"
                    f" training loader now yields only {index}. Resume with the same data and batch size."
                ) from None
        if self.whole_windows_of and hasattr(self.loader, "__len__"):
            yield from itertools.islice(iterator, len(self) - skip)
        else:
            yield from iterator

    # Lightning treats loaders with these two methods as resumable and then skips its "not resumable" warning.
    # The position itself travels in the strategy's checkpoint state (see the module docstring).
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
