"""Every rank resumes from one checkpoint: before anything is loaded, the ranks compare what each would load.

Comparing file names is not enough: on a cluster each node may hold its own copy at the same path (a stale copy of an
earlier run on node-local disk, a ``ckpt_path="last"`` that resolves to another file on another node), and ranks
that load different steps train out of step until a collective hangs or fails on one rank while another exits 0.

So each rank reports the identity of what it would load, in one small collective before anything is loaded:

- a file (a ``.ckpt``): the SHA-256 of its bytes, read in chunks of ``CHUNK_BYTES`` (memory bounded whatever the
  size; the time is one sequential read of the file, which the load then finds in the page cache);
- a folder (a DCP save, a resharded checkpoint): its entries (``agreement.describe_path``) and the SHA-256 of each of
  its small identifying files (DCP's ``.metadata``, ``SAVE_DIGESTS.json``, Lightning's ``meta.pt``,
  ``MANIFEST.json``), never of its shards;
- nothing (no checkpoint resolved on this rank), or nothing at the path.

When the identities differ, a second round gathers each rank's step (read from the checkpoint without loading its
tensors) and every rank raises the same ``CheckpointNotSharedError``, naming which ranks see which step.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_sink.checkpoint_format.agreement import (
    NOT_SHARED_ADVICE,
    CheckpointNotSharedError,
    describe_path,
    gather_from_every_rank,
    host_description,
    ranks_text,
)
from lightning_sink.checkpoint_format.dcp_folder import LIGHTNING_META_FILE
from lightning_sink.checkpoint_format.manifest import MANIFEST_FILE_NAME
from lightning_sink.checkpoint_format.save_digests import SAVE_DIGESTS_FILE
from lightning_sink.error_text import reason_of
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.regular_file import open_regular

__all__ = ["CHUNK_BYTES", "CheckpointIdentity", "agree_on_resume", "checkpoint_identity", "checkpoint_step"]

CHUNK_BYTES = 1 << 20
# The files of a checkpoint folder that say which save it is (the shards are covered by them: DCP's ``.metadata``
# names every shard's byte ranges, the digests file and the manifest every file's SHA-256, ``meta.pt`` the step).
IDENTIFYING_FILES = (DCP_METADATA_FILE, SAVE_DIGESTS_FILE, LIGHTNING_META_FILE, MANIFEST_FILE_NAME)
_NO_CHECKPOINT = "<no checkpoint>"
_NOTHING = "<nothing at the path>"
_SHOWN_GROUPS = 4


@dataclass(frozen=True)
class CheckpointIdentity:
    """What one rank would load: the path it resolved (``None``: none) and the digest of what is there."""

    path: str | None
    digest: str


def _file_digest(path: str | os.PathLike, follow_link: bool) -> str:
    """SHA-256 of a regular file's bytes, in chunks (a link is followed only where ``follow_link``: a ``.ckpt``
    may be Lightning's ``last.ckpt`` link, a file inside a checkpoint folder may not)."""
    target = os.path.realpath(path) if follow_link else path
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with os.fdopen(open_regular(target), "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            digest.update(view[:count])
    return digest.hexdigest()


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for entry in describe_path(folder) or ():
        digest.update(f"entry {entry}\n".encode("utf-8", "surrogateescape"))
    for name in IDENTIFYING_FILES:
        if os.path.lexists(folder / name):
            digest.update(f"file {name} {_file_digest(folder / name, follow_link=False)}\n".encode())
    return digest.hexdigest()


def checkpoint_identity(path: str | os.PathLike | None, hash_file: bool = True) -> CheckpointIdentity:
    """This rank's identity of the checkpoint at ``path`` (an unreadable one is an identity too: the text of why,
    so that the ranks still meet in the same collective and agree on the failure). With ``hash_file=False`` a file
    is identified by its inode, size and modification time instead of its bytes (``agree_on_resume``'s first
    round: equal on every rank, it is one file, on one filesystem or a shared one)."""
    if path is None:
        return CheckpointIdentity(None, _NO_CHECKPOINT)
    where = Path(path)
    try:
        if not os.path.exists(where):
            digest = _NOTHING
        elif where.is_dir():
            digest = _folder_digest(where)
        elif not hash_file:
            found = os.stat(where)
            digest = f"<file: inode {found.st_ino}, {found.st_size} bytes, modified {found.st_mtime_ns}>"
        else:
            digest = _file_digest(where, follow_link=True)
    except (OSError, ValueError) as error:
        digest = f"<unreadable: {reason_of(error)}>"
    return CheckpointIdentity(str(path), digest)


def checkpoint_step(path: str | os.PathLike | None) -> int | None:
    """The ``global_step`` a checkpoint records (``None`` where it cannot be told): of a ``.ckpt``, or of a DCP
    folder's ``meta.pt``. Read with ``mmap`` and ``weights_only``: the tensors stay on disk, no code runs."""
    if path is None:
        return None
    where = Path(path)
    target = where / LIGHTNING_META_FILE if where.is_dir() else where
    try:
        if target.is_symlink() and where.is_dir():
            return None
        loaded: Any = torch.load(target, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # (any failure: the step is only for the error message; the load itself reports the file)
        return None
    step = loaded.get("global_step") if isinstance(loaded, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _what_is_seen(identity: CheckpointIdentity, step: int | None, paths_differ: bool) -> str:
    if identity.path is None:
        return "resolve no checkpoint"
    where = f" {identity.path!r}" if paths_differ else ""
    if identity.digest == _NOTHING:
        return f"see nothing at{where or ' that path'}"
    if identity.digest.startswith("<unreadable"):
        return f"cannot read{where or ' it'} ({identity.digest[1:-1]})"
    at_step = f"step {step}" if step is not None else "an unknown step"
    return f"see{where} {at_step} (SHA-256 {identity.digest[:12]})"


def _gather_identities(own: CheckpointIdentity, world_size: int) -> tuple[list[CheckpointIdentity], list[str]]:
    reports = gather_from_every_rank((host_description(), own), world_size)
    identities = [report[1] if report is not None else CheckpointIdentity(None, "") for report in reports]
    return identities, [report[0] if report is not None else "unknown host" for report in reports]


def agree_on_resume(path: str | os.PathLike | None, world_size: int, what: str = "resume") -> None:
    """Every rank calls this with the checkpoint it would load (``None``: none) before loading anything; where the
    ranks would load different checkpoints (or some none), ``CheckpointNotSharedError`` on every rank, the same line.

    One collective of a few dozen bytes per rank when they see one file (or equal folders); where their files differ
    in inode, size or time, one more after each rank hashed its file; one more (each rank's step) when they differ."""
    if world_size <= 1:
        return
    # First the file's inode, size and modification time: on a shared filesystem, or on one node, they are equal on
    # every rank and nothing is hashed. Only where they differ (copies on each node's disk) are the bytes compared.
    own = checkpoint_identity(path, hash_file=False)
    identities, hosts = _gather_identities(own, world_size)
    if len({identity.digest for identity in identities}) > 1 and any(i.digest.startswith("<file:") for i in identities):
        own = checkpoint_identity(path)
        identities, hosts = _gather_identities(own, world_size)
    groups: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        groups.setdefault(identity.digest, []).append(rank)
    if len(groups) == 1:  # (one file, or equal bytes; where every rank failed to read it, the load says why)
        return
    steps = gather_from_every_rank(checkpoint_step(path), world_size)
    paths_differ = len({identity.path for identity in identities}) > 1
    parts = []
    for ranks in list(groups.values())[:_SHOWN_GROUPS]:
        identity = identities[ranks[0]]
        parts.append(f"{ranks_text(ranks, hosts)} {_what_is_seen(identity, steps[ranks[0]], paths_differ)}")
    if len(groups) > _SHOWN_GROUPS:
        parts.append(f"{len(groups) - _SHOWN_GROUPS} more groups of ranks see yet other checkpoints")
    named = "" if paths_differ else f" {identities[0].path!r}"
    raise CheckpointNotSharedError(
        f"cannot {what} from{named or ' ckpt_path'}: the ranks would load different checkpoints ({'; '.join(parts)}):"
        f" every rank must load the same checkpoint; {NOT_SHARED_ADVICE}. No rank has loaded anything."
    )
