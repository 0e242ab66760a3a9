"""The digest check of a ``.ckpt`` costs time in proportion to its bytes, not to the references in it (issue 40,
item 6): a crafted checkpoint whose random-state list holds 10^5 references to one small tensor (a few bytes each in
the pickle) is checked with one digest of that tensor, and refused at the first reference it was not saved with."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from lightning_sink.strategies import tensor_digests
from lightning_sink.strategies.tensor_digests import MAX_DEPTH, add_tensor_digests, check_tensor_digests

REFERENCES = 10**5


def saved_and_loaded(checkpoint: dict) -> dict:
    """Through ``torch.save`` and ``torch.load(weights_only=True)``, as a resume reads it: the references come back
    as references to one tensor object."""
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.fixture
def digests_made(monkeypatch) -> list[int]:
    """Counts the tensors actually hashed."""
    made: list[int] = []
    digest = tensor_digests._digest

    def counted(tensor):
        made.append(tensor.numel())
        return digest(tensor)

    monkeypatch.setattr(tensor_digests, "_digest", counted)
    return made


def crafted(recorded: bool) -> dict:
    """A sink checkpoint's shape; the random-state list filled with references to one tensor after the digests
    were recorded (``recorded=False``, as a crafted file would be) or before (the record names every reference)."""
    checkpoint = {"state_dict": {"w": torch.randn(3, 3)}, "lightning_sink": {"random": [torch.arange(4.0)]}}
    if recorded:
        checkpoint["lightning_sink"]["random"] *= REFERENCES
        add_tensor_digests(checkpoint, "lightning_sink")
    else:
        add_tensor_digests(checkpoint, "lightning_sink")
        checkpoint["lightning_sink"]["random"] *= REFERENCES
    return saved_and_loaded(checkpoint)


def test_references_not_recorded_are_refused_at_the_first(digests_made: list[int]):
    """It hashed every reference (10^6 took over 90 s) before comparing any."""
    checkpoint = crafted(recorded=False)
    digests_made.clear()
    with pytest.raises(ValueError, match=r"crafted\.ckpt: tensor lightning_sink\['random'\]\[1\] is not one"):
        check_tensor_digests(checkpoint, "lightning_sink", Path("crafted.ckpt"))
    assert len(digests_made) <= 2


def test_recorded_references_cost_one_digest_of_the_tensor(digests_made: list[int]):
    checkpoint = crafted(recorded=True)
    digests_made.clear()
    check_tensor_digests(checkpoint, "lightning_sink", Path("crafted.ckpt"))  # a true record: it passes
    assert sorted(digests_made) == [4, 9]  # the vector once, the weight once


def test_views_of_the_same_memory_are_hashed_once_and_a_damaged_one_is_still_refused(digests_made: list[int]):
    """Distinct tensor objects viewing the same bytes the same way (what torch.load makes of one storage saved
    under several names) share a digest; a view of other bytes of that storage is hashed on its own."""
    storage = torch.arange(8.0)
    checkpoint = {"state_dict": {"a": storage[:4], "b": storage[:4].view(4), "c": storage[4:]}, "lightning_sink": {}}
    add_tensor_digests(checkpoint, "lightning_sink")
    loaded = saved_and_loaded(checkpoint)
    digests_made.clear()
    check_tensor_digests(loaded, "lightning_sink", Path("views.ckpt"))
    assert sorted(digests_made) == [4, 4]  # a and b once, c once
    loaded["state_dict"]["c"][0] += 1
    with pytest.raises(ValueError, match=r"views\.ckpt: tensor state_dict\['c'\] is damaged"):
        check_tensor_digests(loaded, "lightning_sink", Path("views.ckpt"))


def test_containers_nested_beyond_any_checkpoint_are_one_line_naming_the_file():
    """Each level lengthens every path below it: unbounded depth would cost the square of the file's size (and
    overflowed Python's recursion before)."""
    deep: list = []
    node = deep
    for _ in range(MAX_DEPTH * 20):
        node.append([])
        node = node[0]
    checkpoint = {"lightning_sink": {"tensor_digests": {"sha256": {}}}, "loops": deep}
    with pytest.raises(ValueError, match=rf"deep\.ckpt: loops(\[0\])+ nests containers more than {MAX_DEPTH} deep"):
        check_tensor_digests(checkpoint, "lightning_sink", Path("deep.ckpt"))
