"""A DCP ``.metadata`` whose bytes were changed (issue 40, items 2 and 3): its index made inconsistent, or an opcode
turned into one that names a huge memo entry. Each is refused by ``read_dcp_metadata`` in one line naming the
file, before anything reads by the index and before the unpickler sizes anything by the claim."""

from __future__ import annotations

import pickle
import pickletools
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from lightning_sink.layout.dcp_metadata import read_dcp_metadata
from lightning_sink.layout.pickle_claims import pickle_claim_fault


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A one-rank DCP save (stock ``dcp.save``) of two tensors and a non-tensor value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(4.0), "step": 3},
            checkpoint_id=tmp_path / "ckpt",
            no_dist=True,
        )
    return tmp_path / "ckpt"


def rewrite(folder: Path, change) -> None:
    """Change the unpickled metadata in place (as a changed byte in the file would) and write it back."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # the test's own file: plain pickle is fine here
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def renamed(storage: dict, old: MetadataIndex, new: MetadataIndex) -> None:
    storage[new] = storage.pop(old)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # A save by several ranks pickles each name twice (the index's copy came from another rank): one changed
        # byte leaves a value or a chunk without the entry it is looked up by.
        (lambda m: renamed(m.storage_data, MetadataIndex("step"), MetadataIndex("stap")), "'step' has no storage"),
        (
            lambda m: renamed(m.storage_data, MetadataIndex("w", (0, 0)), MetadataIndex("w", (0, 1))),
            r"'w' chunk at offsets \[0, 0\] has no storage",
        ),
        (lambda m: m.planner_data.update({7: ("w",)}), "planner_data is not a map of names"),
    ],
)
def test_an_index_without_its_entries_is_refused_where_it_is_read(folder: Path, change, named: str):
    """It gave ``KeyError: MetadataIndex(fqn=...)`` from the conversion (a traceback), or, for a name that is not a
    string, an output that ``verify`` then refused."""
    rewrite(folder, change)
    with pytest.raises(ValueError, match=rf"DCP metadata file '{folder / '.metadata'}' is malformed: .*{named}"):
        read_dcp_metadata(folder)


def long_binput_at_a_memoize(data: bytes, index: int) -> bytes:
    """The first MEMOIZE opcode turned into LONG_BINPUT of ``index`` (as one changed byte does, the four bytes after
    it then read as the index; here the index is chosen, so that the old code's cost is known)."""
    position = next(pos for opcode, _, pos in pickletools.genops(data) if opcode.name == "MEMOIZE")
    return data[:position] + b"r" + index.to_bytes(4, "little") + data[position + 5 :]


def test_a_memo_index_beyond_the_file_is_refused_before_the_unpickler_sizes_its_memo(folder: Path):
    """Python's unpickler grows its memo to twice the index a LONG_BINPUT names and fills it: one changed byte made
    a 2,886-byte file cost over 3 GiB. Here an index of 2^24 would cost 256 MiB; the file is refused for a few
    KiB."""
    data = (folder / ".metadata").read_bytes()
    (folder / ".metadata").write_bytes(long_binput_at_a_memoize(data, 2**24))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            read_dcp_metadata(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(data) + 2**20, f"{peak} bytes for a {len(data)}-byte file"
    assert f"{folder / '.metadata'}' is unreadable" in str(refused.value)
    assert "memo entry 16777216, beyond what a pickle" in str(refused.value)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_of_every_pickle_protocol_still_reads(folder: Path, protocol: int):
    """The older protocols name memo entries by PUT, BINPUT and LONG_BINPUT (4 and up by MEMOIZE): a true pickle
    of any protocol passes the memo check (protocols 0 and 1 build objects through ``copyreg``, which the metadata
    unpickler never admits)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    metadata.planner_data.update({f"extra.{n}": (f"extra{n}",) for n in range(300)})  # more than 256 memo entries
    data = pickle.dumps(metadata, protocol=protocol)
    assert pickle_claim_fault(data) is None
    if protocol >= 2:
        (folder / ".metadata").write_bytes(data)
        assert set(read_dcp_metadata(folder).state_dict_metadata) == {"w", "b", "step"}


@pytest.mark.parametrize(
    ("data", "fault"),
    [
        (b"(p99\n.", "byte 1 stores memo entry 99, beyond what a pickle of 6 bytes"),
        (b"(p1" + b"0" * 40 + b"\n.", "stores memo entry of more than 32 digits"),
        (b"(r\xff\xff\xff\xff.", "memo entry 4294967295"),
        (b"(q\x05.", None),  # BINPUT: at most 255, nothing to bound
        (b"(\x8c\x02rr\x94.", None),  # an "r" inside a string's bytes is no opcode
        (b"(r", None),  # cut short: the unpickler refuses it, after no memo
        (b"(\x96\x00\x00\x00\x80\x00\x00\x00\x00.", "byte 1 claims 2147483648 bytes, beyond the 1 bytes"),
        (b"\x95\x00\x00\x00\x00\x01\x00\x00\x00.", "starts a frame of 4294967296 bytes"),
        (b"\x8c\x05abc", "claims 5 bytes, beyond the 3 bytes"),
        (b"\xfe(r\xff\xff\xff\xff.", None),  # after a byte that is no opcode the unpickler stops
    ],
)
def test_the_memo_check_reads_opcodes_not_bytes(data: bytes, fault: str | None):
    found = pickle_claim_fault(data)
    assert (found is None) if fault is None else (found is not None and fault in found), found
