"""How many tests the fast tier (``pytest -m "not slow"``) runs and how long it takes, for the README's figure.

    python benchmarks/fast_tier.py

Runs the fast tier once in a subprocess, from the repository, and reports its own summary line (passed, skipped,
failed, seconds) with the machine, the load average before and after (the figure means little on a busy machine)
and the versions. The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    load_before = os.getloadavg()
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)}
    seconds = re.search(r" in ([0-9.]+)s", summary)
    print(summary)
    print(
        json.dumps(
            {
                "benchmark": "fast_tier",
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "torch": torch.__version__,
                "python": platform.python_version(),
                "exit_status": done.returncode,
                "counts": counts,
                "pytest_seconds": float(seconds.group(1)) if seconds else None,
                "wall_seconds": round(wall, 1),
                "load_average_before": [round(x, 2) for x in load_before],
                "load_average_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
