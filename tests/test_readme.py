"""The README's first-run example, executed as written: a user copies it and it must train as the text says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
LOSS_LINE = re.compile(r"^epoch: (\d+) step: (\d+), loss is (\S+)$", re.MULTILINE)


def first_run_code() -> str:
    section = README.read_text().split("## A first run", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_first_run_example_trains_as_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(first_run_code(), str(README), "exec"), namespace)  # the README's own text, nothing else
    trainer = namespace["trainer"]
    assert trainer.global_step == 12  # "trainer.global_step ends at 12": 3 sinks x 16 micro-batches / 4
    lines = LOSS_LINE.findall(capsys.readouterr().out)
    assert [(epoch, step) for epoch, step, _ in lines] == [("1", "16"), ("2", "16"), ("3", "16")]  # one per sink
    assert all(0.0 < float(loss) < 10.0 for _, _, loss in lines)
    precision = trainer.precision_plugin
    assert type(precision).__name__ == "LossScalePrecision" and precision.skipped_updates == 0


def test_the_readme_stays_within_its_10_kb_budget() -> None:
    assert len(README.read_bytes()) < 10_000  # the front page; details belong in docs/


def quick_start_commands() -> list[str]:
    section = README.read_text().split("## Install and quick start", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).strip().splitlines()


def test_ci_runs_exactly_the_readmes_two_commands() -> None:
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    commands = quick_start_commands()
    assert len(commands) == 2
    for command in commands:  # as written, or handed to the script's pytest wrapper (exit status 5 is a failure)
        assert any(line == command or line == f"run_pytest {command}" for line in ci), command


def test_the_install_shows_pips_progress() -> None:
    install = quick_start_commands()[0]
    assert "pip install" in install
    assert not re.search(r"pip install[^&]*\s(-q|--quiet)\b", install)  # a quiet install prints nothing for minutes
