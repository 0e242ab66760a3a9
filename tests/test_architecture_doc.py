"""docs/architecture.md names only modules and classes that exist: every ``.py`` path it gives is a file of the
repository (a bare file name: a module of the package), and every class name in backticks is a class the package
defines (or one of the few Lightning classes it names)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.strategies import Strategy

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "lightning_sink"
DOC = REPO / "docs" / "architecture.md"
LIGHTNING_CLASSES = {"Strategy": Strategy, "Trainer": pl.Trainer, "LightningModule": pl.LightningModule}


def package_classes() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names.add(node.name)
    return names


def test_every_file_the_architecture_doc_names_exists():
    text = DOC.read_text()
    missing = []
    for path in sorted(set(re.findall(r"[\w/]+\.py\b", text))):
        if "/" in path:
            found = (REPO / path).is_file() or (PACKAGE / path).is_file()
        else:
            found = any(PACKAGE.rglob(path))
        if not found:
            missing.append(path)
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_class_the_architecture_doc_names_exists():
    text = DOC.read_text()
    named = set(re.findall(r"`([A-Z][a-z]+[A-Z][A-Za-z0-9]*|[A-Z][a-z]+)(?=[`.(\[])", text)) - {"None", "True", "False"}
    assert named, "no class names found: the pattern no longer matches the doc"
    missing = sorted(named - package_classes() - set(LIGHTNING_CLASSES))
    assert not missing, f"docs/architecture.md names classes the package does not define: {missing}"
