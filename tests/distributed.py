"""Starting multi-process test runs (gloo on CPU) and counting the collectives they call.

Two ways to start ranks:

- ``run_launched(worker, *args)`` runs a worker as a user runs a training script, in a subprocess with a clean
  environment: Lightning's own launcher re-runs the command for the other ranks (or ``torchrun=N`` starts N ranks).
- ``spawn(target, world_size, init_file, *args)`` runs plain torch.distributed code: ``target(rank, world_size,
  init_file, *args)`` in ``world_size`` spawned processes that meet through ``init_process_group(rank, world_size,
  init_file)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback

from tests.conftest import clean_subprocess_env

__all__ = ["REPO", "CollectiveCounter", "init_process_group", "run_launched", "spawn"]

REPO = Path(__file__).resolve().parents[1]


def run_launched(
    worker: str | Path,
    *args: Any,
    torchrun: int | None = None,
    cwd: Path = REPO,
    timeout: int = 300,
    expect_returncode: int = 0,
) -> subprocess.CompletedProcess:
    """Run ``python -m worker args`` (a module name) or ``python worker args`` (a script path) and check its exit
    status; the output comes back for the test to read."""
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    launcher = [sys.executable]
    if torchrun is not None:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
    target = [str(worker)] if isinstance(worker, Path) else ["-m", worker]
    done = subprocess.run(
        [*launcher, *target, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == expect_returncode, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def init_process_group(rank: int, world_size: int, init_file: str) -> None:
    """Join the gloo process group of a ``spawn``-ed run."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def spawn(target: Callable[..., None], world_size: int, init_file: str | Path, *args: Any) -> None:
    """Run ``target(rank, world_size, init_file, *args)`` in ``world_size`` spawned processes; an exception in any
    of them is raised here."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(target, args=(world_size, str(init_file), *args), nprocs=world_size, start_method="spawn")
    finally:
        Path(init_file).unlink(missing_ok=True)


class CollectiveCounter(Callback):
    """Counts the calls of the named ``torch.distributed`` collectives inside each training batch; they still run.

    With ``ddp_comm_hook=True`` it also counts DDP's bucket reductions, through a communication hook that returns
    the bucket unreduced: a strategy that reduces gradients itself must never reach it. ``per_batch`` holds one
    ``{name: calls, ..., "updates": optimizer steps}`` per training batch (with ``"ddp_hook"`` when counted).
    Collectives that go through functional collectives (tensor parallelism's activations) are not counted.
    """

    def __init__(self, names: Iterable[str] = ("all_reduce",), ddp_comm_hook: bool = False) -> None:
        self.names = tuple(names)
        self.calls = dict.fromkeys(self.names, 0) | ({"ddp_hook": 0} if ddp_comm_hook else {})
        self.ddp_comm_hook = ddp_comm_hook
        self.per_batch: list[dict[str, int]] = []
        self._real = {name: getattr(dist, name) for name in self.names}

    def setup(self, trainer, pl_module, stage):
        for name in self.names:

            def counting(*args, _name=name, **kwargs):
                self.calls[_name] += 1
                return self._real[_name](*args, **kwargs)

            setattr(dist, name, counting)

    def on_train_start(self, trainer, pl_module):
        if not self.ddp_comm_hook:
            return

        def hook(state, bucket):
            self.calls["ddp_hook"] += 1
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        trainer.model.register_comm_hook(None, hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = (dict(self.calls), trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        calls, step = self._start
        self.per_batch.append(
            {**{name: self.calls[name] - calls[name] for name in self.calls}, "updates": trainer.global_step - step}
        )

    def teardown(self, trainer, pl_module, stage):
        for name, real in self._real.items():
            setattr(dist, name, real)
