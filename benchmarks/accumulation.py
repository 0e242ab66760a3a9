"""Gradient-accumulation benchmark: memory of micro-batching, and communication of DDP accumulation.

    python benchmarks/accumulation.py [--repeats 3] [--windows 12]

(1) Peak memory, each configuration in its own subprocess (so high-water marks do not mix): a conv net whose
    activations dominate, trained with micro-batch b and SinkStrategy(accumulation_steps=8), against one batch of
    8b with stock Lightning (the anchor), and stock Lightning's accumulate_grad_batches=8.
(2) Two gloo processes on CPU: all-reduce passes per window and wall time per window for
    SinkDDPStrategy(accumulation_steps=4), stock Lightning DDP with accumulate_grad_batches=4, and a plain
    hand-written DDP loop that does not use no_sync (it reduces on every micro-batch).

Configurations alternate, each repeated; figures are medians. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import NetClassifier, quiet_trainer  # noqa: E402

DISTRIBUTED_ENV = (
    "LOCAL_RANK",
    "NODE_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)

MEMORY_MODES = ("sink_micro_batches", "stock_large_batch", "stock_accumulate")
DDP_MODES = ("sink_ddp", "stock_ddp_accumulate", "plain_ddp_no_no_sync")
MICRO, STEPS = 16, 8  # memory part: micro-batch b and N
DDP_MICRO, DDP_STEPS = 32, 4


def conv_net() -> nn.Module:
    """Activations (batch x 32 x 64 x 64 per layer) dwarf the ~20k parameters."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ---------------------------------------------------------------------------------------------- memory child
def memory_child(mode: str, out: Path) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_sink

    torch.manual_seed(0)
    updates = 3
    data = TensorDataset(
        torch.randn(MICRO * STEPS * updates, 3, 64, 64), torch.randint(0, 10, (MICRO * STEPS * updates,))
    )
    if mode == "sink_micro_batches":
        trainer, batch = (
            quiet_trainer(strategy=lightning_sink.SinkStrategy(accumulation_steps=STEPS), max_epochs=1),
            MICRO,
        )
    elif mode == "stock_large_batch":
        trainer, batch = quiet_trainer(max_epochs=1), MICRO * STEPS
    else:
        trainer, batch = quiet_trainer(accumulate_grad_batches=STEPS, max_epochs=1), MICRO
    model = NetClassifier(conv_net())
    baseline = _rss_mib()
    trainer.fit(model, DataLoader(data, batch_size=batch))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(json.dumps({"peak_rss_mib": peak, "baseline_rss_mib": baseline, "updates": trainer.global_step}))


# ---------------------------------------------------------------------------------------------- DDP children
class _Counters:
    def __init__(self) -> None:
        self.all_reduce = 0
        self.ddp_buckets = 0


def _counting_hook(counters: _Counters):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def hook(state, bucket):
        counters.ddp_buckets += 1
        return allreduce_hook(state, bucket)

    return hook


def _count_all_reduce(counters: _Counters) -> None:
    import torch.distributed as dist

    real = dist.all_reduce

    def counting(*args, **kwargs):
        counters.all_reduce += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting


def _ddp_data(windows: int):
    from torch.utils.data import TensorDataset

    samples = DDP_MICRO * DDP_STEPS * windows * 2  # two ranks
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 784, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def lightning_ddp_child(mode: str, out: Path, windows: int, warmup: int) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    import lightning_sink

    counters = _Counters()

    class Timer(pl.Callback):
        def on_train_start(self, trainer, module):
            trainer.model.register_comm_hook(None, _counting_hook(counters))
            _count_all_reduce(counters)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == warmup * DDP_STEPS:
                self.start = (time.perf_counter(), counters.all_reduce, counters.ddp_buckets)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.end = (time.perf_counter(), counters.all_reduce, counters.ddp_buckets)

    torch.manual_seed(0)
    if mode == "sink_ddp":
        strategy = lightning_sink.SinkDDPStrategy(accumulation_steps=DDP_STEPS, process_group_backend="gloo")
        kwargs = {}
    else:
        strategy, kwargs = DDPStrategy(process_group_backend="gloo"), {"accumulate_grad_batches": DDP_STEPS}
    timer = Timer()
    trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=1, callbacks=[timer], **kwargs)
    trainer.fit(NetClassifier(mlp()), DataLoader(_ddp_data(windows + warmup), batch_size=DDP_MICRO))
    if trainer.global_rank == 0:
        measured = windows
        seconds, reduces, buckets = (e - s for e, s in zip(timer.end, timer.start))
        out.write_text(
            json.dumps(
                {
                    "ms_per_window": 1000 * seconds / measured,
                    "all_reduce_per_window": reduces / measured,
                    "ddp_bucket_reductions_per_window": buckets / measured,
                }
            )
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # a live gloo group can abort the process at exit


def _plain_ddp_worker(rank: int, out: str, windows: int, warmup: int, port: int) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    counters = _Counters()
    model = DistributedDataParallel(mlp())
    model.register_comm_hook(None, _counting_hook(counters))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = _ddp_data(windows + warmup).tensors
    x, y = x[rank::2], y[rank::2]
    start = None
    for window in range(windows + warmup):
        if window == warmup:
            start = (time.perf_counter(), counters.ddp_buckets)
        for micro in range(DDP_STEPS):
            offset = (window * DDP_STEPS + micro) * DDP_MICRO
            loss = F.cross_entropy(model(x[offset : offset + DDP_MICRO]), y[offset : offset + DDP_MICRO]) / DDP_STEPS
            loss.backward()  # no no_sync(): DDP reduces after every micro-batch
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        seconds, buckets = time.perf_counter() - start[0], counters.ddp_buckets - start[1]
        Path(out).write_text(
            json.dumps(
                {
                    "ms_per_window": 1000 * seconds / windows,
                    "all_reduce_per_window": 0.0,
                    "ddp_bucket_reductions_per_window": buckets / windows,
                }
            )
        )
    dist.destroy_process_group()


def plain_ddp_child(out: Path, windows: int, warmup: int) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_plain_ddp_worker, args=(str(out), windows, warmup, port), nprocs=2)


# ---------------------------------------------------------------------------------------------- driver
def _run_child(args: list[str], out: Path) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _alternating(modes: tuple[str, ...], repeats: int, run) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]  # rotate who goes first
        for mode in order:
            results[mode].append(run(mode))
    return results


def _median(runs: list[dict], key: str) -> float:
    return round(statistics.median(run[key] for run in runs), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--windows", type=int, default=12, help="timed windows per DDP run (after 2 warm-up)")
    parser.add_argument("--child", nargs="+")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        kind, mode = args.child[0], args.child[1]
        if kind == "memory":
            memory_child(mode, args.out)
        elif mode == "plain_ddp_no_no_sync":
            plain_ddp_child(args.out, int(args.child[2]), 2)
        else:
            lightning_ddp_child(mode, args.out, int(args.child[2]), 2)
        return

    with tempfile.TemporaryDirectory() as tmp:
        counter = iter(range(10**6))
        memory = _alternating(
            MEMORY_MODES,
            args.repeats,
            lambda mode: _run_child(["--child", "memory", mode], Path(tmp) / f"m{next(counter)}.json"),
        )
        ddp = _alternating(
            DDP_MODES,
            args.repeats,
            lambda mode: _run_child(["--child", "ddp", mode, str(args.windows)], Path(tmp) / f"d{next(counter)}.json"),
        )

    result = {
        "benchmark": "accumulation",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "repeats": args.repeats,
        "memory": {
            "conv_net": f"3x(conv 32ch 3x3) on 3x64x64, micro-batch {MICRO}, N={STEPS} vs batch {MICRO * STEPS}",
            **{
                mode: {
                    "peak_rss_mib": _median(runs, "peak_rss_mib"),
                    "training_rss_mib": round(
                        statistics.median(r["peak_rss_mib"] - r["baseline_rss_mib"] for r in runs), 1
                    ),
                }
                for mode, runs in memory.items()
            },
        },
        "ddp_2_gloo_processes": {
            "model": f"MLP 784-1024-1024-10, micro-batch {DDP_MICRO} per rank, N={DDP_STEPS}",
            **{mode: {key: _median(runs, key) for key in runs[0]} for mode, runs in ddp.items()},
        },
    }
    memory_ratio = (
        result["memory"]["sink_micro_batches"]["training_rss_mib"]
        / result["memory"]["stock_large_batch"]["training_rss_mib"]
    )
    result["memory"]["sink_vs_large_batch_training_rss"] = round(memory_ratio, 3)
    ddp_result = result["ddp_2_gloo_processes"]
    for mode in DDP_MODES[1:]:
        ddp_result[f"sink_speedup_vs_{mode}"] = round(
            ddp_result[mode]["ms_per_window"] / ddp_result["sink_ddp"]["ms_per_window"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
