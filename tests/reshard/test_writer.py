"""The streamed rank-file writer: a skip_data skeleton, produced front to back through two windows that
background threads write (O_DIRECT where allowed) and hash."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from lightning_sink.reshard import writer
from lightning_sink.reshard.writer import StreamedRankFile


def payload_of(tensors: dict[str, torch.Tensor]) -> dict:
    return {"format": "test", "tensors": {name: torch.empty_like(t) for name, t in tensors.items()}, "extra": {"a": 1}}


def write_in_bands(path: Path, tensors: dict[str, torch.Tensor], rows_per_band: int) -> tuple[str, int]:
    out = StreamedRankFile(path, payload_of(tensors))
    for name in sorted(tensors, key=out.offset):  # file order
        tensor = tensors[name]
        if tensor.dim() == 0:
            out.band(name, 0, ()).copy_(tensor)
            continue
        for first in range(0, tensor.shape[0], rows_per_band):  # uneven bands
            rows = tensor[first : first + rows_per_band]
            out.band(name, first, tuple(rows.shape)).copy_(rows)
    return out.finish()


def check_file(path: Path, tensors: dict[str, torch.Tensor], digest: str, size: int) -> None:
    assert size == path.stat().st_size
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = torch.load(path, weights_only=True)
    assert loaded["extra"] == {"a": 1} and loaded["format"] == "test"
    assert set(loaded["tensors"]) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded["tensors"][name].dtype == tensor.dtype and torch.equal(loaded["tensors"][name], tensor)


def mixed_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(1000, 300, generator=generator),
        "b": torch.arange(7, dtype=torch.int64),
        "step": torch.tensor(3.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "v": torch.randn(4097, generator=generator).to(torch.float16),
    }


def test_a_file_written_in_bands_loads_as_torch_save_would_and_its_digest_is_the_files(tmp_path: Path):
    tensors = mixed_tensors()
    path = tmp_path / "rank.pt"
    digest, size = write_in_bands(path, tensors, rows_per_band=128)
    check_file(path, tensors, digest, size)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_small_windows_flush_many_times_and_carry_partial_blocks(tmp_path: Path, monkeypatch, direct: bool):
    """Windows far smaller than the file: every band and header crosses window and block boundaries, bands
    larger than a window grow it, and the file is the same with direct and with page-cache writes."""
    monkeypatch.setattr(writer, "MIN_WINDOW_BYTES", 3 * writer.ALIGN)
    if not direct:
        monkeypatch.delattr(writer.os, "O_DIRECT", raising=False)
    tensors = mixed_tensors()
    path = tmp_path / "rank.pt"
    digest, size = write_in_bands(path, tensors, rows_per_band=37)  # 37 rows of w: 44,400 bytes > a window
    check_file(path, tensors, digest, size)


def test_a_tensor_outside_tensors_is_refused_before_anything_is_written(tmp_path: Path):
    payload = payload_of({"w": torch.zeros(3)})
    payload["extra"] = {"nested": [torch.zeros(2)]}
    with pytest.raises(TypeError, match=r"payload\['extra'\]\['nested'\]\[0\] is a tensor"):
        StreamedRankFile(tmp_path / "rank.pt", payload)
    assert not (tmp_path / "rank.pt").exists()


def test_bands_out_of_order_or_missing_are_refused_and_close_stops_the_threads(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(writer, "MIN_WINDOW_BYTES", writer.ALIGN)  # so that the writer and hasher threads start
    before = threading.active_count()
    out = StreamedRankFile(tmp_path / "rank.pt", payload_of({"w": torch.zeros(4096, 4), "b": torch.zeros(8)}))
    with pytest.raises(AssertionError, match="out of order or outside its storage"):
        out.band("w", 4090, (8, 4))  # rows 4090..4097 of a 4096-row tensor
    out.band("w", 0, (2048, 4))
    out.band("w", 2048, (1024, 4))
    assert threading.active_count() == before + 2
    with pytest.raises(AssertionError, match="belong to a tensor no band wrote"):
        out.finish()  # rows 3072.. of w were never written
    out.close()
    assert threading.active_count() == before
