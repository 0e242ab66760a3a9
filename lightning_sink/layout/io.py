"""Saving (atomically) and loading (validated) layout files."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from lightning_sink.error_text import reason_of
from lightning_sink.layout.bounded_json import MAX_JSON_BYTES, loads_bounded
from lightning_sink.layout.schema import LAYOUT_FILE_NAME, Layout
from lightning_sink.layout.validation import validate_layout
from lightning_sink.regular_file import read_regular

__all__ = ["save_layout", "load_layout", "parse_layout", "resolve_layout_path"]


def resolve_layout_path(path: str | os.PathLike) -> Path:
    """A layout file, or a folder holding ``layout.json``."""
    path = Path(path)
    return path / LAYOUT_FILE_NAME if path.is_dir() else path


def save_layout(layout: Layout, path: str | os.PathLike) -> Path:
    """Validate, then write to a temp file beside ``path`` and ``os.replace`` it: a crash leaves the old file."""
    path = resolve_layout_path(path)
    validate_layout(layout, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor, temp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise OSError(f"could not write layout file {str(path)!r}: {_write_failure(error)}") from None
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(layout.to_json())
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp_name, 0o644)  # mkstemp makes it private; a layout file is shared like the checkpoint
        os.replace(temp_name, path)
    except OSError as error:
        Path(temp_name).unlink(missing_ok=True)
        raise OSError(f"could not write layout file {str(path)!r}: {_write_failure(error)}") from None
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    return path


def _write_failure(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full"
    if error.errno == errno.EFBIG:
        return "the file reached this process's file-size limit"
    return error.strerror or str(error)


def load_layout(path: str | os.PathLike) -> Layout:
    """Read and validate a layout file (or ``<folder>/layout.json``); errors name the file and the tensor."""
    path = resolve_layout_path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"layout file {str(path)!r} does not exist")
    return parse_layout(read_regular(path, MAX_JSON_BYTES, "layout file"), f"layout file {str(path)!r}")


def parse_layout(data: bytes | str, what: str) -> Layout:
    """A layout from untrusted JSON text (a file's, or one embedded in a rank file), validated in full; every
    failure one ValueError starting with ``what``."""
    parsed = loads_bounded(data, what)
    try:
        # any JSON value: from_dict refuses what is not a mapping (one ValueError)
        return validate_layout(Layout.from_dict(cast(Mapping[str, Any], parsed)), what)
    except ValueError as error:
        message = str(error)
        raise ValueError(message if message.startswith(what) else f"{what}: {message}") from None
    except (TypeError, KeyError, AttributeError, IndexError, OverflowError) as error:  # a field of the wrong kind
        raise ValueError(f"{what}: malformed ({type(error).__name__}: {reason_of(error)})") from None
