"""Start-up of the ``lightning-sink`` command line: wall time and peak RSS of ``verify --help`` and of a ``verify``
of a small resharded folder, for two copies of the code (before and after a change), alternating.

    python benchmarks/cli_start_up.py --before /path/to/other/checkout [--after .] [--repeats 7]

Each command runs in a fresh interpreter started from this script, which imports nothing heavy itself: Linux
counts the parent's resident set into a child's peak (``ru_maxrss`` is carried over ``exec``), so a small parent
keeps the child's figure its own. Peak RSS is the child's ``ru_maxrss`` from ``os.wait4``. The folder is made
once, by the "after" code. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_MAKE_FOLDER = """
import sys, torch
from pathlib import Path
from lightning_sink.layout import MeshLayout, layout_on_mesh, save_layout
from lightning_sink.reshard import transform_checkpoints
from lightning_sink.reshard.open_source import open_source
folder = Path(sys.argv[1])
torch.save({"w": torch.randn(256, 64), "b": torch.zeros(256)}, folder / "model.pt")
layout = layout_on_mesh(open_source(folder / "model.pt", None).layout, MeshLayout.one_dimensional(2),
                        lambda fqn, tensor: ["Shard(0)"])
transform_checkpoints(folder / "model.pt", folder / "out", "ckpt_", None, save_layout(layout, folder / "two.json"))
"""


def run_once(code_root: Path, argv: list[str], workdir: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``python -m lightning_sink.cli ARGV`` with ``code_root`` first on the path
    (run from ``workdir``: ``-m`` puts the current folder before ``PYTHONPATH``)."""
    environment = {**os.environ, "PYTHONPATH": str(code_root)}
    started = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "lightning_sink.cli", *argv],
        cwd=workdir,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)  # (reaped by wait4, so Popen must not wait again)
    if child.returncode != 0:
        raise RuntimeError(f"{argv} with {code_root} exited with status {child.returncode}")
    return seconds, usage.ru_maxrss * 1024


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        folder = Path(workdir)
        subprocess.run(
            [sys.executable, "-c", _MAKE_FOLDER, str(folder)],
            env={**os.environ, "PYTHONPATH": str(args.after.resolve())},
            check=True,
        )
        commands = {"verify --help": ["verify", "--help"], "verify": ["verify", str(folder / "out")]}
        variants = {"before": args.before.resolve(), "after": args.after.resolve()}
        samples = {(v, c): ([], []) for v in variants for c in commands}
        for repeat in range(args.repeats):
            order = list(variants) if repeat % 2 == 0 else list(reversed(variants))
            for variant in order:
                for command, argv in commands.items():
                    seconds, rss = run_once(variants[variant], argv, folder)
                    samples[variant, command][0].append(seconds)
                    samples[variant, command][1].append(rss)
    results = {
        f"{variant} | {command}": {
            "seconds": summary(times),
            "peak_rss_mib": summary([rss / 2**20 for rss in peaks]),
        }
        for (variant, command), (times, peaks) in samples.items()
    }
    for name, result in results.items():
        seconds, rss = result["seconds"], result["peak_rss_mib"]
        print(
            f"{name:24s} {seconds['median']:.2f} s ({seconds['min']:.2f}-{seconds['max']:.2f})"
            f"  peak RSS {rss['median']:.0f} MiB ({rss['min']:.0f}-{rss['max']:.0f})"
        )
    machine = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version()}
    load = os.getloadavg()
    print(json.dumps({"repeats": args.repeats, "machine": machine, "load_average": load, "results": results}))


if __name__ == "__main__":
    main()
