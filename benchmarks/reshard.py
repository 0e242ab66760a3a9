"""Resharding benchmark: a synthetic >= 1 GiB checkpoint saved by 8 gloo ranks (4x2 mesh), converted to 3 ranks
and to 1 rank.

    python benchmarks/reshard.py [--size-gib 1.1] [--repeats 3] [--workdir DIR]

Per target, alternating order, median of repeats:
  cp        : ``cp -r`` of the source folder (the same bytes read and written: the physical bound on this disk)
  anchor    : DCP's ``dcp_to_torch_save`` to one full file, then slicing each target rank's shards and saving them
  reshard   : ``transform_checkpoints`` in this process (workers=None)
  reshard_w2: ``transform_checkpoints(workers=2)``, one spawned process per target rank (includes process start)
Also: bytes read / bytes needed, bytes read only to check integrity (apart from the payload), peak RSS per worker (and of an idle worker: the interpreter + torch baseline)
against the largest target shard, and a bit-exact check of every output against the anchor's slices. The page
cache is not dropped (shared machine): all reads are warm. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MESH, DIM_NAMES = (4, 2), ("dp", "tp")


def tensor_specs(size_gib: float) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Parameters plus Adam moments of square matrices (alternating TP-column and FSDP2+TP row sharding),
    vectors and a step: about ``size_gib`` GiB of float32."""
    side = 4096 if size_gib >= 0.5 else 1024
    per_matrix = side * side * 4 * 3  # weight + exp_avg + exp_avg_sq
    count = max(1, round(size_gib * 2**30 / per_matrix))
    specs = {}
    for index in range(count):
        placements = ("Shard(0)", "Shard(1)") if index % 2 == 0 else ("_StridedShard(0,sf=2)", "Shard(0)")
        for suffix, prefix in (
            ("", "state_dict"),
            (".exp_avg", "optimizer_0.state"),
            (".exp_avg_sq", "optimizer_0.state"),
        ):
            specs[f"{prefix}.layer{index}.weight{suffix}"] = ((side, side), placements)
        specs[f"state_dict.layer{index}.bias"] = ((side,), ("Shard(0)", "Replicate()"))
    specs["optimizer_0.state.layer0.weight.step"] = ((), ("Replicate()", "Replicate()"))
    return specs


def _save_worker(rank: int, world_size: int, init_file: str, specs, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from lightning_sink.layout import layout_from_state_dict, parse_placement, save_layout

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=DIM_NAMES)
    state = {}
    for index, (name, (shape, placement_text)) in enumerate(sorted(specs.items())):
        placements = [parse_placement(p) for p in placement_text]
        local_shape, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
        # Replicas must be equal: seed by tensor and chunk position, not by rank.
        generator = torch.Generator().manual_seed(index * 1_000_003 + hash(tuple(offsets)) % 1_000_003)
        local = torch.randn(local_shape, generator=generator)
        state[name] = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    dcp.save(state, checkpoint_id=out)
    if rank == 0:
        save_layout(layout_from_state_dict(state), Path(out) / "layout.json")
    dist.barrier()
    dist.destroy_process_group()


def make_source(workdir: Path, size_gib: float) -> Path:
    out = workdir / "source"
    mp.start_processes(
        _save_worker, args=(8, str(workdir / ".init"), tensor_specs(size_gib), str(out)), nprocs=8, start_method="spawn"
    )
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_cp(source: Path, out: Path) -> dict:
    started = time.perf_counter()
    subprocess.run(["cp", "-r", str(source), str(out)], check=True)
    subprocess.run(["sync", "-f", str(out)], check=True)
    return {"seconds": time.perf_counter() - started}


