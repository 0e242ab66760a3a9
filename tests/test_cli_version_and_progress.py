"""The ``lightning-sink`` command's front: ``--version``, and no progress bar before its arguments are found valid."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from lightning_sink.cli import main


def test_version_prints_the_installed_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"lightning-sink {importlib.metadata.version('lightning-sink')}\n"


@pytest.mark.parametrize("progress", [[], ["--no-progress"]], ids=["progress", "no-progress"])
def test_a_refused_reshard_prints_its_one_error_line_and_no_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], progress: list[str]
) -> None:
    status = main(
        [
            "reshard",
            "--src-checkpoints-dir",
            str(tmp_path / "missing"),
            "--dst-checkpoints-dir",
            str(tmp_path / "out"),
            "--dst-strategy-file",
            str(tmp_path / "missing.json"),
            *progress,
        ]
    )
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
