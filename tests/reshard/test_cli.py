"""The ``lightning-sink reshard`` / ``verify`` commands, run as real subprocesses (``python -m lightning_sink.cli``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sink.cli import parse_size
from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.reshard import load_resharded_checkpoint
from tests.conftest import clean_subprocess_env
from tests.dcp_runs import full_tensors
from tests.reshard.conftest import SPEC_3, rows

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lightning_sink.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_reshard_then_verify_then_a_damaged_file_fails_verify(source_3: Path, tmp_path: Path):
    layout = layout_on_mesh(load_layout(source_3), MeshLayout.one_dimensional(4), rows)
    layout_file = save_layout(layout, tmp_path / "four.json")
    dst = tmp_path / "out"
    done = cli(
        "reshard",
        "--src-checkpoints-dir",
        str(source_3),
        "--dst-checkpoints-dir",
        str(dst),
        "--dst-strategy-file",
        str(layout_file),
        "--ckpt-prefix",
        "checkpoint_",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 4 and summary["payload_bytes_read"] == summary["bytes_needed"]
    assert "reshard" in done.stderr  # the progress bar
    full = full_tensors(SPEC_3, seed=1)
    for rank in range(4):
        shards = load_resharded_checkpoint(dst / f"rank_{rank}" / f"checkpoint_{rank}.pt")["tensors"]
        for fqn, shard in shards.items():
            (chunk,) = layout.tensors[fqn].chunks_of_rank(rank)
            assert torch.equal(shard, full[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))])
    verified = cli("verify", str(dst))
    assert verified.returncode == 0 and "OK" in verified.stdout and "4 ranks" in verified.stdout
    listed = cli(
        "reshard",
        "--src-checkpoints-dir",
        str(source_3),
        "--dst-strategy-file",
        str(layout_file),
        "--rank-id",
        "3",
        "--list-ranks",
    )
    # Target rank 3 holds row 9 of w (source rank 2 holds rows 8..9) and row 3 of v, whose 9 columns the
    # source split over all three ranks.
    assert json.loads(listed.stdout) == [0, 1, 2]
    damaged = dst / "rank_2" / "checkpoint_2.pt"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    failed = cli("verify", str(dst))
    assert failed.returncode == 2 and "rank_2/checkpoint_2.pt" in failed.stderr and "truncated" in failed.stderr


@pytest.mark.slow
def test_bad_arguments_are_reported_not_raised(source_3: Path, tmp_path: Path):
    done = cli(
        "reshard",
        "--src-checkpoints-dir",
        str(tmp_path / "missing"),
        "--dst-checkpoints-dir",
        str(tmp_path / "o"),
        "--dst-strategy-file",
        str(tmp_path / "x.json"),
    )
    assert done.returncode == 2 and "error: src_checkpoints_dir=" in done.stderr and "is not a folder" in done.stderr


def test_sizes():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
