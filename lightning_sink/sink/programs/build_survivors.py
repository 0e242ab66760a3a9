"""What a build of the compiled programs leaves on Python's heap, kept out of the cyclic collector's full
collections until the fit ends.

A build leaves tens of thousands of TorchDynamo's and Inductor's objects behind. Python's full collection traverses
every object the collector tracks, and it runs again whenever the objects that survived the younger collections
reach a quarter of the old ones: in a long fit of a small model, a pause as long as hundreds of micro-steps every
few dozen sinks. After the build the garbage it made is collected at once (counted in the build, not in a later
sink), and the objects that survive are moved into the collector's permanent generation (``gc.freeze``), which full
collections skip. At the fit's end they are given back (``gc.unfreeze``), so that whatever among them becomes
garbage later is collected again as before. Where something else in the process has frozen objects already, its
choice is left alone: nothing is frozen, nor given back.
"""

from __future__ import annotations

import gc

__all__ = ["BuildSurvivors"]


class BuildSurvivors:
    """One fit's freeze of what its builds left: ``keep`` after each build, ``release`` at the fit's end."""

    def __init__(self) -> None:
        self._frozen = False

    def keep(self) -> None:
        """Collect the build's garbage now and move what survives out of later full collections."""
        gc.collect()
        if not self._frozen and gc.get_freeze_count() == 0:
            gc.freeze()
            self._frozen = True

    def release(self) -> None:
        """Give the frozen objects back to the collector (a no-op if this fit froze none)."""
        if self._frozen:
            gc.unfreeze()
            self._frozen = False
