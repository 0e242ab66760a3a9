"""A conversion of a DCP folder whose ``.metadata`` lost its consistency (issue 40, items 2, 3, 4 and 8), on the
3-rank checkpoint real gloo processes saved: a changed byte in a name, an opcode turned into a huge memo index, a
name that is not a string, two chunks' storage entries exchanged. Each is one line naming the file, with memory in
proportion to the file, and nothing written; what converts, ``verify`` accepts."""

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

import lightning_sink.reshard.transform as transform_module
from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.checkpoint_format.dcp_load import check_one_save
from lightning_sink.layout import Layout, MeshLayout, layout_on_mesh, load_layout, save_layout
from lightning_sink.reshard import load_resharded_checkpoint, transform_checkpoints, verify_checkpoint
from tests.dcp_runs import full_tensors
from tests.reshard.conftest import SPEC_3, rows
from tests.reshard.test_cli_failures import assert_one_error_line, nothing_left, reshard


def convert(source: Path, layout: Layout, dst: Path):
    return transform_checkpoints(source, dst, "ckpt_", None, layout)


def nothing_written(tmp_path: Path) -> bool:
    return nothing_left(tmp_path, "out")


def change_a_byte_of_a_name(folder: Path) -> None:
    """The first 'meta.epoch' (the name in ``state_dict_metadata``) becomes 'meta.epgch': its storage entry, pickled
    from another rank's copy of the name, keeps the old one."""
    data = bytearray((folder / ".metadata").read_bytes())
    data[data.index(b"meta.epoch") + 7] ^= 0x08
    (folder / ".metadata").write_bytes(bytes(data))


def test_a_changed_byte_in_a_name_is_one_line_naming_the_metadata(source: Path, two_ranks, tmp_path: Path):
    """It was ``KeyError: MetadataIndex(fqn='meta.epgch', ...)`` from the conversion."""
    change_a_byte_of_a_name(source)
    with pytest.raises(ValueError, match=r"\.metadata' is malformed: non-tensor value 'meta.epgch' has no storage"):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path)


@pytest.mark.slow
def test_a_changed_byte_in_a_name_is_one_error_line_from_the_command_line(source: Path, two_ranks, tmp_path: Path):
    change_a_byte_of_a_name(source)
    target = save_layout(two_ranks, tmp_path / "two.json")
    assert_one_error_line(reshard(source, tmp_path / "out", target), str(source / ".metadata"), "'meta.epgch'")
    assert nothing_written(tmp_path)


def a_memoize_turned_long_binput(folder: Path, index: int) -> int:
    """One changed byte turns a MEMOIZE into LONG_BINPUT, whose 4-byte index is then the bytes after it; here they
    are set to ``index`` so that the cost on the old code is known (16 bytes per index). Returns the file's size."""
    data = (folder / ".metadata").read_bytes()
    position = next(pos for opcode, _, pos in pickletools.genops(data) if opcode.name == "MEMOIZE")
    (folder / ".metadata").write_bytes(data[:position] + b"r" + index.to_bytes(4, "little") + data[position + 5 :])
    return len(data)


