"""What the integrity digests of a checkpoint cost at save and at resume, on CPU, alternating.

    python benchmarks/checkpoint_digests.py [--repeats 7] [--width 2048] [--layers 3]

A model of ``--layers`` square linear layers (2048 wide, 3 layers: 12.6 M parameters, a 50 MB checkpoint with plain
SGD, which keeps no state) is fitted for one step with ``SinkStrategy``; then, alternating, the same checkpoint is
saved (``trainer.save_checkpoint``) with and without digests (``checkpoint_digests``), and loaded as a resume loads
it (``strategy.load_checkpoint``: ``torch.load`` and the state checks) with and without checking them. The anchor of
each is the run without digests.

The same weights as a DCP folder (``SAVE_DIGESTS.json``, what ``SinkModelParallelStrategy`` writes), one process:
``save_dcp_atomically`` with and without writing the digests (the file and each record), and ``load_dcp_folder``
with and without ``check_one_save``. Then two gloo processes, each saving half of the layers (two storage files)
and checking the folder: each rank its share (``check_one_save`` on 2 ranks) against every rank every file (the
check on one rank, as before the check was shared); the time of the slower rank of each repeat.

Figures are medians of the repeats, with the spread (min and max); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_sink import SinkStrategy
from lightning_sink.checkpoint_format import dcp_folder, dcp_load

from common import quiet_trainer


def fitted(width: int, layers: int) -> tuple:
    import lightning.pytorch as pl
    import torch.nn.functional as F

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = TensorDataset(torch.randn(4, width), torch.randn(4, width))
    strategy = SinkStrategy()
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    trainer.fit(Regressor(), DataLoader(data, batch_size=4))
    return trainer, strategy


def set_digests(strategy: SinkStrategy, enabled: bool) -> None:
    fit = strategy.sink_fit
    fit.sink_config = dataclasses.replace(fit.sink_config, checkpoint_digests=enabled)


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def summary(times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def ratios(times: dict[str, list[float]], kinds: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per kind, the ratio ``<kind>_digests`` over ``<kind>`` of each repeat: median, min, max."""
    result = {}
    for kind in kinds:
        each = [d / a for d, a in zip(times[f"{kind}_digests"], times[kind])]
        result[kind] = {"median": statistics.median(each), "min": min(each), "max": max(each)}
    return result


def ckpt_times(args: argparse.Namespace, folder: str) -> tuple[dict[str, list[float]], int]:
    trainer, strategy = fitted(args.width, args.layers)
    times: dict[str, list[float]] = {name: [] for name in ("save", "save_digests", "load", "load_digests")}
    plain, sealed = Path(folder, "plain.ckpt"), Path(folder, "sealed.ckpt")
    for _ in range(args.repeats):
        for enabled in (False, True):
            set_digests(strategy, enabled)
            path = sealed if enabled else plain
            times["save_digests" if enabled else "save"].append(timed(lambda path=path: trainer.save_checkpoint(path)))
        for enabled in (False, True):
            set_digests(strategy, enabled)  # both load the file that has digests: only the check differs
            times["load_digests" if enabled else "load"].append(timed(lambda: strategy.load_checkpoint(sealed)))
    return times, sealed.stat().st_size


def layers_module(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def save_dcp(state: dict, path: Path, rank: int = 0, world_size: int = 1, barrier=lambda: None) -> None:
    if path.exists():
        import shutil

        shutil.rmtree(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_folder.save_dcp_atomically(
            state, {"epoch": 0}, path, global_rank=rank, world_size=world_size, barrier=barrier
        )


def dcp_times(args: argparse.Namespace, folder: str) -> tuple[dict[str, list[float]], int]:
    """One process: the save with and without writing SAVE_DIGESTS.json, the load with and without checking it."""
    module = layers_module(args.width, args.layers)
    state = {"state_dict": module.state_dict()}
    real_write, real_check = dcp_folder.write_save_digests, dcp_load.check_one_save
    times: dict[str, list[float]] = {name: [] for name in ("save", "save_digests", "load", "load_digests")}
    plain, sealed = Path(folder, "plain_dcp"), Path(folder, "sealed_dcp")
    for _ in range(args.repeats):
        for enabled in (False, True):
            dcp_folder.write_save_digests = real_write if enabled else (lambda folder: None)  # type: ignore[assignment]
            path = sealed if enabled else plain
            times["save_digests" if enabled else "save"].append(timed(lambda path=path: save_dcp(state, path)))
        for enabled in (False, True):
            dcp_load.check_one_save = real_check if enabled else (lambda *a: None)  # type: ignore[assignment]
            load = lambda: dcp_load.load_dcp_folder(sealed, module, [], True, True)  # noqa: E731
            times["load_digests" if enabled else "load"].append(timed(load))
    dcp_folder.write_save_digests, dcp_load.check_one_save = real_write, real_check
    return times, sum(f.stat().st_size for f in sealed.iterdir())


def _shared_check_worker(rank: int, args: argparse.Namespace, folder: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    module = layers_module(args.width, args.layers)
    mine = {name: t for number, (name, t) in enumerate(module.state_dict().items()) if number // 2 % 2 == rank}
    path = Path(folder, "two_ranks_dcp")
    save_dcp({"state_dict": mine}, path, rank, 2, dist.barrier)
    times: dict[str, list[float]] = {"shared": [], "every_file": []}
    for _ in range(args.repeats):
        for kind in ("every_file", "shared"):
            dist.barrier()
            world = 2 if kind == "shared" else 1  # (on one rank: each rank checks every file, as before)
            mine_s = timed(lambda world=world: dcp_load.check_one_save(path, rank if world == 2 else 0, world))
            slowest: list = [None, None]
            dist.all_gather_object(slowest, mine_s)
            times[kind].append(max(slowest))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def shared_check_times(args: argparse.Namespace, folder: str) -> dict[str, list[float]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = Path(folder, "shared.json")
    mp.spawn(_shared_check_worker, args=(args, folder, port, str(out)), nprocs=2)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        times, checkpoint_bytes = ckpt_times(args, folder)
        dcp, dcp_bytes = dcp_times(args, folder)
        shared = shared_check_times(args, folder)
    each = [s / e for s, e in zip(shared["shared"], shared["every_file"])]
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_digests",
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "load_average": os.getloadavg(),
                "torch": torch.__version__,
                "checkpoint_mb": round(checkpoint_bytes / 2**20, 1),
                "repeats": args.repeats,
                "times": {name: summary(values) for name, values in times.items()},
                "ratio_with_digests": ratios(times, ("save", "load")),
                "dcp_folder_mb": round(dcp_bytes / 2**20, 1),
                "dcp_times": {name: summary(values) for name, values in dcp.items()},
                "dcp_ratio_with_digests": ratios(dcp, ("save", "load")),
                "two_ranks_check_times": {name: summary(values) for name, values in shared.items()},
                "two_ranks_shared_over_every_file": {
                    "median": statistics.median(each),
                    "min": min(each),
                    "max": max(each),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
