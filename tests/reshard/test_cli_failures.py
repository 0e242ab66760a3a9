"""``lightning-sink`` on bad input, bad arguments and a full disk: one ``error: ...`` line naming the file, exit
status 2, nothing left behind. Every command runs as a real subprocess."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_sink.layout import (
    Chunk,
    Layout,
    MeshLayout,
    TensorLayout,
    layout_on_mesh,
    load_layout,
    save_layout,
)
from tests.conftest import clean_subprocess_env
from tests.reshard.conftest import rows

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, file_size_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit_file_size() -> None:  # a disk that fills up after ``file_size_limit`` bytes of any one file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    env = clean_subprocess_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "lightning_sink.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size if file_size_limit else None,
    )


def assert_one_error_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def two_ranks_file(source_3: Path, tmp_path: Path) -> Path:
    return save_layout(
        layout_on_mesh(load_layout(source_3), MeshLayout.one_dimensional(2), rows), tmp_path / "two.json"
    )


def reshard(source: Path, dst: Path, layout: Path, *more: str, **kwargs) -> subprocess.CompletedProcess:
    return cli(
        "reshard",
        "--src-checkpoints-dir",
        str(source),
        "--dst-checkpoints-dir",
        str(dst),
        "--dst-strategy-file",
        str(layout),
        "--no-progress",
        *more,
        **kwargs,
    )


def nothing_left(tmp_path: Path, name: str = "out") -> bool:
    return not (tmp_path / name).exists() and not list(tmp_path.glob(f".{name}.*"))


# ---------------------------------------------------------------- item 7: bad input is one line, never a traceback
@pytest.mark.slow
@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: json.dumps({**d, "tensors": ["state_dict.w"]}), id="tensors-a-list"),
        pytest.param(lambda d: json.dumps({**d, "tensors": "state_dict.w"}), id="tensors-a-string"),
        pytest.param(lambda d: "[" * 50000 + "]" * 50000, id="nested-50000-deep"),
    ],
)
def test_a_damaged_layout_file_is_one_error_line(source_3: Path, two_ranks_file: Path, tmp_path: Path, damage):
    bad = tmp_path / "bad_layout.json"
    bad.write_text(damage(json.loads(two_ranks_file.read_text())))
    assert_one_error_line(reshard(source_3, tmp_path / "out", bad), "bad_layout.json")
    assert nothing_left(tmp_path)


@pytest.mark.slow
def test_a_ten_to_the_eighteen_element_shape_is_one_error_line(tmp_path: Path):
    source = tmp_path / "src"
    (source / "rank_0").mkdir(parents=True)
    torch.save({"w": torch.zeros(4)}, source / "rank_0" / "model.pt")
    huge = TensorLayout(
        role="parameter",
        global_shape=(10**18,),
        dtype="float32",
        placements=("Replicate()",),
        chunks=(Chunk(0, (0,), (10**18,)),),
    )
    layout = save_layout(
        Layout(world_size=1, mesh=MeshLayout.one_dimensional(1), tensors={"w": huge}), source / "layout.json"
    )
    assert_one_error_line(reshard(source, tmp_path / "out", layout), "model.pt", "4000000000000000000 bytes")
    assert nothing_left(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["--workers", "2"]])
def test_a_full_disk_is_said_in_words_before_writing(source_3: Path, two_ranks_file: Path, tmp_path: Path, workers):
    """A file-size limit below a rank file's size: refused before any rank file is written, nothing left."""
    done = reshard(source_3, tmp_path / "out", two_ranks_file, *workers, file_size_limit=2048)
    assert_one_error_line(done, "resharded checkpoint", "out'", "exceeds this process's file-size limit of 2048 bytes")
    assert nothing_left(tmp_path)


@pytest.mark.slow
def test_a_disk_that_fills_up_while_writing_is_one_error_line(source_3: Path, two_ranks_file: Path, tmp_path: Path):
    """A file-size limit one byte below the largest rank file: whether the size check before writing catches it or
    the write itself fails, the user reads one line in words, and the staging folder is gone."""
    reference = tmp_path / "reference"
    assert reshard(source_3, reference, two_ranks_file).returncode == 0
    largest = max(path.stat().st_size for path in reference.glob("rank_*/*.pt"))
    done = reshard(source_3, tmp_path / "out", two_ranks_file, file_size_limit=largest - 1)
    assert_one_error_line(done, "file-size limit")
    assert nothing_left(tmp_path)


@pytest.mark.slow
def test_an_unknown_model_class_is_one_error_line(tmp_path: Path):
    done = cli(
        "layout",
        "--model",
        "lightning_sink.NoSuchClass",
        "--data-parallel-size",
        "1",
        "--tensor-parallel-size",
        "1",
        "--output",
        str(tmp_path / "layout.json"),
    )
    assert_one_error_line(done, "'lightning_sink' has no attribute 'NoSuchClass'")
    assert not (tmp_path / "layout.json").exists()


# ---------------------------------------------------------------- item 8: arguments checked when parsed
@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--list-ranks"], "--list-ranks needs --rank-id"),
        (["--memory-budget", "4GiB"], "--memory-budget caps the number of --workers: pass --workers too"),
        (["--workers", "0"], "invalid count '0'"),
        (["--ckpt-prefix", ".."], "--ckpt-prefix='..' must be a plain file-name prefix"),
    ],
)
def test_arguments_that_would_be_ignored_or_fail_late_are_refused_at_parse_time(
    source_3: Path, two_ranks_file: Path, tmp_path: Path, extra, message
):
    done = reshard(source_3, tmp_path / "out", two_ranks_file, *extra)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert nothing_left(tmp_path)


@pytest.mark.slow
def test_a_folder_as_the_rank_file_name_is_named_as_such(source_3: Path, two_ranks_file: Path, tmp_path: Path):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    done = cli(
        "reshard",
        "--src-checkpoints-dir",
        str(source_3),
        "--dst-strategy-file",
        str(two_ranks_file),
        "--rank-id",
        "0",
        "--save-checkpoint-file-name",
        str(folder),
    )
    assert_one_error_line(done, "a_folder' is a folder: name the rank file to write")
    assert list(folder.iterdir()) == []


@pytest.mark.slow
def test_a_wrong_source_layout_is_blamed_on_the_layout_file(source_3: Path, two_ranks_file: Path, tmp_path: Path):
    """A 2-rank layout given for the 3-rank source: the layout file is named, not "DCP metadata"."""
    done = reshard(source_3, tmp_path / "out", two_ranks_file, "--src-strategy-file", str(two_ranks_file))
    assert_one_error_line(
        done, "layout file", "two.json' does not match DCP checkpoint", "saved by 3 ranks, the layout has world size 2"
    )
    assert "DCP metadata" not in done.stderr and nothing_left(tmp_path)


@pytest.mark.slow
def test_verify_of_a_missing_folder_says_it_is_missing(tmp_path: Path):
    done = cli("verify", str(tmp_path / "no_such_folder"))
    assert_one_error_line(done, "no_such_folder' does not exist")
