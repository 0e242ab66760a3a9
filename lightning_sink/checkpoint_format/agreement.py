"""Ranks on several nodes agreeing on what a checkpoint path holds, before a save commits or a resume loads.

On a cluster every node sees its own disks: a checkpoint path on node-local disk (a relative path, ``/tmp``, a
node's scratch) looks different from each node. Without a check a sharded save commits a folder that lacks the
other nodes' shards (their files stay in a staging folder on their own disk), and a resume sends some ranks into
DCP's load and others into another code path, where they wait for each other until the process group's timeout.

Both checks cost one or two small collectives (a few file names, or a digest, per rank), and every rank reaches the
same verdict, so a disagreement is one error raised on every rank, never a hang:

- ``check_every_rank_file_present``: after the ranks wrote their shards into the staging folder, rank 0's folder
  (the one that gets committed) must hold every file every rank wrote;
- ``agree_on_checkpoint_path``: before a resume loads, every rank must see the same entries at the path;
- ``gather_from_every_rank``: the one collective behind both, also how the ranks combine their shares of a check
  (``dcp_load.check_one_save``: each rank checks some files, every rank gets every verdict).
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

__all__ = [
    "NOT_SHARED_ADVICE",
    "CheckpointNotSharedError",
    "RankView",
    "agree_on_checkpoint_path",
    "check_every_rank_file_present",
    "describe_path",
    "gather_from_every_rank",
    "gather_views",
    "host_description",
    "ranks_text",
]

NOT_SHARED_ADVICE = (
    "the checkpoint directory is not shared between nodes: put it on a filesystem that every node mounts at the same"
    " path (NFS, Lustre, GPFS, ...), given as an absolute path, not on node-local disk (/tmp, a relative path under"
    " a per-node working directory, a node's scratch)"
)

# What a rank lists of a folder (its entries down to rank_{r}/ subfolders), bounded whatever the folder holds: the
# digest compared in the first round is over this list, and only a disagreement sends a list.
_MAX_ENTRIES = 10_000
_SHOWN = 6
_SHOWN_GROUPS = 4  # (one per node, typically; each costs one broadcast of a listing, in the error case only)


T = TypeVar("T")


class CheckpointNotSharedError(RuntimeError):
    """Raised on every rank when the ranks see different things at a checkpoint path."""


@dataclass(frozen=True)
class RankView:
    """What one rank reports in the first, small round: where it runs and a digest of what it sees."""

    host: str
    digest: str


def _digest(entries: tuple[str, ...] | None) -> str:
    text = "<nothing>" if entries is None else "\n".join(entries)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


# Where launchers write the node's index: torchrun, SLURM, Lightning's own environment.
_NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")


def host_description() -> str:
    """Where this process runs: the host name, and the node index where a launcher set one."""
    host = socket.gethostname() or "unknown host"
    node = next((os.environ[name] for name in _NODE_VARIABLES if os.environ.get(name)), None)
    return host if node is None else f"{host}, node {node}"


def describe_path(path: Path) -> tuple[str, ...] | None:
    """The entries this process sees at ``path``: ``None`` when nothing is there, ``("<file>",)`` for a file, else
    the folder's files and subfolders (one level of subfolders listed too), relative and sorted; links are listed,
    never followed."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_dir():
        return ("<file>",)
    entries: list[str] = []
    try:
        with os.scandir(path) as top:
            for entry in top:
                if entry.is_dir(follow_symlinks=False):
                    entries.append(f"{entry.name}/")
                    with os.scandir(entry.path) as inner:
                        entries.extend(f"{entry.name}/{child.name}" for child in inner)
                else:
                    entries.append(entry.name)
                if len(entries) > _MAX_ENTRIES:
                    break
    except OSError as error:
        entries.append(f"<unreadable: {error.strerror or error}>")
    return tuple(sorted(entries[:_MAX_ENTRIES]))


