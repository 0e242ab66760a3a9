"""What the resume agreement costs a multi-process resume from a ``.ckpt``, next to the load itself, alternating.

    python benchmarks/resume_agreement.py [--repeats 7] [--megabytes 512]

A ``.ckpt``-like file of ``--megabytes`` of float32 tensors is written once; then, alternating, each repeat times:

- ``load``: ``torch.load(weights_only=True)`` of it, the anchor (what every rank's resume does anyway);
- ``first_round``: ``checkpoint_identity(path, hash_file=False)``, what every resume costs per rank (inode, size
  and modification time: one ``stat``);
- ``hash``: ``checkpoint_identity(path)``, the SHA-256 of its bytes in 1 MiB chunks, which a resume pays only where
  the ranks' files differ in inode, size or time (copies on each node's disk).

The file is read once before timing, so every figure is from the page cache (a resume's load right after the hash
reads it from there too). Figures are medians of the repeats, with the spread (min and max) and each one's ratio to
the load; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_sink.checkpoint_format.resume_agreement import checkpoint_identity


def _seconds(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--megabytes", type=int, default=512)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.ckpt"
        tensors = options.megabytes * (1 << 20) // 4 // (1 << 20)
        torch.save({"state_dict": {f"w{i}": torch.randn(1 << 20) for i in range(max(1, tensors))}}, path)
        path.read_bytes()  # into the page cache, as the first of the repeats would leave it
        actions = {
            "load": lambda: torch.load(path, map_location="cpu", weights_only=True),
            "first_round": lambda: checkpoint_identity(path, hash_file=False),
            "hash": lambda: checkpoint_identity(path),
        }
        times: dict[str, list[float]] = {name: [] for name in actions}
        for repeat in range(options.repeats):
            order = list(actions) if repeat % 2 == 0 else list(reversed(actions))
            for name in order:
                times[name].append(_seconds(actions[name]))
        size = path.stat().st_size
    load = statistics.median(times["load"])
    result = {
        "benchmark": "resume_agreement",
        "file_bytes": size,
        "repeats": options.repeats,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        **{
            name: {
                "median_s": statistics.median(values),
                "min_s": min(values),
                "max_s": max(values),
                "ratio_to_load": statistics.median(values) / load,
            }
            for name, values in times.items()
        },
    }
    for name in actions:
        figure = result[name]
        print(
            f"{name:12s} median {figure['median_s']:.4f} s (min {figure['min_s']:.4f}, max {figure['max_s']:.4f}),"
            f" {figure['ratio_to_load']:.2f}x the load"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
