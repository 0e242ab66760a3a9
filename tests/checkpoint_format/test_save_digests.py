"""``SAVE_DIGESTS.json`` names the damaged tensor, and is itself a file from untrusted hands.

A DCP folder saved by this package records, per file, the SHA-256 of each record DCP stored in it (byte ranges from
DCP's ``.metadata``); a file that fails its digest is refused naming the tensor whose bytes changed. A digests file
that is hostile (not JSON, huge, wrong types, records outside their file, names that are not files of the folder)
is one ValueError naming it, checked with DCP's own metadata reader as the reference for where records lie."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.checkpoint_format.dcp_load import check_one_save
from lightning_sink.checkpoint_format.save_digests import check_save_digests

DIGESTS = "SAVE_DIGESTS.json"


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    state = {
        "state_dict": {"w": torch.randn(16, 8), "b": torch.randn(8)},
        "optimizer_0": {"state": {"w": {"exp_avg": torch.randn(16, 8)}}, "step": 3},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_dcp_atomically(state, {"epoch": 1}, tmp_path / "ckpt", global_rank=0, world_size=1, barrier=lambda: None)
    return tmp_path / "ckpt"


def record_of(folder: Path, fqn: str):
    """Where DCP's own reader says ``fqn``'s (first) record lies: (file, start, length, offsets)."""
    metadata = FileSystemReader(folder).read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    return info.relative_path, info.offset, info.length, index.offset


def flip(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fqn", ["state_dict.w", "state_dict.b", "optimizer_0.state.w.exp_avg"])
def test_a_flipped_byte_names_the_tensor_it_lies_in(saved, fqn):
    file, start, length, offsets = record_of(saved, fqn)
    flip(saved / file, start + length // 2)
    expected = (
        rf"checkpoint folder '.*ckpt': file '.*ckpt/{file}' does not belong to this save: tensor '{fqn}' \(chunk at"
        rf" offsets \[{', '.join(map(str, offsets))}\], bytes {start}-{start + length}\) differs from its SHA-256"
    )
    with pytest.raises(ValueError, match=expected):
        check_one_save(saved)
    with pytest.raises(ValueError, match=rf"file '.*{file}' does not belong to this save: tensor '{fqn}'"):
        check_save_digests(saved, [file], "conversion source")  # (what a conversion of the folder checks)


def test_a_flipped_byte_in_a_non_tensor_value_names_it(saved):
    file, start, length, _ = record_of(saved, "optimizer_0.step")
    flip(saved / file, start + length // 2)
    with pytest.raises(ValueError, match=r"non-tensor value 'optimizer_0.step' \(bytes \d+-\d+\) differs"):
        check_one_save(saved)


def test_an_undamaged_save_passes_and_stock_folders_are_not_checked(saved):
    check_one_save(saved)
    os.unlink(saved / DIGESTS)
    flip(saved / "__0_0.distcp", 100)
    check_one_save(saved)  # nothing recorded, nothing to check against (as before)


def test_files_recorded_whole_are_refused_naming_the_file(saved):
    flip(saved / "meta.pt", (saved / "meta.pt").stat().st_size // 2)
    with pytest.raises(ValueError, match=r"file '.*ckpt/meta.pt' does not belong to this save: its SHA-256 differs"):
        check_one_save(saved)


def test_a_version_1_digests_file_is_still_read(saved):
    # (version 1, written before the records: every file recorded whole)
    files = {
        path.name: {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size}
        for path in saved.iterdir()
        if path.name != DIGESTS
    }
    document = {"format": "lightning-sink-save-digests", "version": 1, "files": files}
    (saved / DIGESTS).write_text(json.dumps(document))
    check_one_save(saved)
    flip(saved / "__0_0.distcp", 100)
    with pytest.raises(ValueError, match=r"__0_0.distcp' does not belong to this save: its SHA-256 differs"):
        check_one_save(saved)


def rewrite(folder: Path, change) -> None:
    document = json.loads((folder / DIGESTS).read_text())
    change(document)
    (folder / DIGESTS).write_text(json.dumps(document))


def shard(document: dict) -> dict:
    return document["files"]["__0_0.distcp"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda d: shard(d)["records"][-1].update(length=10**18), "lies outside the file's"),
        (lambda d: shard(d)["records"][1].update(start=0), "does not follow the one before it"),
        (lambda d: shard(d)["records"][0].update(length=0), "is empty"),
        (lambda d: shard(d)["records"].pop(), "the file's \\d+ bytes are not all covered"),
        (lambda d: shard(d).pop("records"), "has neither 'records' nor a 'sha256'"),
        (lambda d: shard(d)["records"][0].update(start=-1), "'start' and 'length' \\(counts\\)"),
        (lambda d: shard(d)["records"][0].update(length=True), "'start' and 'length' \\(counts\\)"),
        (lambda d: shard(d)["records"][0].update(offsets=["0"]), "'offsets' \\(counts or null\\)"),
        (lambda d: shard(d)["records"][0].update(name=7), "needs 'name' \\(a string\\)"),
        (lambda d: shard(d)["records"][0].update(sha256="x" * 64), "'sha256' \\(64 hex digits\\)"),
        (lambda d: shard(d)["records"].append([1, 2]), "record \\d+: not a map"),
        (lambda d: shard(d).update(records={"a": 1}), "'records' is not a list of records"),
        (lambda d: shard(d).update(records=[]), "'records' is not a list of records"),
        (lambda d: shard(d).update(bytes="4479"), "not a record of a file"),
        (lambda d: d["files"].update({"__7_0.distcp": shard(d)}), "records '__7_0.distcp', which is not in the folder"),
        (lambda d: d["files"].update({"../x": shard(d)}), "would escape its folder"),
        (lambda d: d["files"].update({"sub/x": shard(d)}), "'sub/x' is not a file name directly in the folder"),
        (lambda d: d.update(version=3), "version 3 is not one this package reads"),
        (lambda d: d.update(files=[]), "not a 'lightning-sink-save-digests' file"),
    ],
)
def test_a_hostile_digests_file_is_one_line_naming_it(saved, change, reason):
    rewrite(saved, change)
    with pytest.raises(ValueError, match=rf"save digests '.*ckpt/SAVE_DIGESTS.json'.*{reason}") as refused:
        check_one_save(saved)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b'{"format": "lightning-sink-save-digests", "files": {', "is not valid JSON"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"[" * 100 + b"]" * 100, "levels deep"),
    ],
)
def test_a_digests_file_that_is_not_json_is_refused_naming_it(saved, content, reason):
    (saved / DIGESTS).write_bytes(content)
    with pytest.raises(ValueError, match=rf"save digests '.*ckpt/SAVE_DIGESTS.json'.* {reason}"):
        check_one_save(saved)


def test_a_huge_digests_file_is_refused_before_it_is_read_whole(saved):
    with open(saved / DIGESTS, "r+b") as handle:
        handle.truncate(2**30)  # sparse: 1 GiB that takes no disk
    with pytest.raises(ValueError, match=r"save digests .*SAVE_DIGESTS.json' holds more than \d+ bytes; refused"):
        check_one_save(saved)
