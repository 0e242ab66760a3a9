"""Worker processes for ``transform_checkpoints(workers=k)``: one fresh interpreter per target rank, and as many
at once as a memory budget allows (``worker_count``).

A worker imports the resharding modules and torch, never Lightning (the package root registers the strategies only
once Lightning is loaded, see _registration.py), so it starts in the time torch takes. A fresh process per rank
also makes its peak RSS that rank's own.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lightning_sink.layout.validation import torch_dtype
from lightning_sink.reshard.plan import RankPlan, band_box, bands_of
from lightning_sink.reshard.reader import READ_BUFFER_BYTES
from lightning_sink.reshard.writer import write_memory_bytes

__all__ = ["run_in_workers", "worker_count", "WorkerError"]

# An idle worker interpreter with torch imported (measured: about 560 MiB peak RSS on this project's CPU machine).
WORKER_BASELINE_BYTES = 600 * 2**20

# Imports this very copy of the package (the folder holding it goes first on the path); ties the worker's life to its
# parent's before importing anything slow (torch); then runs one task read from stdin and prints the result as JSON.
_BOOTSTRAP = """
import json, sys
sys.path.insert(0, sys.argv[1])
from lightning_sink._parent_watch import die_with_parent
die_with_parent(int(sys.argv[2]))
from lightning_sink.reshard.rank_conversion import worker_main
sys.exit(worker_main(json.loads(sys.stdin.read())))
"""


class WorkerError(RuntimeError):
    """A worker process died without reporting an error (killed, out of memory)."""


def _run_one(task: dict) -> dict:
    package_parent = str(Path(__file__).resolve().parents[2])
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(
        [sys.executable, "-c", _BOOTSTRAP, package_parent, str(os.getpid())],
        input=json.dumps(task),
        env=environment,
        capture_output=True,
        text=True,
    )
    lines = done.stdout.strip().splitlines()
    reply = json.loads(lines[-1]) if lines else {}
    if "error" in reply:
        error_type = {
            "ValueError": ValueError,
            "FileNotFoundError": FileNotFoundError,
            "TypeError": TypeError,
            "OSError": OSError,
        }
        raise error_type.get(reply["error"], RuntimeError)(reply["message"])
    if done.returncode != 0 or "result" not in reply:
        raise WorkerError(
            f"worker for target rank {task['rank']} exited with status {done.returncode}: {done.stderr[-2000:]}"
        )
    return reply["result"]


def worker_count(plans: list[RankPlan], workers: int, memory_budget_bytes: int | None) -> int:
    """At most one worker per target rank, and as many as fit the budget: a worker holds the writer's two windows
    (each about its largest band of rows), the read buffer and an idle interpreter."""
    count = min(workers, len(plans))
    if memory_budget_bytes is None:
        return count
    largest_band = max(
        (
            math.prod(band_box(shard, band)[1]) * torch_dtype(shard.dtype).itemsize
            for plan in plans
            for shard in plan.shards
            for band in bands_of(shard)
        ),
        default=0,
    )
    per_worker = write_memory_bytes(largest_band) + READ_BUFFER_BYTES + WORKER_BASELINE_BYTES
    return max(1, min(count, memory_budget_bytes // per_worker))


def run_in_workers(tasks: Iterable[dict], count: int) -> Iterator[dict]:
    """Run tasks in at most ``count`` concurrent worker processes; yield results as they complete."""
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(_run_one, task) for task in tasks]
        from concurrent.futures import as_completed

        try:
            for future in as_completed(futures):
                yield future.result()
        finally:
            for future in futures:
                future.cancel()
