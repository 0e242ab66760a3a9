"""``LoopStore``: the folder of saved loops. What it returns is exactly what was saved, or nothing: a damaged,
truncated, oversized, foreign or malformed file gives None, never an error; refusals are kept until a save; the
folder keeps the newest ``MAX_SAVED_LOOPS`` keys; a folder that cannot be written gives False."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_sink.compiled import loop_store
from lightning_sink.compiled.loop_store import LoopStore

SOURCES = [["net_module", 3, 9, "ab" * 32]]
IDENTITIES = [["G['helper']", "function net_module.helper 0123 ()"]]


def _save(store: LoopStore, key: str, program: bytes = b"program bytes") -> bool:
    return store.save(key, lambda path: path.write_bytes(program), SOURCES, IDENTITIES)


def test_a_saved_loop_reads_back_as_written(tmp_path: Path):
    store = LoopStore(tmp_path / "loops")
    assert store.load("k1") is None
    assert _save(store, "k1")
    stored = store.load("k1")
    assert stored is not None
    assert (stored.program, stored.sources, stored.identities) == (b"program bytes", SOURCES, IDENTITIES)
    assert sorted(path.name for path in (tmp_path / "loops").iterdir()) == ["k1.json", "k1.program"]
    assert store.load("k2") is None


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 1
    path.write_bytes(bytes(data))


def _set(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


DAMAGE = {
    "program byte flipped": lambda folder: _flip(folder / "k1.program"),
    "program truncated": lambda folder: (folder / "k1.program").write_bytes(b"program"),
    "program longer": lambda folder: (folder / "k1.program").write_bytes(b"program bytes and more"),
    "program missing": lambda folder: (folder / "k1.program").unlink(),
    "entry not JSON": lambda folder: (folder / "k1.json").write_text("{not json"),
    "entry a list": lambda folder: (folder / "k1.json").write_text("[1, 2]"),
    "entry of another key": lambda folder: _set(folder / "k1.json", key="k2"),
    "entry of another format": lambda folder: _set(folder / "k1.json", format=loop_store.FORMAT + 1),
    "size not an int": lambda folder: _set(folder / "k1.json", bytes="13"),
    "size too large": lambda folder: _set(folder / "k1.json", bytes=loop_store.MAX_PROGRAM_BYTES + 1),
    "sources malformed": lambda folder: _set(folder / "k1.json", sources=[["net_module", "3", 9, "ab"]]),
    "identities malformed": lambda folder: _set(folder / "k1.json", identities=[["path"]]),
    "entry oversized": lambda folder: (folder / "k1.json").write_text(" " * (loop_store.MAX_ENTRY_BYTES + 1)),
    "entry a FIFO": lambda folder: _replaced(folder / "k1.json", os.mkfifo),
    "entry a link to a copy outside": lambda folder: _linked(folder / "k1.json"),
    "program a link to a copy outside": lambda folder: _linked(folder / "k1.program"),
    "program a FIFO": lambda folder: _replaced(folder / "k1.program", os.mkfifo),
}


def _replaced(path: Path, make: Callable[[Path], None]) -> None:
    path.unlink()
    make(path)


def _linked(path: Path) -> None:
    """``path`` a symbolic link to an identical copy outside the folder (nothing outside it is read)."""
    outside = path.parent.parent / f"outside-{path.name}"
    outside.write_bytes(path.read_bytes())
    _replaced(path, lambda at: at.symlink_to(outside))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_foreign_file_reads_as_nothing(tmp_path: Path, damage: str):
    store = LoopStore(tmp_path / "loops")
    assert _save(store, "k1")
    DAMAGE[damage](tmp_path / "loops")
    assert store.load("k1") is None  # (a FIFO answers at once: nothing blocks)


def test_a_refusal_is_kept_until_the_loop_is_saved(tmp_path: Path):
    store = LoopStore(tmp_path)
    assert store.refusal("k1") is None
    store.refuse("k1", "TypeError: a class defined in a function")
    assert store.refusal("k1") == "TypeError: a class defined in a function"
    assert store.refusal("k2") is None
    (tmp_path / "k2.refused").write_text(
        json.dumps({"format": loop_store.FORMAT, "key": "k2", "reason": ["not", "text"]})
    )
    assert store.refusal("k2") is None
    assert _save(store, "k1")
    assert store.refusal("k1") is None and store.load("k1") is not None


def test_the_folder_keeps_the_newest_keys(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(loop_store, "MAX_SAVED_LOOPS", 3)
    store = LoopStore(tmp_path)
    for index in range(5):
        assert _save(store, f"k{index}")
        for path in tmp_path.glob(f"k{index}.*"):
            os.utime(path, (1000.0 + index, 1000.0 + index))
    store.refuse("k5", "reason")
    assert sorted({path.stem for path in tmp_path.iterdir()}) == ["k3", "k4", "k5"]
    assert not list(tmp_path.glob(".saving-*"))


def test_a_folder_that_cannot_be_written_saves_nothing(tmp_path: Path):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    store = LoopStore(blocked / "loops")
    assert not _save(store, "k1")
    store.refuse("k1", "reason")  # (quietly nothing)
    assert store.load("k1") is None and store.refusal("k1") is None
