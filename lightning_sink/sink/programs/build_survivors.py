"""What a build of the compiled programs leaves on Python's heap, kept out of the cyclic collector's full
collections until the fit ends.

A build leaves tens of thousands of TorchDynamo's and Inductor's objects behind. Python's full collection traverses
every object the collector tracks, and it runs again whenever the objects that survived the younger collections
reach a quarter of the old ones: in a long fit of a small model, a pause as long as hundreds of micro-steps every
few dozen sinks. So around a build (``around_build``) the objects that exist before it are moved into the
collector's permanent generation (``gc.freeze``), which collections skip; after it the garbage the build made is
collected at once (counted in the build, not in a later sink), a collection that traverses only the build's own
objects rather than the whole process's (torch's, Lightning's), and what survives joins the frozen ones. At the
fit's end they are given back (``gc.unfreeze``), so that whatever among them becomes garbage later is collected
again as before (a cycle that was garbage already before the build is collected then too). Where something else in
the process has frozen objects already, its choice is left alone: nothing is frozen, nor given back, and the
collection after a build traverses everything.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["BuildSurvivors"]


class BuildSurvivors:
    """One fit's freeze of what its builds left: ``around_build`` for each build, ``release`` at the fit's end."""

    def __init__(self) -> None:
        self._frozen = False

    @contextlib.contextmanager
    def around_build(self) -> Iterator[None]:
        """Freeze what exists now, run the build, collect its garbage and freeze what survives."""
        self._freeze()
        yield
        gc.collect()
        self._freeze()

    def _freeze(self) -> None:
        if self._frozen or gc.get_freeze_count() == 0:
            gc.freeze()
            self._frozen = True

    def release(self) -> None:
        """Give the frozen objects back to the collector (a no-op if this fit froze none)."""
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
