"""Saving (atomically) and loading (validated) layout files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lightning_sink.layout.bounded_json import loads_bounded
from lightning_sink.layout.schema import LAYOUT_FILE_NAME, Layout
from lightning_sink.layout.validation import validate_layout

__all__ = ["save_layout", "load_layout", "resolve_layout_path"]


def resolve_layout_path(path: str | os.PathLike) -> Path:
    """A layout file, or a folder holding ``layout.json``."""
    path = Path(path)
    return path / LAYOUT_FILE_NAME if path.is_dir() else path


def save_layout(layout: Layout, path: str | os.PathLike) -> Path:
    """Validate, then write to a temp file beside ``path`` and ``os.replace`` it: a crash leaves the old file."""
    path = resolve_layout_path(path)
    validate_layout(layout, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(layout.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp makes it private; a layout file is shared like the checkpoint
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return path


def load_layout(path: str | os.PathLike) -> Layout:
    """Read and validate a layout file (or ``<folder>/layout.json``); errors name the file and the tensor."""
    path = resolve_layout_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"layout file {str(path)!r} does not exist")
    data = loads_bounded(path.read_bytes(), f"layout file {str(path)!r}")
    try:
        layout = Layout.from_dict(data)
    except ValueError as error:
        raise ValueError(f"layout file {str(path)!r}: {error}") from None
    return validate_layout(layout, f"layout file {str(path)!r}")
