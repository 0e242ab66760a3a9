"""``LoopStore``: the folder of saved loops. What it returns is exactly what was saved, or nothing: a damaged,
truncated, oversized, foreign or malformed file gives None, never an error; refusals are kept until a save; the
folder keeps the newest ``MAX_SAVED_LOOPS`` keys; a folder that cannot be written gives False; a folder that is not
this user's alone (another's, writable by others, a link) is neither read nor written, and a load reads the folder
it checked."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_sink.compiled import loop_store
from lightning_sink.compiled.loop_store import LoopStore
from lightning_sink.compiled.saved_loop import SavedLoop

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


def test_a_folder_other_users_may_write_to_is_neither_read_nor_written(tmp_path: Path):
    folder = tmp_path / "loops"
    store = LoopStore(folder)
    assert _save(store, "k1") and store.privacy() is None
    folder.chmod(0o775)  # (a group's member could have planted the program and its entry)
    why = store.privacy()
    assert why is not None and str(folder) in why and "775" in why
    assert store.load("k1") is None
    assert not _save(store, "k2") and not (folder / "k2.program").exists()
    store.refuse("k3", "reason")
    assert store.refusal("k3") is None and not (folder / "k3.refused").exists()
    folder.chmod(0o702)
    assert store.load("k1") is None
    folder.chmod(0o755)  # (read by others is no risk: only writing is)
    assert store.load("k1") is not None


def test_a_folder_another_user_owns_is_neither_read_nor_written(tmp_path: Path, monkeypatch):
    folder = tmp_path / "loops"
    store = LoopStore(folder)
    assert _save(store, "k1")
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)  # (this process run as another user than the folder's)
    why = store.privacy()
    assert why is not None and f"user id {owner}" in why
    assert store.load("k1") is None and not _save(store, "k2")
    monkeypatch.undo()
    assert store.load("k1") is not None


def test_a_link_in_place_of_the_folder_is_not_followed(tmp_path: Path):
    real = LoopStore(tmp_path / "real")
    assert _save(real, "k1")
    (tmp_path / "loops").symlink_to(tmp_path / "real")
    store = LoopStore(tmp_path / "loops")
    why = store.privacy()
    assert why is not None and "not a folder" in why
    assert store.load("k1") is None and not _save(store, "k2")
    assert not (tmp_path / "real" / "k2.program").exists()


def test_the_folder_is_made_for_this_user_alone_whatever_the_umask(tmp_path: Path):
    before = os.umask(0)
    try:
        assert _save(LoopStore(tmp_path / "cache" / "loops"), "k1")
    finally:
        os.umask(before)
    assert (tmp_path / "cache" / "loops").stat().st_mode & 0o777 == 0o700


def test_a_load_reads_the_folder_it_checked_even_when_another_is_swapped_in(tmp_path: Path, monkeypatch):
    folder = tmp_path / "loops"
    assert _save(LoopStore(folder), "k1", b"checked program")
    assert _save(LoopStore(tmp_path / "planted"), "k1", b"planted program")
    checked = loop_store._not_private

    def swap_after_the_check(path: Path, info: os.stat_result) -> str | None:
        why = checked(path, info)
        folder.rename(tmp_path / "moved")
        (tmp_path / "planted").rename(folder)  # (a folder swapped in between the check and the reads)
        return why

    monkeypatch.setattr(loop_store, "_not_private", swap_after_the_check)
    stored = LoopStore(folder).load("k1")
    assert stored is not None and stored.program == b"checked program"


class _Owner:
    """What ``SavedLoop`` reads of the programs that own the loop: the module and the optimizer."""

    def __init__(self) -> None:
        module = torch.nn.Linear(2, 2)
        self.gradients = SimpleNamespace(module=module)
        self.update = SimpleNamespace(rule=SimpleNamespace(optimizer=torch.optim.SGD(module.parameters(), lr=0.1)))

    def loop(self, state: dict, call: dict) -> None:
        raise AssertionError("not called: the loop compiled as usual runs")


def test_a_fit_beside_a_folder_others_may_write_to_compiles_as_usual_and_says_why(tmp_path: Path):
    folder = tmp_path / "loops"
    folder.mkdir()
    folder.chmod(0o777)
    saved = SavedLoop(_Owner().loop, None, lambda state, call: "compiled as usual", lambda call: None, folder)
    assert saved({}, {}) == "compiled as usual"
    assert saved.note.startswith("; no saved loop is read or written (") and str(folder) in saved.note
    assert not saved.kept and list(folder.iterdir()) == []