def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def gather_from_every_rank(value: T, world_size: int) -> list[T | None]:
    """Every rank's ``value``, indexed by global rank: one ``all_gather_object`` (just ``[value]`` in one process)."""
    if not _distributed(world_size):
        return [value]
    gathered: list[T | None] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def gather_views(digest: str, world_size: int) -> list[RankView]:
    """Every rank's host and digest, indexed by global rank: one ``all_gather_object`` of a few dozen bytes each (the
    file names themselves travel only when the ranks disagree)."""
    views = gather_from_every_rank(RankView(host_description(), digest), world_size)
    return [view if view is not None else RankView("unknown host", "") for view in views]


def _broadcast(value: object, src: int) -> object:
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def ranks_text(ranks: Iterable[int], hosts: Sequence[str]) -> str:
    """``ranks 2, 3 (host h, node 1)``: global ranks and where they run (``hosts``: every rank's, by rank)."""
    ranks = sorted(ranks)
    where = sorted({hosts[rank] for rank in ranks})
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(map(str, ranks))} (host {'; '.join(where)})"


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_every_rank_file_present(
    staging: Path, target: Path, written: Iterable[str], global_rank: int, world_size: int
) -> None:
    """After a sharded save: every file any rank wrote (``written``: this rank's file names) must be in global rank
    0's ``staging`` folder, the one that becomes ``target``; else ``CheckpointNotSharedError`` on every rank.

    Each rank sends rank 0 the names it wrote (a few per rank); rank 0 compares them with what it sees and sends
    every rank its verdict."""
    if not _distributed(world_size):
        return
    mine = (host_description(), sorted(written))
    reports: list[tuple[str, list[str]]] | None = [("", [])] * world_size if global_rank == 0 else None
    dist.gather_object(mine, reports, dst=0)
    verdict = None
    if global_rank == 0:
        assert reports is not None
        present = set(describe_path(staging) or ())
        missing = {rank: [name for name in names if name not in present] for rank, (_, names) in enumerate(reports)}
        missing = {rank: names for rank, names in missing.items() if names}
        if missing:
            hosts = [host for host, _ in reports]
            verdict = (
                f"checkpoint {str(target)!r} was not saved: {ranks_text(missing, hosts)} wrote"
                f" {_names(name for names in missing.values() for name in names)}, which global rank 0 (host"
                f" {hosts[0]}) does not see in {str(staging)!r}: {NOT_SHARED_ADVICE}. Nothing was committed and the"
                " staging folders were removed."
            )
    agreed = _broadcast(verdict, src=0)
    if agreed is not None:
        raise CheckpointNotSharedError(str(agreed))


def agree_on_checkpoint_path(path: Path, world_size: int) -> None:
    """Before a resume loads: every rank must see the same entries at ``path``; else ``CheckpointNotSharedError``
    on every rank, naming which ranks see which files.

    The ranks compare digests of what they see (one small collective); only on a disagreement does one rank of
    each differing group send its list of names, so that the error can say what is missing where."""
    if not _distributed(world_size):
        return
    entries = describe_path(path)
    views = gather_views(_digest(entries), world_size)
    groups: dict[str, list[int]] = {}
    for rank, view in enumerate(views):
        groups.setdefault(view.digest, []).append(rank)
    if len(groups) == 1:
        return
    hosts = [view.host for view in views]
    shown = list(groups.values())[:_SHOWN_GROUPS]
    rank = dist.get_rank()
    listings = [_broadcast(entries if rank == ranks[0] else None, src=ranks[0]) for ranks in shown]
    everything = {name for listing in listings if isinstance(listing, tuple) for name in listing}
    parts = []
    for ranks, listing in zip(shown, listings):
        if listing is None:
            seen = "nothing at that path"
        elif listing == ("<file>",):
            seen = "a file"
        else:
            assert isinstance(listing, tuple)
            absent = everything - set(listing)
            seen = f"{len(listing)} entries" + (f", without {_names(absent)}" if absent else "")
        parts.append(f"{ranks_text(ranks, hosts)} see {seen}")
    if len(groups) > len(shown):
        parts.append(f"{len(groups) - len(shown)} more groups of ranks see yet other things")
    raise CheckpointNotSharedError(
        f"cannot resume from {str(path)!r}: the ranks see different things there ({'; '.join(parts)}):"
        f" {NOT_SHARED_ADVICE}. No rank has loaded anything."
    )
