"""A cluster on one machine: ``Trainer(num_nodes=NODES, devices=DEVICES)`` with SinkDDPStrategy and
SinkModelParallelStrategy(2, 2) on gloo, started once per node by ``tests.distributed.run_nodes``.

Run as ``python -m tests.strategies.multinode_worker OUT_DIR NODES DEVICES SCENARIO [SCENARIO ...]`` in the node's own
working directory. ``OUT_DIR`` (absolute) is the shared filesystem; ``private/`` (relative) is each node's own disk.
Rank 0 writes what the test compares into ``OUT_DIR/<scenario>.pt``; in the scenarios that must fail, every rank
writes ``OUT_DIR/<scenario>.rank<r>.json``: the error it got, how long it took, what its node's ``private/`` holds.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_sink import SinkDDPStrategy, SinkModelParallelStrategy
from tests.distributed import CollectiveCounter
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import MixedMeshClassifier, full_parameters

SAMPLES, MICRO_BATCH, STEPS, DP, TP = 16, 2, 2, 2, 2
CLIP_NORM, CLIP_VALUE = 0.05, 0.01
# The process group's timeout also bounds how long a rank waits for rank 0's store at start-up, which on a busy
# machine takes a minute; the errors under test must come far sooner (they are checked to take under ERROR_WITHIN).
PG_TIMEOUT = timedelta(seconds=180)
ERROR_WITHIN = 30.0
PRIVATE = Path("private")  # relative: each node's working directory, i.e. node-local disk


def trainer_for(strategy, nodes: int, devices: int, **kwargs):
    return quiet_trainer(strategy=strategy, num_nodes=nodes, devices=devices, **{"max_epochs": 1, **kwargs})


def data():
    return loader(make_dataset(num_samples=SAMPLES), MICRO_BATCH)


def ddp_strategy() -> SinkDDPStrategy:
    return SinkDDPStrategy(accumulation_steps=STEPS, process_group_backend="gloo", timeout=PG_TIMEOUT)


def mp_strategy() -> SinkModelParallelStrategy:
    return SinkModelParallelStrategy(
        data_parallel_size=DP,
        tensor_parallel_size=TP,
        accumulation_steps=STEPS,
        process_group_backend="gloo",
        timeout=PG_TIMEOUT,
    )


def save(out_dir: Path, name: str, payload: dict) -> None:
    if dist.get_rank() == 0:
        torch.save(payload, out_dir / f"{name}.pt")


def expect_failure(out_dir: Path, name: str, action) -> None:
    """Run ``action`` (which must raise on this rank), then record what it raised and how long it took."""
    start, error = time.monotonic(), None
    try:
        action()
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    private = sorted(path.name for path in PRIVATE.iterdir()) if PRIVATE.is_dir() else []
    record = {"error": error, "seconds": time.monotonic() - start, "private": private}
    (out_dir / f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(record))


def on_node_zero_only(copy) -> None:
    """``copy`` runs on node 0 (its first rank): the result is on node 0's disk only."""
    if dist.get_rank() == 0:
        PRIVATE.mkdir(exist_ok=True)
        copy()
    dist.barrier()


def on_each_node(devices: int, copy) -> None:
    """``copy(node)`` runs once on every node (its first rank), each writing to its own disk."""
    if dist.get_rank() % devices == 0:
        PRIVATE.mkdir(exist_ok=True)
        copy(dist.get_rank() // devices)
    dist.barrier()


def ddp_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    model = TinyClassifier(optimizer="adamw", lr=0.01)
    trainer = trainer_for(ddp_strategy(), nodes, devices)
    trainer.fit(model, data())
    trainer.save_checkpoint(out_dir / "ddp.ckpt")
    save(out_dir, "ddp", {"params": {n: p.detach().clone() for n, p in model.named_parameters()}})


def mp_fit(nodes: int, devices: int, algorithm: str):
    model = MixedMeshClassifier(optimizer="adamw", lr=0.01)
    counter = CollectiveCounter(("all_reduce",))
    clip = CLIP_NORM if algorithm == "norm" else CLIP_VALUE
    trainer = trainer_for(
        mp_strategy(), nodes, devices, callbacks=[counter], gradient_clip_val=clip, gradient_clip_algorithm=algorithm
    )
    trainer.fit(model, data())
    return model, trainer, counter


def mp_norm_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    model, trainer, counter = mp_fit(nodes, devices, "norm")
    params = full_parameters(model)
    trainer.save_checkpoint(out_dir / "mp_ckpt")
    save(out_dir, "mp_norm", {"params": params, "per_batch": counter.per_batch, "global_step": trainer.global_step})
    if nodes > 1:  # a node-private checkpoint path: the save must fail on every rank, leaving nothing
        expect_failure(out_dir, "mp_save_private", lambda: trainer.save_checkpoint(PRIVATE / "mp_ckpt"))


def mp_value_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    model, trainer, _ = mp_fit(nodes, devices, "value")
    save(out_dir, "mp_value", {"params": full_parameters(model), "global_step": trainer.global_step})


def ddp_resume_private_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    on_node_zero_only(lambda: shutil.copy(out_dir / "ddp.ckpt", PRIVATE / "ddp_copy.ckpt"))
    trainer = trainer_for(ddp_strategy(), nodes, devices, max_steps=4)
    fit = lambda: trainer.fit(TinyClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "ddp_copy.ckpt")  # noqa: E731
    expect_failure(out_dir, "ddp_resume_private", fit)


def mp_resume_private_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    on_node_zero_only(lambda: shutil.copytree(out_dir / "mp_ckpt", PRIVATE / "mp_copy"))
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=4)
    fit = lambda: trainer.fit(MixedMeshClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "mp_copy")  # noqa: E731
    expect_failure(out_dir, "mp_resume_private", fit)


