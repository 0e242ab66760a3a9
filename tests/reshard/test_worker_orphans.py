"""Killing a ``lightning-sink reshard --workers`` conversion also ends its worker processes.

The workers are caught once they are importing torch (past their start-up), stopped with SIGSTOP so that they
cannot finish on their own, and the conversion is killed with SIGKILL: the workers must then go too (a stopped
process still dies of SIGKILL), not stay behind as orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from tests.conftest import clean_subprocess_env
from tests.reshard.conftest import rows

ROOT = Path(__file__).resolve().parents[2]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def importing_torch(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def alive(pid: int) -> bool:
    """Running or stopped; a zombie (dead, not yet reaped by whoever adopted it) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc to find the worker processes")
def test_killing_a_conversion_ends_its_workers(source_3: Path, tmp_path: Path):
    layout = save_layout(
        layout_on_mesh(load_layout(source_3), MeshLayout.one_dimensional(4), rows), tmp_path / "l.json"
    )
    env = clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lightning_sink.cli",
            "reshard",
            "--src-checkpoints-dir",
            str(source_3),
            "--dst-checkpoints-dir",
            str(tmp_path / "out"),
            "--dst-strategy-file",
            str(layout),
            "--workers",
            "2",
            "--no-progress",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            workers = [pid for pid in children(parent.pid) if importing_torch(pid)]
            time.sleep(0.005)
        assert len(workers) == 2, "the conversion did not start two workers"
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in workers), "worker processes outlived the killed conversion"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
