"""The ``lightning-sink`` command: one subcommand per concern, each registered in ``COMMANDS``.

    lightning-sink reshard --src-checkpoints-dir SRC --dst-checkpoints-dir DST --dst-strategy-file LAYOUT ...
    lightning-sink verify DST
    lightning-sink layout --model PKG.MODULE.CLASS --data-parallel-size DP --tensor-parallel-size TP --output FILE
    lightning-sink --version

To add a subcommand (e.g. ``layout``), write ``configure(parser)`` and ``run(args) -> int`` and add a
``Command`` to ``COMMANDS``; bad input is reported as ``error: <message>`` with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_sink import __version__
from lightning_sink.cli_parser import OneLineErrorParser

__all__ = ["Command", "COMMANDS", "main", "parse_size"]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] = lambda parser, args: None


def parse_size(text: str) -> int:
    """``"512MiB"``, ``"4GiB"``, ``"1000000"`` -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 512MiB, 4GiB, 1000000)")
    units = {
        "b": 1,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
    }
    return int(float(match.group(1)) * units[(match.group(2) or "b").lower()])


def _configure_reshard(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--src-checkpoints-dir",
        required=True,
        help="source: a DCP folder, a folder of rank_<x>/ folders with one checkpoint file each, or a"
        " one-device checkpoint file (Lightning .ckpt or a torch.save state dict)",
    )
    parser.add_argument("--dst-checkpoints-dir", help="destination folder (whole conversion)")
    parser.add_argument(
        "--ckpt-prefix", default="checkpoint_", type=_file_prefix, help="target files: rank_<r>/<prefix><r>.pt"
    )
    parser.add_argument(
        "--src-strategy-file", help="source layout (default: the folder's layout.json, else DCP metadata)"
    )
    parser.add_argument("--dst-strategy-file", required=True, help="target layout file")
    parser.add_argument("--workers", type=_positive_int, help="parallel worker processes, one target rank each")
    parser.add_argument(
        "--memory-budget",
        type=_positive_size,
        help="cap workers so that workers x largest shard fits, e.g. 8GiB",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a destination holding a different checkpoint")
    parser.add_argument("--rank-id", type=int, help="convert only this target rank (transform_checkpoint_by_rank)")
    parser.add_argument("--save-checkpoint-file-name", help="with --rank-id: the file to write")
    parser.add_argument(
        "--list-ranks", action="store_true", help="with --rank-id: print the source ranks it needs and exit"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a memory budget must be at least 1 byte")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: pass an integer >= 1")
    return value


def _file_prefix(text: str) -> str:
    from lightning_sink.checkpoint_format.fs import check_file_prefix

    try:
        return check_file_prefix(text, "--ckpt-prefix")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _check_reshard_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations argparse cannot express, refused before any work (exit status 2)."""
    one_rank = args.rank_id is not None
    if args.list_ranks and not one_rank:
        parser.error("--list-ranks needs --rank-id (the target rank whose source ranks to list)")
    if args.save_checkpoint_file_name and not one_rank:
        parser.error("--save-checkpoint-file-name needs --rank-id (it names one target rank's file)")
    if one_rank and args.workers is not None:
        parser.error("--workers belongs to a whole conversion; --rank-id converts one target rank in this process")
    if one_rank and not args.list_ranks and not args.save_checkpoint_file_name:
        parser.error("--rank-id needs --save-checkpoint-file-name (or --list-ranks)")
    if not one_rank and not args.dst_checkpoints_dir:
        parser.error("--dst-checkpoints-dir is required (or --rank-id for one target rank)")
    if args.memory_budget is not None and args.workers is None:
        parser.error("--memory-budget caps the number of --workers: pass --workers too")


def _run_reshard(args: argparse.Namespace) -> int:
    if args.rank_id is not None:
        return _reshard_one_rank(args)
    return _reshard_all_ranks(args)


def _reshard_one_rank(args: argparse.Namespace) -> int:
    """``--rank-id``: print the source ranks one target rank needs, or convert that rank alone in this process."""
    from lightning_sink.reshard import rank_list_for_transform, transform_checkpoint_by_rank
    from lightning_sink.reshard.open_source import source_files_for_ranks

    src_layout = args.src_strategy_file or args.src_checkpoints_dir
    needed = rank_list_for_transform(args.rank_id, src_layout, args.dst_strategy_file)
    if args.list_ranks:
        print(json.dumps(needed))
        return 0
    result = transform_checkpoint_by_rank(
        args.rank_id,
        source_files_for_ranks(args.src_checkpoints_dir, needed),
        args.save_checkpoint_file_name,
        args.src_strategy_file,
        args.dst_strategy_file,
        overwrite=args.overwrite,
    )
    print(f"wrote {result.relative_path}: {result.bytes_written} bytes, sha256 {result.sha256}")
    return 0


class _ByteProgressBar:
    """The whole conversion's progress bar over target bytes written (none with ``--no-progress``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        # The bar appears with the first bytes written: every refusal comes before those, as one line on its own.
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reshard", file=sys.stderr)
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _reshard_all_ranks(args: argparse.Namespace) -> int:
    """A whole conversion into ``--dst-checkpoints-dir``; prints its summary as one JSON line."""
    from lightning_sink.reshard import transform_checkpoints

    progress = _ByteProgressBar(enabled=not args.no_progress)
    try:
        report = transform_checkpoints(
            args.src_checkpoints_dir,
            args.dst_checkpoints_dir,
            args.ckpt_prefix,
            args.src_strategy_file,
            args.dst_strategy_file,
            workers=args.workers,
            overwrite=args.overwrite,
            memory_budget_bytes=args.memory_budget,
            progress=progress,
        )
    finally:
        progress.close()
    stats = report.stats
    print(
        json.dumps(
            {
                "destination": str(report.destination),
                "ranks": len(report.ranks),
                "bytes_written": sum(r.bytes_written for r in report.ranks),
                "bytes_needed": stats.bytes_needed,
                "payload_bytes_read": stats.payload_bytes_read,
                "header_bytes_read": stats.header_bytes_read,
                "verify_bytes_read": stats.verify_bytes_read,
            }
        )
    )
    return 0


def _configure_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="a resharded checkpoint folder (holding MANIFEST.json)")
    parser.add_argument("--shallow", action="store_true", help="digests and completeness only; do not load rank files")


