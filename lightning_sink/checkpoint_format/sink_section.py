"""The ``lightning_sink`` section of a Lightning checkpoint, as the file formats see it: its name, and the one record
that belongs to a ``.ckpt`` file only (the digests of that file's tensors), which a conversion to other files does
not carry. Here so that the resharding code needs nothing from the strategies (which import Lightning)."""

from __future__ import annotations

from typing import Any

__all__ = ["CHECKPOINT_KEY", "DIGESTS_FIELD", "drop_tensor_digests"]

CHECKPOINT_KEY = "lightning_sink"
DIGESTS_FIELD = "tensor_digests"  # in the section: {"sha256": {where: hex digest}} (strategies/tensor_digests.py)


def drop_tensor_digests(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's metadata without its ``.ckpt`` tensor digests, which describe that file's tensors and not
    the files a conversion writes (they have their own: ``SAVE_DIGESTS.json``, manifests, sidecars)."""
    section = checkpoint.get(CHECKPOINT_KEY)
    if isinstance(section, dict) and DIGESTS_FIELD in section:
        checkpoint = {**checkpoint, CHECKPOINT_KEY: {k: v for k, v in section.items() if k != DIGESTS_FIELD}}
    return checkpoint
