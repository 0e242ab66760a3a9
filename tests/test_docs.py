"""The documentation covers every public class, callback and CLI command, and refers only to what the repository
contains."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_sink
import lightning_sink.callbacks
from lightning_sink.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
DOCS = "\n".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
# Material a reader of the repository does not have: development notes, design cards, session logs.
INTERNAL = re.compile(r"\bseeds? ?0\d\d\b|design card|DESIGN\.md|this session|been lent|notes/README", re.IGNORECASE)


@pytest.mark.parametrize(
    "name", [n for n in lightning_sink.__all__ if not n.startswith("__")] + list(lightning_sink.callbacks.__all__)
)
def test_every_public_name_has_documentation(name: str) -> None:
    assert re.search(rf"`[\w.]*\b{name}\b", DOCS), f"{name} is public but no page in docs/ names it"


def test_every_cli_command_has_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    commands = re.search(r"\{([a-z_,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert set(commands) == {"layout", "reshard", "verify"}
    for command in commands:
        assert f"lightning-sink {command}" in DOCS, f"`lightning-sink {command}` is not documented in docs/"


def test_no_reference_to_material_outside_the_repository() -> None:
    files = [
        path
        for pattern in ("*.py", "*.md", "*.yaml", "*.toml")
        for path in REPO.rglob(pattern)
        if not any(part.startswith(".") for part in path.relative_to(REPO).parts) and path != Path(__file__).resolve()
    ]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert found == []