def _run_verify(args: argparse.Namespace) -> int:
    from lightning_sink.reshard import verify_checkpoint

    report = verify_checkpoint(args.directory, deep=not args.shallow)
    print(
        f"OK: {report.folder}: {report.world_size} ranks, {report.files_checked} files, {report.bytes_checked} bytes verified"
    )
    return 0


def _configure_layout(parser: argparse.ArgumentParser) -> None:
    from lightning_sink.layout_arguments import configure_parser

    configure_parser(parser)


def _run_layout(args: argparse.Namespace) -> int:
    from lightning_sink.layout_inference import run

    return run(args)


COMMANDS: list[Command] = [
    Command(
        "reshard",
        "convert a distributed checkpoint to another rank count / layout (offline)",
        _configure_reshard,
        _run_reshard,
        _check_reshard_arguments,
    ),
    Command(
        "verify", "check a resharded checkpoint's integrity (SHA-256) and completeness", _configure_verify, _run_verify
    ),
    Command(
        "layout",
        "predict the layout file of a SinkModelParallelStrategy run without launching it",
        _configure_layout,
        _run_layout,
    ),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="lightning-sink", description="lightning-sink command-line tools")
    parser.add_argument("--version", action="version", version=f"lightning-sink {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        command.configure(sub)
        sub.set_defaults(_run=command.run, _check=command.check, _parser=sub)
    args = parser.parse_args(argv)
    args._check(args._parser, args)
    try:
        return args._run(args)
    except (ValueError, TypeError, OSError) as error:  # bad input, or the environment (a full disk, permissions)
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2


def _one_line(error: BaseException) -> str:
    """The message, on one line; an OSError from the system names its file."""
    if isinstance(error, OSError) and error.filename is not None and str(error.filename) not in str(error):
        message = f"{error.filename}: {error.strerror or error}"
    else:
        message = str(error)
    return " ".join(message.split())


if __name__ == "__main__":
    sys.exit(main())
