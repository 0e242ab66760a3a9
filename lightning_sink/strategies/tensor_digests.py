"""The SHA-256 of every tensor a sink strategy saves in a ``.ckpt``, checked when the checkpoint is loaded.

``torch.load`` does not check the bytes of a tensor: a flipped byte in a ``.ckpt`` loads as a changed weight, the
fit goes on from it, and ``ModelCheckpoint`` then writes the corruption into every later checkpoint. The sink
strategies record, in the checkpoint's ``lightning_sink`` section, a digest of each tensor in the checkpoint (the
model's, the optimizers', the loops' and their own: every tensor but the digests), keyed by where it sits
(``state_dict['net.0.weight']``). Loading refuses a checkpoint whose tensors do not match, naming the file and the
tensor, before anything is restored or trained, so nothing is overwritten.

A checkpoint without the record (stock Lightning's, or saved with ``checkpoint_digests=False``) loads as before.
The record is plain strings: whoever can rewrite the file can rewrite it too. It finds damage, not forgery.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lightning_sink.checkpoint_format.sink_section import DIGESTS_FIELD

__all__ = [
    "DIGESTS_FIELD",
    "MAX_DEPTH",
    "NestedTooDeep",
    "tensor_digests",
    "add_tensor_digests",
    "check_tensor_digests",
]

_ALGORITHM = "sha256"


# Far deeper than any checkpoint nests its containers (a state dict a handful of levels); each level's path grows
# by a step, so an unbounded depth would make the paths alone cost the square of the file's size.
MAX_DEPTH = 100


class NestedTooDeep(ValueError):
    """A checkpoint's containers nest deeper than ``MAX_DEPTH``."""


def _tensors(node: object, where: str) -> Iterator[tuple[str, Tensor]]:
    """Each tensor in ``node`` and where it sits, depth first in the containers' order (without recursion, and one
    container's children made one at a time: nothing per reference stays behind for the garbage collector)."""
    stack: list[Iterator[tuple[str, object]]] = [iter([(where, node)])]
    while stack:
        for where, node in stack[-1]:
            if isinstance(node, Tensor):
                yield where, node
            elif isinstance(node, (dict, list, tuple)):
                if len(stack) > MAX_DEPTH:
                    raise NestedTooDeep(f"{where} nests containers more than {MAX_DEPTH} deep")
                stack.append(_children(node, where))
                break
        else:
            stack.pop()


def _children(node: dict | list | tuple, where: str) -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        return ((f"{where}[{key!r}]" if where else str(key), value) for key, value in node.items())
    return ((f"{where}[{index}]", value) for index, value in enumerate(node))


def _digest(tensor: Tensor) -> str:
    """Of the tensor's dtype, shape and element bytes (not of the storage it may share with others)."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.layout == torch.strided and not tensor.is_quantized and tensor.numel() > 0:
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def tensor_digests(checkpoint: dict[str, Any], section: str) -> dict[str, str]:
    """Where each tensor of ``checkpoint`` sits and its digest (the digests' own field in ``section`` left out)."""
    return dict(_digested(checkpoint, section))


def _digested(checkpoint: dict[str, Any], section: str) -> Iterator[tuple[str, str]]:
    """Each tensor's place and digest, one at a time.

    A file can hold a million references to one small tensor for a few bytes each (the pickle's memo): each
    distinct tensor - each object, and among objects each view of the same memory - is hashed once, so the digests
    cost time in proportion to the file's bytes, not to the references in it."""
    own = checkpoint.get(section)
    by_object: dict[int, str] = {}  # (the objects stay alive in ``checkpoint`` meanwhile: their ids are theirs)
    by_view: dict[tuple, str] = {}
    for key, value in checkpoint.items():
        if key == section and isinstance(own, dict):
            value = {name: item for name, item in own.items() if name != DIGESTS_FIELD}
        for where, tensor in _tensors(value, str(key)):
            digest = by_object.get(id(tensor))
            if digest is None:
                view = _view(tensor)
                digest = by_view.get(view) if view is not None else None
                if digest is None:
                    digest = _digest(tensor)
                    if view is not None:
                        by_view[view] = digest
                by_object[id(tensor)] = digest
            yield where, digest


def _view(tensor: Tensor) -> tuple | None:
    """What makes two tensors' digests equal without reading them: the same memory read the same way (None for a
    layout whose elements this does not describe)."""
    if tensor.layout != torch.strided or tensor.is_quantized:
        return None
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
        tensor.is_conj(),
        tensor.is_neg(),
    )


def add_tensor_digests(checkpoint: dict[str, Any], section: str) -> None:
    """Record the digests in ``checkpoint[section]`` (the checkpoint about to be saved)."""
    checkpoint[section][DIGESTS_FIELD] = {_ALGORITHM: tensor_digests(checkpoint, section)}


def check_tensor_digests(checkpoint: dict[str, Any], section: str, checkpoint_path: Any) -> None:
    """Refuse (ValueError naming the file and the tensor) a loaded checkpoint whose tensors differ from the recorded
    digests, or that gained or lost a tensor. A checkpoint without a record passes."""
    own = checkpoint.get(section)
    if not isinstance(own, dict) or DIGESTS_FIELD not in own:
        return
    record = own[DIGESTS_FIELD]
    recorded = record.get(_ALGORITHM) if isinstance(record, dict) else None
    if not isinstance(recorded, dict) or not all(
        isinstance(where, str) and isinstance(digest, str) for where, digest in recorded.items()
    ):
        raise ValueError(
            f"{checkpoint_path}: the checkpoint's '{section}' state is not valid: {DIGESTS_FIELD} is not"
            f" {{'{_ALGORITHM}': {{tensor: hex digest}}}}"
        )
    try:
        seen: set[str] = set()
        for where, digest in _digested(checkpoint, section):  # refused at the first tensor that differs
            if where not in recorded:
                raise ValueError(f"{checkpoint_path}: tensor {where} is not one the checkpoint was saved with")
            if recorded[where] != digest:
                raise ValueError(
                    f"{checkpoint_path}: tensor {where} is damaged: its bytes differ from the SHA-256 saved with it"
                    " (the file changed after it was written). Resume from another checkpoint, or, for a file edited"
                    " on purpose (weights averaged, pruned), load it with checkpoint_digests=False."
                )
            seen.add(where)
    except NestedTooDeep as error:
        raise ValueError(f"{checkpoint_path}: {error}") from None
    if len(seen) != len(recorded):
        missing = sorted(set(recorded) - seen)
        raise ValueError(f"{checkpoint_path}: tensor {missing[0]} the checkpoint was saved with is missing")
