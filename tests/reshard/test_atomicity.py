"""A conversion killed (SIGKILL) at any point leaves no visible output or the previous complete one; a rerun
completes. Kills happen in a real subprocess at chosen points and at a random moment."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_sink.checkpoint_format.manifest import read_manifest
from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.reshard import transform_checkpoints, verify_checkpoint
from tests.conftest import clean_subprocess_env
from tests.reshard.conftest import rows

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def run_killed(src: Path, dst: Path, layout: Path, point: str) -> subprocess.CompletedProcess:
    env = clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "tests.reshard.kill_worker", str(src), str(dst), str(layout), point],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def visible_state(dst: Path):
    """None when nothing is visible; else the manifest's file digests after a full verify."""
    if not dst.exists():
        return None
    verify_checkpoint(dst)
    return {name: entry["sha256"] for name, entry in read_manifest(dst).files.items()}


@pytest.fixture
def layouts(source_3: Path, tmp_path: Path) -> tuple[Path, Path]:
    base = load_layout(source_3)
    two = save_layout(layout_on_mesh(base, MeshLayout.one_dimensional(2), rows), tmp_path / "two.json")
    five = save_layout(layout_on_mesh(base, MeshLayout.one_dimensional(5), rows), tmp_path / "five.json")
    return two, five


@pytest.mark.parametrize("point", ["after_shard_1", "after_shard_11", "between_renames", "after_commit_rename"])
def test_killed_conversion_leaves_old_or_nothing_and_rerun_completes(source_3: Path, layouts, tmp_path: Path, point):
    two, five = layouts
    dst = tmp_path / "out"
    transform_checkpoints(source_3, dst, "ckpt_", None, two)
    previous = visible_state(dst)
    killed = run_killed(source_3, dst, five, point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    after = visible_state(dst)
    if point == "after_commit_rename":
        assert after is not None and len([n for n in after if n.startswith("rank_")]) == 5  # the new one, complete
    elif point == "between_renames":
        assert after is None  # the only window with no visible output
    else:
        assert after == previous  # the previous complete output, untouched
    transform_checkpoints(source_3, dst, "ckpt_", None, five, overwrite=True)  # the rerun completes
    assert verify_checkpoint(dst).world_size == 5
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []  # leftovers cleared


def test_kill_at_a_random_moment(source_3: Path, layouts, tmp_path: Path):
    _two, five = layouts
    dst = tmp_path / "out"
    rng = random.Random(0)
    env = clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for _ in range(1):
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.reshard.kill_worker", str(source_3), str(dst), str(five), "wait"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout.readline().strip() == "started"
        time.sleep(rng.uniform(0.0, 0.3))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        state = visible_state(dst)
        assert state is None or len([n for n in state if n.startswith("rank_")]) == 5
    transform_checkpoints(source_3, dst, "ckpt_", None, five, overwrite=True)
    assert verify_checkpoint(dst).world_size == 5


def test_a_second_conversion_into_a_destination_in_use_is_refused_and_the_first_completes(
    source_8: Path, tmp_path: Path
):
    """Without the guard the second run would clear the first one's staging folder as a leftover of a killed run."""
    import threading

    layout = layout_on_mesh(load_layout(source_8), MeshLayout.one_dimensional(2), rows)
    dst, paused, resume = tmp_path / "out", threading.Event(), threading.Event()

    def pause_once(done, total):
        if not paused.is_set():
            paused.set()
            resume.wait(timeout=60)

    first: dict = {}
    thread = threading.Thread(
        target=lambda: first.setdefault(
            "report", transform_checkpoints(source_8, dst, "ckpt_", None, layout, progress=pause_once)
        )
    )
    thread.start()
    try:
        assert paused.wait(timeout=60)
        with pytest.raises(ValueError, match=r"another conversion into it is running"):
            transform_checkpoints(source_8, dst, "ckpt_", None, layout, overwrite=True)
    finally:
        resume.set()
        thread.join(timeout=120)
    assert first["report"].destination == dst.resolve()
    verify_checkpoint(dst)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []  # the lock file is gone
    transform_checkpoints(source_8, dst, "ckpt_", None, layout)  # free again: the same conversion is accepted