def resharded_resume_private_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    from lightning_sink.reshard import transform_checkpoints

    source = out_dir / "mp_ckpt"
    on_node_zero_only(
        lambda: transform_checkpoints(source, PRIVATE / "resharded", "checkpoint_", None, source / "layout.json")
    )
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=4)
    fit = lambda: trainer.fit(  # noqa: E731
        MixedMeshClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "resharded"
    )
    expect_failure(out_dir, "resharded_resume_private", fit)


def reshard_callback_private_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """ReshardCheckpoint whose source folder is node-private: its save at the end of fit fails on every rank."""
    from lightning_sink.callbacks import ReshardCheckpoint

    callback = ReshardCheckpoint(out_dir / "mp_ckpt" / "layout.json", out_dir / "resharded", src_dir=PRIVATE / "src")
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=1, callbacks=[callback])
    fit = lambda: trainer.fit(MixedMeshClassifier(optimizer="adamw", lr=0.01), data())  # noqa: E731
    expect_failure(out_dir, "reshard_callback_private", fit)


def ddp_resume_different_steps_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """Each node's disk holds a checkpoint at the same path, node n's from step n + 1 (of a shared run)."""
    steps = ModelCheckpoint(dirpath=out_dir / "ddp_steps", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    trainer = trainer_for(ddp_strategy(), nodes, devices, max_epochs=2, callbacks=[steps], enable_checkpointing=True)
    trainer.fit(TinyClassifier(optimizer="adamw", lr=0.01), data())
    on_each_node(
        devices, lambda node: shutil.copy(out_dir / "ddp_steps" / f"step={node + 1}.ckpt", PRIVATE / "resume.ckpt")
    )
    trainer = trainer_for(ddp_strategy(), nodes, devices, max_steps=4)
    fit = lambda: trainer.fit(TinyClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "resume.ckpt")  # noqa: E731
    expect_failure(out_dir, "ddp_resume_different_steps", fit)


def ddp_resume_last_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """``ckpt_path="last"`` resolves to node 0's last.ckpt there and to nothing on node 1."""
    folder = PRIVATE / "last_dir"

    def copy(node: int) -> None:
        if node == 0:
            folder.mkdir()
            shutil.copy(out_dir / "ddp.ckpt", folder / "last.ckpt")

    on_each_node(devices, copy)
    last = ModelCheckpoint(dirpath=folder, save_last=True)
    trainer = trainer_for(ddp_strategy(), nodes, devices, max_steps=4, callbacks=[last], enable_checkpointing=True)
    fit = lambda: trainer.fit(TinyClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path="last")  # noqa: E731
    expect_failure(out_dir, "ddp_resume_last", fit)


def mp_resume_different_steps_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """Node 0's disk holds the DCP folder of step 2, node 1's the one of step 1, at the same path."""
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=1)
    trainer.fit(MixedMeshClassifier(optimizer="adamw", lr=0.01), data())
    trainer.save_checkpoint(out_dir / "mp_step1")
    sources = [out_dir / "mp_ckpt", out_dir / "mp_step1"]
    on_each_node(devices, lambda node: shutil.copytree(sources[node], PRIVATE / "mp_resume"))
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=4)
    fit = lambda: trainer.fit(MixedMeshClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "mp_resume")  # noqa: E731
    expect_failure(out_dir, "mp_resume_different_steps", fit)


def reshard_callback_private_output_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """ReshardCheckpoint whose output folder is node-private: rank 0 converts there, the other node sees nothing."""
    from lightning_sink.callbacks import ReshardCheckpoint

    callback = ReshardCheckpoint(
        out_dir / "mp_ckpt" / "layout.json", PRIVATE / "resharded_out", src_dir=out_dir / "reshard_src"
    )
    trainer = trainer_for(mp_strategy(), nodes, devices, max_steps=1, callbacks=[callback])
    fit = lambda: trainer.fit(MixedMeshClassifier(optimizer="adamw", lr=0.01), data())  # noqa: E731
    expect_failure(out_dir, "reshard_callback_private_output", fit)


def ddp_resume_uncaught_scenario(out_dir: Path, nodes: int, devices: int) -> None:
    """As a user's script: the resume's error is not caught (the test placed each node's ``private/resume.ckpt``)."""
    trainer = trainer_for(ddp_strategy(), nodes, devices, max_steps=4)
    trainer.fit(TinyClassifier(optimizer="adamw", lr=0.01), data(), ckpt_path=PRIVATE / "resume.ckpt")


SCENARIOS = {
    "ddp": ddp_scenario,
    "mp_norm": mp_norm_scenario,
    "mp_value": mp_value_scenario,
    "ddp_resume_private": ddp_resume_private_scenario,
    "mp_resume_private": mp_resume_private_scenario,
    "resharded_resume_private": resharded_resume_private_scenario,
    "reshard_callback_private": reshard_callback_private_scenario,
    "ddp_resume_different_steps": ddp_resume_different_steps_scenario,
    "ddp_resume_last": ddp_resume_last_scenario,
    "mp_resume_different_steps": mp_resume_different_steps_scenario,
    "reshard_callback_private_output": reshard_callback_private_output_scenario,
    "ddp_resume_uncaught": ddp_resume_uncaught_scenario,
}

if __name__ == "__main__":
    out, node_count, device_count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for scenario in sys.argv[4:]:
        SCENARIOS[scenario](out, node_count, device_count)
