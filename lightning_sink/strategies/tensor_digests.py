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

__all__ = ["DIGESTS_FIELD", "tensor_digests", "add_tensor_digests", "check_tensor_digests"]

_ALGORITHM = "sha256"


def _tensors(node: object, where: str) -> Iterator[tuple[str, Tensor]]:
    if isinstance(node, Tensor):
        yield where, node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _tensors(value, f"{where}[{key!r}]" if where else str(key))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            yield from _tensors(value, f"{where}[{index}]")


def _digest(tensor: Tensor) -> str:
    """Of the tensor's dtype, shape and element bytes (not of the storage it may share with others)."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.layout == torch.strided and not tensor.is_quantized and tensor.numel() > 0:
        flat = tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().cpu()
        digest.update(flat.view(torch.uint8).numpy().data)
    return digest.hexdigest()


def tensor_digests(checkpoint: dict[str, Any], section: str) -> dict[str, str]:
    """Where each tensor of ``checkpoint`` sits and its digest (the digests' own field in ``section`` left out)."""
    own = checkpoint.get(section)
    digests = {}
    for key, value in checkpoint.items():
        if key == section and isinstance(own, dict):
            value = {name: item for name, item in own.items() if name != DIGESTS_FIELD}
        for where, tensor in _tensors(value, str(key)):
            digests[where] = _digest(tensor)
    return digests


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
    actual = tensor_digests(checkpoint, section)
    for where, digest in actual.items():
        if where not in recorded:
            raise ValueError(f"{checkpoint_path}: tensor {where} is not one the checkpoint was saved with")
        if recorded[where] != digest:
            raise ValueError(
                f"{checkpoint_path}: tensor {where} is damaged: its bytes differ from the SHA-256 saved with it"
                " (the file changed after it was written). Resume from another checkpoint."
            )
    missing = sorted(set(recorded) - set(actual))
    if missing:
        raise ValueError(f"{checkpoint_path}: tensor {missing[0]} the checkpoint was saved with is missing")
