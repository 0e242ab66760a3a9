"""What the last build of a fit's programs cost and gained, kept across processes, so that the next fit of the same
module, optimizer and settings can say at its start how long its build will take and whether the fit is long enough
to repay it.

A build's figures (``BuildFigures``): its seconds, and one micro-step's seconds run eagerly and compiled, both timed
at the build on copies of the state. The gain per micro-step is the difference; the build repays itself after
``build_seconds / gain`` micro-batches, and a fit with fewer left finishes sooner with ``graph_mode="eager"``. A build
whose loop is kept on disk says so (``loop_kept``): the next identical fit loads that loop instead of building, so its
build's cost is known only once it has run.

The figures are kept in one small JSON file beside Inductor's on-disk cache of compiled graphs
(``TORCHINDUCTOR_CACHE_DIR``), whose contents decide how long an identical build takes: removing that folder
removes both. The file is advice, never trusted: it is read only up to ``MAX_RECORD_BYTES``, only as a regular file
and never through a link (a FIFO there would block the fit's start forever), anything in it that is not a
well-formed entry is ignored, no code runs from it, and a file that cannot be read or written only means no figures
(the fit trains the same). It holds at most ``MAX_ENTRIES`` builds, the newest kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_sink.regular_file import read_regular

__all__ = ["MAX_ENTRIES", "MAX_RECORD_BYTES", "RECORD_NAME", "BuildFigures", "BuildRecord", "build_key"]

RECORD_NAME = "lightning_sink_builds.json"
MAX_RECORD_BYTES = 1 << 20
MAX_ENTRIES = 256
_SECONDS = ("build_seconds", "eager_step_seconds", "compiled_step_seconds")  # an entry's figures in seconds


@dataclass(frozen=True)
class BuildFigures:
    """One build's cost and what it gains per micro-step (``None``: not measured, e.g. across several processes,
    where timing a step alone would run its collectives on one rank)."""

    build_seconds: float
    eager_step_seconds: float | None = None
    compiled_step_seconds: float | None = None
    loop_kept: bool = False
    """The build's loop over windows is kept on disk (saved, or loaded from an earlier save: ``saved_loop.py``), so
    an identical later fit loads it instead of paying ``build_seconds`` again."""

    def repays_after(self) -> float | None:
        """Micro-batches after which the build has paid for itself (``inf``: compiled steps are no faster; ``None``:
        the step times were not measured)."""
        if self.eager_step_seconds is None or self.compiled_step_seconds is None:
            return None
        gain = self.eager_step_seconds - self.compiled_step_seconds
        return self.build_seconds / gain if gain > 0 else math.inf

    def as_entry(self) -> dict[str, float | None]:
        return {
            "build_seconds": self.build_seconds,
            "eager_step_seconds": self.eager_step_seconds,
            "compiled_step_seconds": self.compiled_step_seconds,
            "loop_kept": self.loop_kept,
            "saved_at": time.time(),
        }

    @staticmethod
    def from_entry(entry: Any) -> BuildFigures | None:
        """The figures of a well-formed entry (finite, non-negative numbers), else ``None``."""
        if not isinstance(entry, dict):
            return None
        build, eager, compiled = (entry.get(name) for name in _SECONDS)
        if build is None or not all(value is None or _seconds(value) for value in (build, eager, compiled)):
            return None
        return BuildFigures(float(build), _optional(eager), _optional(compiled), entry.get("loop_kept") is True)


def _seconds(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


def build_key(module: torch.nn.Module, optimizer: torch.optim.Optimizer, settings: dict[str, Any]) -> str:
    """What makes two builds the same: the module's class (with the file that defines it: two scripts each run as
    ``__main__`` may name different classes alike) and its parameters (names, shapes, dtypes, devices), the
    optimizer's class, the build's settings and torch's version (a digest: the record names no user code)."""
    params = [(name, tuple(p.shape), str(p.dtype), p.device.type) for name, p in module.named_parameters()]
    cls = type(module)
    described = [
        f"{cls.__module__}.{cls.__qualname__}",
        getattr(sys.modules.get(cls.__module__), "__file__", None),
        params,
        type(optimizer).__qualname__,
        sorted(settings.items()),
        torch.__version__,
    ]
    return hashlib.sha256(repr(described).encode()).hexdigest()[:32]


class BuildRecord:
    """The record file in ``folder``: ``load`` and ``save`` figures by ``build_key``."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / RECORD_NAME

    def load(self, key: str) -> BuildFigures | None:
        return BuildFigures.from_entry(self._entries().get(key))

    def save(self, key: str, figures: BuildFigures) -> bool:
        """Write the figures (atomically: a concurrent reader sees the old file or the new one); False when the
        folder cannot be written."""
        entries = self._entries()
        entries.pop(key, None)
        entries[key] = figures.as_entry()
        newest = sorted(entries.items(), key=lambda item: _saved_at(item[1]))[-MAX_ENTRIES:]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=".builds-", suffix=".json")
            try:
                with os.fdopen(handle, "w") as out:
                    json.dump(dict(newest), out)
                os.replace(temporary, self.path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError:
            return False
        return True

    def _entries(self) -> dict[str, Any]:
        """The file's entries; empty when it is missing, too large, not JSON or not an object of objects."""
        try:
            data = read_regular(self.path, MAX_RECORD_BYTES, "the build record")
        except (OSError, ValueError):  # (missing, unreadable, not a regular file, or over MAX_RECORD_BYTES)
            return {}
        try:
            loaded = json.loads(data)
        except (ValueError, RecursionError):
            return {}
        if not isinstance(loaded, dict):
            return {}
        return {key: value for key, value in loaded.items() if isinstance(value, dict)}


def _saved_at(entry: dict[str, Any]) -> float:
    saved: Any = entry.get("saved_at")
    return float(saved) if _seconds(saved) else 0.0
