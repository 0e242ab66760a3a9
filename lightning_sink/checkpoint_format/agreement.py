"""Ranks on several nodes agreeing on what a checkpoint path holds, before a save commits or a resume loads.

On a cluster every node sees its own disks: a checkpoint path on node-local disk (a relative path, ``/tmp``, a
node's scratch) looks different from each node. Without a check a sharded save commits a folder that lacks the
other nodes' shards (their files stay in a staging folder on their own disk), and a resume sends some ranks into
DCP's load and others into another code path, where they wait for each other until the process group's timeout.

Both checks here cost one ``all_gather_object`` of a few file names per rank, and every rank reaches the same
verdict from the same gathered views, so a disagreement is one error raised on every rank, never a hang:

- ``check_every_rank_file_present``: after the ranks wrote their shards into the staging folder, rank 0's folder
  (the one that gets committed) must hold every file every rank wrote;
- ``agree_on_checkpoint_path``: before a resume loads, every rank must see the same entries at the path.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

__all__ = [
    "NOT_SHARED_ADVICE",
    "CheckpointNotSharedError",
    "RankView",
    "agree_on_checkpoint_path",
    "check_every_rank_file_present",
    "describe_path",
    "gather_views",
]

NOT_SHARED_ADVICE = (
    "the checkpoint directory is not shared between nodes: put it on a filesystem that every node mounts at the same"
    " path (NFS, Lustre, GPFS, ...), given as an absolute path, not on node-local disk (/tmp, a relative path under"
    " a per-node working directory, a node's scratch)"
)

# What a rank reports about a folder: its entries down to rank_{r}/ subfolders, bounded so that the payload of the
# one collective stays small whatever the folder holds.
_MAX_ENTRIES = 10_000
_SHOWN = 6


class CheckpointNotSharedError(RuntimeError):
    """Raised on every rank when the ranks see different things at a checkpoint path."""


@dataclass(frozen=True)
class RankView:
    """What one rank reports: where it runs, the sorted entries it sees (``None``: nothing at the path) and, after a
    save, the files it wrote."""

    host: str
    entries: tuple[str, ...] | None
    written: tuple[str, ...] = ()


# Where launchers write the node's index: torchrun, SLURM, Lightning's own environment.
_NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK")


def _host() -> str:
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


def gather_views(entries: tuple[str, ...] | None, world_size: int, written: Iterable[str] = ()) -> list[RankView]:
    """Every rank's view, indexed by global rank (one collective; this process's own view when alone)."""
    mine = RankView(_host(), entries, tuple(sorted(written)))
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [mine]
    views: list[RankView | None] = [None] * world_size
    dist.all_gather_object(views, mine)
    return [view if view is not None else RankView("unknown host", None) for view in views]


def _ranks_text(ranks: Iterable[int], views: Sequence[RankView]) -> str:
    ranks = sorted(ranks)
    hosts = sorted({views[rank].host for rank in ranks})
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(map(str, ranks))} (host {'; '.join(hosts)})"


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_every_rank_file_present(
    staging: Path, target: Path, written: Iterable[str], global_rank: int, world_size: int
) -> None:
    """After a sharded save: every file any rank wrote (``written``: this rank's file names) must be in global rank
    0's ``staging`` folder, the one that becomes ``target``; else ``CheckpointNotSharedError`` on every rank."""
    if world_size == 1:
        return
    views = gather_views(describe_path(staging) if global_rank == 0 else None, world_size, written)
    present = set(views[0].entries or ())
    missing = {rank: [name for name in view.written if name not in present] for rank, view in enumerate(views)}
    missing = {rank: names for rank, names in missing.items() if names}
    if not missing:
        return
    raise CheckpointNotSharedError(
        f"checkpoint {str(target)!r} was not saved: {_ranks_text(missing, views)} wrote"
        f" {_names(name for names in missing.values() for name in names)}, which global rank 0 (host {views[0].host})"
        f" does not see in {str(staging)!r}: {NOT_SHARED_ADVICE}. Nothing was committed and the staging folders"
        " were removed."
    )


def agree_on_checkpoint_path(path: Path, world_size: int) -> None:
    """Before a resume loads: every rank must see the same entries at ``path``; else ``CheckpointNotSharedError``
    on every rank, naming which ranks see which files."""
    views = gather_views(describe_path(path), world_size)
    groups: dict[tuple[str, ...] | None, list[int]] = {}
    for rank, view in enumerate(views):
        groups.setdefault(view.entries, []).append(rank)
    if len(groups) == 1:
        return
    everything = {name for entries in groups if entries is not None for name in entries}
    parts = []
    for entries, ranks in groups.items():
        if entries is None:
            seen = "nothing at that path"
        elif entries == ("<file>",):
            seen = "a file"
        else:
            absent = everything - set(entries)
            seen = f"{len(entries)} entries" + (f", without {_names(absent)}" if absent else "")
        parts.append(f"{_ranks_text(ranks, views)} see {seen}")
    raise CheckpointNotSharedError(
        f"cannot resume from {str(path)!r}: the ranks see different things there ({'; '.join(parts)}):"
        f" {NOT_SHARED_ADVICE}. No rank has loaded anything."
    )
