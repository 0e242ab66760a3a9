"""Run one conversion and SIGKILL ourselves at a chosen point (used by test_atomicity.py)."""

from __future__ import annotations

import os
import signal
import sys

from lightning_sink.reshard import transform as transform_module
from lightning_sink.reshard import transform_checkpoints


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(src: str, dst: str, layout: str, point: str) -> None:
    progress = None
    if point.startswith("after_shard_"):  # progress is reported once per target shard filled
        stop_after, calls = int(point.removeprefix("after_shard_")), []

        def progress(done: int, total: int) -> None:
            calls.append(done)
            if len(calls) == stop_after:
                die()
    elif point in ("between_renames", "after_commit_rename"):
        real_rename, calls = os.rename, []

        def rename(a, b):
            calls.append(a)
            if point == "between_renames" and len(calls) == 2:  # old retired, staging not yet in place
                die()
            real_rename(a, b)
            if point == "after_commit_rename" and len(calls) == 2:  # new in place, old not yet removed
                die()

        transform_module.os.rename = rename
    elif point == "wait":
        print("started", flush=True)
    transform_checkpoints(src, dst, "ckpt_", None, layout, overwrite=True, progress=progress)
    print("finished", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
