"""Starting multi-process test runs (gloo on CPU) and counting the collectives they call.

Three ways to start ranks:

- ``run_launched(worker, *args)`` runs a worker as a user runs a training script, in a subprocess with a clean
  environment: Lightning's own launcher re-runs the command for the other ranks (or ``torchrun=N`` starts N ranks).
- ``run_nodes(worker, *args, nodes=N, devices=D, root=DIR)`` simulates a cluster on this machine: one launcher
  invocation per node (Lightning's own, with ``NODE_RANK`` / ``MASTER_ADDR=127.0.0.1`` / a shared ``MASTER_PORT``, as a
  user starts each node), each in its own working directory ``DIR/node{n}``, so that a relative path is node-private;
- ``spawn(target, world_size, init_file, *args)`` runs plain torch.distributed code: ``target(rank, world_size,
  init_file, *args)`` in ``world_size`` spawned processes that meet through ``init_process_group(rank, world_size,
  init_file)``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback

from tests.conftest import clean_subprocess_env

__all__ = [
    "REPO",
    "CollectiveCounter",
    "init_process_group",
    "run_failing_nodes",
    "run_launched",
    "run_nodes",
    "spawn",
    "leave_the_group_and_exit",
]

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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start_nodes(worker: str, args: tuple[Any, ...], nodes: int, root: Path) -> list[subprocess.Popen]:
    port = str(_free_port())
    started = []
    for node in range(nodes):
        cwd = root / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        env = clean_subprocess_env(
            PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node)
        )
        command = [sys.executable, "-m", worker, *map(str, args)]
        started.append(
            subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # its own process group: the ranks it launches are killed with it
            )
        )
    return started


def _alive(process_group: int) -> bool:
    try:
        os.killpg(process_group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait_for_nodes(
    started: list[subprocess.Popen], timeout: float, grace: float
) -> tuple[list[subprocess.CompletedProcess], list[int]]:
    """Each node's output once its launcher exited, and the nodes whose process group (the ranks the launcher
    started) still had a live process ``grace`` seconds after that; every process group is killed at the end."""
    done = []
    deadline = time.monotonic() + timeout
    try:
        for process in started:
            out, err = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
        grace_end = time.monotonic() + grace
        while any(_alive(process.pid) for process in started) and time.monotonic() < grace_end:
            time.sleep(0.1)
        survivors = [node for node, process in enumerate(started) if _alive(process.pid)]
    except subprocess.TimeoutExpired:
        for process in started:
            os.killpg(process.pid, signal.SIGKILL)
        outputs = [process.communicate() for process in started]
        raise AssertionError(
            f"the {len(started)} nodes did not finish within {timeout} s (a hang); last output of node 0:\n"
            + outputs[0][0][-2000:]
            + outputs[0][1][-4000:]
        ) from None
    finally:
        for process in started:  # (the launched ranks of a node that exited early, if any)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    return done, survivors


def run_nodes(
    worker: str, *args: Any, nodes: int, devices: int, root: Path, timeout: int = 300
) -> list[subprocess.CompletedProcess]:
    """Run ``python -m worker args`` once per node, all at once, each launching ``devices`` ranks; every node's
    process group is killed at ``timeout`` (a hang fails the test, it never blocks the suite). Checks that every
    node exits with status 0; returns each node's output."""
    done, _ = _wait_for_nodes(_start_nodes(worker, args, nodes, root), timeout, grace=0.0)
    for node, completed in enumerate(done):
        assert completed.returncode == 0, f"node {node}:\n" + completed.stdout[-2000:] + completed.stderr[-5000:]
    return done


def run_failing_nodes(
    worker: str, *args: Any, nodes: int, root: Path, timeout: int = 300, grace: float = 10.0
) -> tuple[list[subprocess.CompletedProcess], list[int]]:
    """As ``run_nodes`` for a launch that is expected to fail: each node's output (no exit status checked), and the
    nodes that left a process behind (one of its ranks still alive ``grace`` seconds after its launcher exited)."""
    return _wait_for_nodes(_start_nodes(worker, args, nodes, root), timeout, grace)


def init_process_group(rank: int, world_size: int, init_file: str) -> None:
    """Join the gloo process group of a ``spawn``-ed run."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)


def leave_the_group_and_exit() -> None:
    """The end of a rank whose work succeeded: the process group destroyed after a barrier, so no rank's interpreter
    exits while gloo still holds a connection to another (its background thread then aborts the process), then the
    process ended at once with status 0, without the interpreter's teardown: rarely (a few CI runs in many), a rank
    aborted there with "terminate called without an active exception" after its work and the group's destruction
    were done (a 4-process FSDP2 + tensor-parallel run, a 2-process Lightning launch), failing a run that had
    passed."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_then_leave_the_group(rank: int, target: Callable[..., None], *args: Any) -> None:
    """One spawned rank: ``target``, then ``leave_the_group_and_exit``."""
    target(rank, *args)
    leave_the_group_and_exit()


def spawn(target: Callable[..., None], world_size: int, init_file: str | Path, *args: Any) -> None:
    """Run ``target(rank, world_size, init_file, *args)`` in ``world_size`` spawned processes; an exception in any
    of them is raised here."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.start_processes(
            _run_then_leave_the_group,
            args=(target, world_size, str(init_file), *args),
            nprocs=world_size,
            start_method="spawn",
        )
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
