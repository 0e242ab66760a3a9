"""Writes that fail (a full disk, a file-size limit) name their file in one line, and leave no staging folder
(issue 31, item 8). The disk "fills up" through a file-size limit in a subprocess (``RLIMIT_FSIZE``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_subprocess_env
from tests.reshard.test_cli_failures import assert_one_error_line, cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_source_save_on_a_full_disk_names_the_folder_and_leaves_no_staging(tmp_path: Path):
    """The save ``ReshardCheckpoint`` makes of its source: a raw multi-line ``CheckpointException`` before, and a
    ``.ckpt.staging`` folder left behind until the next save."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_format.full_disk_save", str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.stdout.strip() == (
        f"OSError: could not write the checkpoint into {str(tmp_path / '.ckpt.staging')!r}: the file reached this"
        " process's file-size limit (4096 bytes)"
    ), done.stdout + done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_layout_output_on_a_full_disk_names_the_file(tmp_path: Path):
    output = tmp_path / "layout.json"
    done = cli(
        "layout",
        "--model",
        "tests.strategies.mp_models.TPClassifier",
        "--data-parallel-size",
        "1",
        "--tensor-parallel-size",
        "1",
        "--output",
        str(output),
        file_size_limit=64,
    )
    assert_one_error_line(done, f"could not write layout file {str(output)!r}", "file-size limit")
    assert list(tmp_path.iterdir()) == []
