"""The streamed rank-file writer: a skip_data skeleton filled band by band, hashed behind the writes."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from lightning_sink.reshard.writer import StreamedRankFile


def payload_of(tensors: dict[str, torch.Tensor]) -> dict:
    return {"format": "test", "tensors": {name: torch.empty_like(t) for name, t in tensors.items()}, "extra": {"a": 1}}


def test_a_file_written_in_bands_loads_as_torch_save_would_and_its_digest_is_the_files(tmp_path: Path):
    generator = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(1000, 300, generator=generator), "b": torch.arange(7, dtype=torch.int64),
               "step": torch.tensor(3.5, dtype=torch.bfloat16), "empty": torch.empty(0, 4)}
    path = tmp_path / "rank.pt"
    out = StreamedRankFile(path, payload_of(tensors))
    for name in sorted(tensors, key=out.offset):  # file order
        tensor = tensors[name]
        if tensor.dim() == 0:
            band = out.buffer(tensor.dtype, ())
            band.copy_(tensor)
            out.write_rows(name, 0, band)
            continue
        for first in range(0, tensor.shape[0], 128):  # uneven bands through the one reused buffer
            rows = tensor[first : first + 128]
            band = out.buffer(tensor.dtype, tuple(rows.shape))
            band.copy_(rows)
            out.write_rows(name, first, band)
    digest, size = out.finish()
    assert size == path.stat().st_size
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = torch.load(path, weights_only=True)
    assert loaded["extra"] == {"a": 1} and loaded["format"] == "test"
    assert set(loaded["tensors"]) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded["tensors"][name].dtype == tensor.dtype and torch.equal(loaded["tensors"][name], tensor)


def test_a_tensor_outside_tensors_is_refused_before_anything_is_written(tmp_path: Path):
    payload = payload_of({"w": torch.zeros(3)})
    payload["extra"] = {"nested": [torch.zeros(2)]}
    with pytest.raises(TypeError, match=r"payload\['extra'\]\['nested'\]\[0\] is a tensor"):
        StreamedRankFile(tmp_path / "rank.pt", payload)
    assert not (tmp_path / "rank.pt").exists()


def test_close_after_a_failure_stops_the_hashing_thread(tmp_path: Path):
    before = threading.active_count()
    out = StreamedRankFile(tmp_path / "rank.pt", payload_of({"w": torch.zeros(64, 4)}))
    assert threading.active_count() == before + 1
    with pytest.raises(AssertionError, match="out of order or outside its storage"):
        out.write_rows("w", 60, torch.zeros(8, 4))  # rows 60..67 of a 64-row tensor
    out.close()
    assert threading.active_count() == before