def run_anchor(source: Path, out: Path, layout) -> dict:
    """dcp_to_torch_save, then each target rank's shards sliced from the full tensors and saved."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    started = time.perf_counter()
    out.mkdir()
    dcp_to_torch_save(source, out / "full.pt")
    full, _ = flatten_state_dict(torch.load(out / "full.pt", mmap=True, weights_only=True))
    for rank in range(layout.world_size):
        shards = {}
        for fqn, tensor in layout.tensors.items():
            (chunk,) = tensor.chunks_of_rank(rank)
            shards[fqn] = full[fqn][tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))].clone()
        (out / f"rank_{rank}").mkdir()
        with open(out / f"rank_{rank}" / f"ckpt_{rank}.pt", "wb") as handle:
            torch.save(shards, handle)
            handle.flush()
            os.fsync(handle.fileno())
        del shards
    return {"seconds": time.perf_counter() - started}


def run_reshard(source: Path, out: Path, layout, workers: int | None) -> dict:
    from lightning_sink.reshard import transform_checkpoints

    started = time.perf_counter()
    report = transform_checkpoints(source, out, "ckpt_", None, layout, workers=workers)
    seconds = time.perf_counter() - started
    stats = report.stats
    return {
        "seconds": seconds,
        "bytes_needed": stats.bytes_needed,
        "payload_bytes_read": stats.payload_bytes_read,
        "header_bytes_read": stats.header_bytes_read,
        "verify_bytes_read": stats.verify_bytes_read,
        "records_crc_checked": stats.records_crc_checked,
        "peak_rss_per_worker": [r.peak_rss_bytes for r in report.ranks],
    }


def idle_worker_rss() -> int:
    """Peak RSS of a worker interpreter that imports what a worker imports and converts nothing."""
    from lightning_sink.reshard.workers import _BOOTSTRAP

    probe = _BOOTSTRAP.replace(
        "sys.exit(worker_main(json.loads(sys.stdin.read())))",
        "from lightning_sink.reshard.rank_conversion import peak_rss_bytes; print(peak_rss_bytes())",
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(REPO), str(os.getpid())], capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip().splitlines()[-1])


def check_equal(mine: Path, anchor: Path, world_size: int) -> bool:
    from lightning_sink.reshard import load_resharded_checkpoint

    for rank in range(world_size):
        shards = load_resharded_checkpoint(mine / f"rank_{rank}" / f"ckpt_{rank}.pt")["tensors"]
        reference = torch.load(anchor / f"rank_{rank}" / f"ckpt_{rank}.pt", mmap=True, weights_only=True)
        if set(shards) != set(reference) or not all(torch.equal(shards[k], reference[k]) for k in shards):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from lightning_sink.layout import MeshLayout, layout_on_mesh, load_layout

    workdir = Path(tempfile.mkdtemp(prefix="reshard_bench_", dir=args.workdir))
    try:
        started = time.perf_counter()
        source = make_source(workdir, args.size_gib)
        source_bytes = folder_bytes(source)
        print(f"source: {source_bytes / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        base = load_layout(source)
        results: dict = {}
        idle = idle_worker_rss()
        for ranks in (3, 1):
            layout = layout_on_mesh(
                base,
                MeshLayout.one_dimensional(ranks),
                lambda f, t: ["Shard(0)"] if t.global_shape else ["Replicate()"],
            )
            largest = max(sum(t.chunks_of_rank(r)[0].numel * 4 for t in layout.tensors.values()) for r in range(ranks))
            modes = {
                "cp": lambda out: run_cp(source, out),
                "anchor": lambda out, layout=layout: run_anchor(source, out, layout),
                "reshard": lambda out, layout=layout: run_reshard(source, out, layout, None),
                "reshard_w2": lambda out, layout=layout: run_reshard(source, out, layout, 2),
            }
            samples: dict[str, list[dict]] = {mode: [] for mode in modes}
            equal = None
            for repeat in range(args.repeats):
                order = list(modes)[repeat % len(modes) :] + list(modes)[: repeat % len(modes)]
                for mode in order:
                    out = workdir / f"{mode}_{ranks}"
                    samples[mode].append(modes[mode](out))
                    print(f"{ranks} ranks, {mode}: {samples[mode][-1]['seconds']:.1f} s", file=sys.stderr)
                if equal is None:
                    equal = check_equal(workdir / f"reshard_{ranks}", workdir / f"anchor_{ranks}", ranks)
                for mode in modes:
                    shutil.rmtree(workdir / f"{mode}_{ranks}", ignore_errors=True)
            median = {mode: statistics.median(s["seconds"] for s in samples[mode]) for mode in modes}
            last = samples["reshard_w2"][-1]
            results[f"8_to_{ranks}"] = {
                "seconds_median": {mode: round(value, 2) for mode, value in median.items()},
                "reshard_vs_cp": round(median["reshard"] / median["cp"], 2),
                "reshard_w2_vs_cp": round(median["reshard_w2"] / median["cp"], 2),
                "reshard_vs_anchor": round(median["reshard"] / median["anchor"], 2),
                "bytes_needed": last["bytes_needed"],
                "payload_bytes_read": last["payload_bytes_read"],
                "header_bytes_read": last["header_bytes_read"],
                "read_over_needed": round(
                    (last["payload_bytes_read"] + last["header_bytes_read"]) / last["bytes_needed"], 4
                ),
                "payload_over_needed": round(last["payload_bytes_read"] / last["bytes_needed"], 4),
                # integrity checks, apart from the payload: data descriptors, rests of records read in part
                "verify_bytes_read": last["verify_bytes_read"],
                "records_crc_checked": last["records_crc_checked"],
                "largest_target_shard_mib": round(largest / 2**20, 1),
                "peak_rss_per_worker_mib": [round(b / 2**20, 1) for b in last["peak_rss_per_worker"]],
                "peak_rss_over_idle_worker_mib": [round((b - idle) / 2**20, 1) for b in last["peak_rss_per_worker"]],
                "bit_exact_vs_anchor": equal,
            }
        print(
            json.dumps(
                {
                    "benchmark": "reshard",
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
                    "source_gib": round(source_bytes / 2**30, 3),
                    "source_ranks": 8,
                    "source_mesh": list(MESH),
                    "repeats": args.repeats,
                    "idle_worker_rss_mib": round(idle / 2**20, 1),
                    "results": results,
                }
            )
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