def test_a_memo_index_is_refused_in_memory_proportional_to_the_file(source: Path, two_ranks, tmp_path: Path):
    """A 2,886-byte ``.metadata`` with one changed byte drove ``lightning-sink reshard`` past 3 GiB in 12 s: the
    unpickler grew its memo to twice the index the byte made. Here an index of 2^24 (256 MiB on the old code)."""
    size = a_memoize_turned_long_binput(source, 2**24)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            convert(source, two_ranks, tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1024 * size + 4 * 2**20, f"{peak} bytes traced for a {size}-byte .metadata"
    assert f"{source / '.metadata'}' is unreadable or not DCP metadata" in str(refused.value)
    assert nothing_written(tmp_path)


@pytest.mark.slow
def test_a_memo_index_is_one_error_line_from_the_command_line(source: Path, two_ranks, tmp_path: Path):
    a_memoize_turned_long_binput(source, 2**31)  # 32 GiB of memo on the old code: refused here for a few KiB
    target = save_layout(two_ranks, tmp_path / "two.json")
    assert_one_error_line(reshard(source, tmp_path / "out", target), str(source / ".metadata"), "memo entry")
    assert nothing_written(tmp_path)


def rewrite_metadata(folder: Path, change) -> None:
    """The folder's metadata changed as damaged bytes would change it (the test's own file: plain pickle here)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    change(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_name_that_is_not_a_string_is_refused_not_converted(source: Path, two_ranks, tmp_path: Path):
    """One flipped bit made a ``planner_data`` name another object: ``reshard`` exited 0, then ``verify`` said
    ``'paths' is not a map of names to list``."""
    rewrite_metadata(source, lambda m: m.planner_data.update({3: m.planner_data.pop("meta.epoch")}))
    with pytest.raises(ValueError, match=r"\.metadata' is malformed: planner_data is not a map of names"):
        convert(source, two_ranks, tmp_path / "out")
    assert nothing_written(tmp_path)


def test_the_writer_refuses_what_verify_would_refuse_before_committing(
    source: Path, two_ranks, tmp_path: Path, monkeypatch
):
    """Whatever a source gets past its own checks, the writer loads the rank file it is writing as ``verify`` does
    and runs the same checks on it before any tensor byte is filled: here a source whose key paths are tuples
    (``verify``: "'paths' is not a map of names to list")."""
    opened = transform_module.open_source

    def with_tuple_paths(*args, **kwargs):
        found = opened(*args, **kwargs)
        found.paths = {fqn: tuple(path) for fqn, path in found.paths.items()}
        return found

    monkeypatch.setattr(transform_module, "open_source", with_tuple_paths)
    with pytest.raises(ValueError) as refused:
        convert(source, two_ranks, tmp_path / "out")
    message = str(refused.value)
    assert f"DCP checkpoint {str(source)!r} converts to a file that verify refuses" in message, message
    assert "'paths' is not a map of names to list" in message and "\n" not in message
    assert nothing_written(tmp_path)


# ------------------------------------------------------------------ item 8: chunks' storage entries exchanged
def exchange_entries(folder: Path, first: MetadataIndex, second: MetadataIndex) -> None:
    """Two equal-size chunks' storage entries (file, offset, length) exchanged in ``.metadata``."""

    def exchange(metadata) -> None:
        storage = metadata.storage_data
        storage[first], storage[second] = storage[second], storage[first]

    rewrite_metadata(folder, exchange)


def test_exchanged_chunks_of_a_stock_folder_convert_to_exchanged_values_as_dcp_loads_them(
    source: Path, two_ranks, tmp_path: Path
):
    """What the docs say (resharding.md, "Not detectable"): a stock DCP folder records nothing that ties a record to
    its place; two chunks of one size and dtype in one rank's files are records of the same size, each CRC-32-valid.
    The conversion reads them where the metadata says, and so does DCP's own load."""
    weight, moment = "state_dict.w", "optimizer_0.state.w.exp_avg"  # both [10, 4] float32; rank 0 holds rows 0-3
    exchange_entries(source, MetadataIndex(weight, (0, 0)), MetadataIndex(moment, (0, 0)))
    convert(source, two_ranks, tmp_path / "out")
    verify_checkpoint(tmp_path / "out")
    expected = full_tensors(SPEC_3, seed=1)
    rank_0 = load_resharded_checkpoint(tmp_path / "out" / "rank_0" / "ckpt_0.pt")["tensors"]
    assert torch.equal(rank_0[weight][:4], expected[moment][:4])
    assert torch.equal(rank_0[moment][:4], expected[weight][:4])
    loaded = {"state_dict": {"w": torch.zeros(10, 4)}, "optimizer_0": {"state": {"w": {"exp_avg": torch.zeros(10, 4)}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, checkpoint_id=source, no_dist=True)
    assert torch.equal(loaded["state_dict"]["w"][:4], expected[moment][:4])


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A folder this package saved (with SAVE_DIGESTS.json): two tensors of the same size and dtype."""
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": -torch.arange(6.0).reshape(2, 3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_dcp_atomically(state, {"epoch": 1}, tmp_path / "saved", global_rank=0, world_size=1, barrier=lambda: None)
    return tmp_path / "saved"


def test_exchanged_chunks_of_this_packages_save_are_refused(saved: Path, tmp_path: Path):
    """Its SAVE_DIGESTS.json records the ``.metadata`` it wrote: a conversion and a resume refuse the folder."""
    exchange_entries(saved, MetadataIndex("a", (0, 0)), MetadataIndex("b", (0, 0)))
    target = layout_on_mesh(load_layout(saved), MeshLayout.one_dimensional(2), rows)
    with pytest.raises(ValueError, match=r"\.metadata' does not belong to this save"):
        convert(saved, target, tmp_path / "out")
    assert nothing_written(tmp_path)
    with pytest.raises(ValueError, match=r"\.metadata' does not belong to this save"):
        check_one_save(saved)  # the resume's check, before anything is loaded
