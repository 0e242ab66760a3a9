"""MindSpore's "Model Transformation" tutorial: train on 8 processes, reshard, fine-tune and infer on 4.

    python examples/reshard_8_to_4.py                          # CI size: 8 + 4 gloo processes on CPU, ~2 minutes
    python examples/reshard_8_to_4.py --per-rank-conversion    # one process per target rank converts its file
    python examples/reshard_8_to_4.py --pipeline               # stage 1 in 2 pipeline stages, merged layouts
    python examples/reshard_8_to_4.py --train-samples 60000 --stage1-epochs 2 --stage2-epochs 1   # a full run

The tutorial's MLP ``layer1 = Dense(in, 512), layer2 = Dense(512, 512), layer3 = Dense(512, 10)`` with ReLUs, on
MNIST as ``examples/digits.py`` prepares it for the MindSpore recipes (32x32, normalised), so ``in`` = 1024 instead of 784.

1. Stage 1, 8 processes: ``SinkModelParallelStrategy(data_parallel_size=4, tensor_parallel_size=2)``, sharded as
   the tutorial's first strategy splits layer1's and layer3's weights: layer1 column-wise (its output features over
   the 2 tensor-parallel ranks), layer3 row-wise (its input features), layer2 not tensor-parallel. FSDP2 over the
   4 data-parallel ranks also shards parameters and optimizer state (the strategy's data parallelism is FSDP2, so
   MindSpore's "optimizer parallel off" has no equivalent here). ``ReshardCheckpoint`` saves the final checkpoint
   and converts it to the stage-2 layout, predicted beforehand by ``infer_layout`` (``lightning-sink layout``).
2. Inference, 4 processes: ``Trainer.test(ckpt_path=<resharded folder>)`` on the stage-2 mesh (2 x 2): each rank
   loads only its own converted file.
3. Stage 2, 4 processes: ``SinkModelParallelStrategy(2, 2)`` with another sharding - layer1 row-wise (its input
   features split, the tutorial's target strategy), layer2 column-wise and layer3 row-wise - and FSDP2 over 2
   data-parallel ranks, which shards the optimizer state (MindSpore's optimizer parallel). ``Trainer.fit(
   ckpt_path=<resharded folder>)`` continues: the global step goes on and the first loss is stage 1's last.

``--pipeline``: stage 1 runs instead as 2 pipeline stages of 4 processes (``pipeline_stage1.py``; Lightning has no
pipeline strategy, so it is a plain PyTorch loop). Each rank saves ``rank_{r}/checkpoint_{r}.pt`` and each stage
its layout file; ``merge_pipeline_strategies`` merges those into the source layout and ``transform_checkpoints``
converts the rank files to the stage-2 layout. The files hold no Lightning loops, so stage 2 fills the model and
optimizer from them with ``LoadResharded`` (``load_resharded_checkpoint`` + ``load_into_state_dict``) instead of
``ckpt_path``, and its global step starts at 0.

The "probe loss" is the loss on a fixed set of training samples, computed on every rank with the same input (a
valid collective): at the end of stage 1, right after stage 2 loaded the converted checkpoint, and at its end.
Lightning's launcher starts ranks 1..N-1 by re-running this script with the same arguments.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchmetrics.classification import MulticlassAccuracy

from lightning_sink import SinkModelParallelStrategy
from lightning_sink.callbacks import ReshardCheckpoint

from digits import DigitsDataModule, exit_on_missing_data

# Tensor-parallel plans, by the tutorial's stages; the Sequential's layers are "1" (layer1), "3" (layer2), "5" (layer3).
PLANS = {
    "stage1": {"1": ColwiseParallel(output_layouts=Replicate()), "5": RowwiseParallel(input_layouts=Replicate())},
    "stage2": {"1": RowwiseParallel(input_layouts=Replicate()), "3": ColwiseParallel(), "5": RowwiseParallel()},
}
MESHES = {"stage1": (4, 2), "stage2": (2, 2)}


class SeedMLP(pl.LightningModule):
    """The tutorial's three Dense layers with ReLUs, sharded in ``configure_model`` by ``plan``."""

    def __init__(self, plan: str = "stage1", lr: float = 1e-3, in_features: int = 1024) -> None:
        super().__init__()
        if plan not in PLANS:
            raise ValueError(f"plan={plan!r} is not valid: choose one of {sorted(PLANS)}.")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        self.test_accuracy = MulticlassAccuracy(num_classes=10, average="micro")

    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):
            return  # already sharded
        mesh = self.device_mesh
        parallelize_module(self.net, mesh["tensor_parallel"], PLANS[self.hparams.plan])
        for index in (1, 3, 5):
            fully_shard(self.net[index], mesh=mesh["data_parallel"])
        fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_accuracy(self.net(x).argmax(dim=1), y)
        self.log("test_accuracy", self.test_accuracy, on_epoch=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class ProbeLoss(Callback):
    """Prints the loss on a fixed batch of training samples at the start and end of fit (rank 0 prints)."""

    def __init__(self, stage: str, samples: int) -> None:
        self.stage, self.samples = stage, samples

    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        x, y = (t[: self.samples] for t in trainer.datamodule.train_set.tensors)
        with torch.no_grad():
            loss = F.cross_entropy(pl_module.net(x), y).item()
        if trainer.is_global_zero:
            print(f"{self.stage} {when}: global_step {trainer.global_step} probe loss {loss:.6f}", flush=True)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe(trainer, pl_module, "start")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe(trainer, pl_module, "end")


class LoadResharded(Callback):
    """Fills the model (and, before fit, the optimizer) from this rank's file of a resharded folder whose source
    was not a Lightning checkpoint, so there are no loops to resume and ``ckpt_path`` does not apply."""

    def __init__(self, folder: Path, prefix: str = "checkpoint_") -> None:
        self.folder, self.prefix = Path(folder), prefix

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module, with_optimizer=False)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._load(trainer, pl_module, with_optimizer=True)

    def _load(self, trainer: pl.Trainer, pl_module: pl.LightningModule, with_optimizer: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from lightning_sink.layout import flatten_like_dcp
        from lightning_sink.reshard import load_into_state_dict, load_resharded_checkpoint

        rank = trainer.global_rank
        checkpoint = load_resharded_checkpoint(self.folder / f"rank_{rank}" / f"{self.prefix}{rank}.pt")
        state = {"state_dict": get_model_state_dict(pl_module)}
        if with_optimizer:
            state["optimizer_0"] = get_optimizer_state_dict(pl_module, trainer.optimizers[0])
        missing = [
            fqn
            for fqn, value in flatten_like_dcp(state).items()
            if isinstance(value, torch.Tensor) and fqn not in checkpoint["tensors"]
        ]
        if missing:
            raise ValueError(f"resharded file of rank {rank} lacks tensors {missing[:5]}")
        load_into_state_dict(state, checkpoint, strict=False)  # the optimizer's settings stay configure_optimizers'
        set_model_state_dict(pl_module, state["state_dict"])
        if with_optimizer:
            set_optimizer_state_dict(pl_module, trainer.optimizers[0], state["optimizer_0"])


def trainer_for(stage: str, args: argparse.Namespace, epochs: int, callbacks: list) -> pl.Trainer:
    dp, tp = MESHES[stage]
    strategy = SinkModelParallelStrategy(
        dp, tp, accumulation_steps=args.accumulation_steps, process_group_backend="gloo"
    )
    return pl.Trainer(
        accelerator="cpu",
        devices=dp * tp,
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=callbacks,
    )


def data(args: argparse.Namespace) -> DigitsDataModule:
    return DigitsDataModule(
        args.data_dir,
        batch_size=args.batch_size,
        max_train_samples=args.train_samples,
        max_test_samples=args.test_samples,
    )


def run_stage1(args: argparse.Namespace) -> None:
    """8 processes: train, then (unless --per-rank-conversion) ReshardCheckpoint to the stage-2 layout."""
    out = Path(args.out_dir)
    callbacks: list[Callback] = [ProbeLoss("stage 1", args.probe_samples)]
    if not args.per_rank_conversion:
        callbacks.append(
            ReshardCheckpoint(
                out / "stage2_layout.json",
                out / "resharded",
                ckpt_prefix="checkpoint_",
                src_dir=out / "stage1",
                overwrite=True,
            )
        )
    trainer = trainer_for("stage1", args, args.stage1_epochs, callbacks)
    pl.seed_everything(0, verbose=False)
    started = time.perf_counter()
    trainer.fit(SeedMLP("stage1", lr=args.lr), datamodule=data(args))
    if args.per_rank_conversion:
        trainer.save_checkpoint(out / "stage1", weights_only=False)
    if trainer.is_global_zero:
        print(
            f"stage 1: 8 processes, mesh 4 x 2, {trainer.global_step} updates in {time.perf_counter() - started:.1f} s"
        )


def run_stage2(args: argparse.Namespace) -> None:
    """4 processes: inference on the converted checkpoint, then fine-tuning from it."""
    resharded = Path(args.out_dir) / "resharded"
    module = data(args)
    # A Lightning source resumes through ckpt_path; the pipeline's rank files are loaded by LoadResharded.
    loading, ckpt_path = ([LoadResharded(resharded)], None) if args.pipeline else ([], resharded)
    tester = trainer_for("stage2", args, 1, loading)
    accuracy = tester.test(SeedMLP("stage2"), datamodule=module, ckpt_path=ckpt_path, verbose=False)[0]["test_accuracy"]
    if tester.is_global_zero:
        print(
            f"inference on the converted checkpoint (4 processes, mesh 2 x 2): test accuracy {accuracy:.4f}"
            f" on {len(module.test_set)} samples",
            flush=True,
        )
    epochs = args.stage2_epochs if args.pipeline else args.stage1_epochs + args.stage2_epochs
    trainer = trainer_for("stage2", args, epochs, [*loading, ProbeLoss("stage 2", args.probe_samples)])
    started = time.perf_counter()
    trainer.fit(SeedMLP("stage2", lr=args.lr), datamodule=module, ckpt_path=ckpt_path)
    if trainer.is_global_zero:
        print(
            f"stage 2: 4 processes, mesh 2 x 2, global_step {trainer.global_step} after"
            f" {time.perf_counter() - started:.1f} s"
        )


def convert_rank(args: argparse.Namespace) -> None:
    """One target rank's file, from only the source files it needs (MindSpore's transform_checkpoint_by_rank)."""
    from lightning_sink.reshard import rank_list_for_transform, transform_checkpoint_by_rank

    out, rank = Path(args.out_dir), args.convert_rank
    if args.pipeline:  # the pipeline stages' rank files, described by the merged stage layouts
        source_layout = out / "stage1_pipeline" / "merged_layout.json"
        needed = rank_list_for_transform(rank, source_layout, out / "stage2_layout.json")
        files = {
            source: out / "stage1_pipeline" / "checkpoints" / f"rank_{source}" / f"checkpoint_{source}.pt"
            for source in needed
        }
    else:  # the DCP folder of stage 1, which holds its own layout
        source_layout = None
        needed = rank_list_for_transform(rank, out / "stage1", out / "stage2_layout.json")
        files = {source: out / "stage1" / f"__{source}_0.distcp" for source in needed}
    result = transform_checkpoint_by_rank(
        rank,
        files,
        out / "resharded" / f"rank_{rank}" / f"checkpoint_{rank}.pt",
        source_layout,
        out / "stage2_layout.json",
        overwrite=True,
    )
    print(f"target rank {rank}: read source ranks {needed}, wrote {result.bytes_written} bytes", flush=True)


def convert_pipeline_stages(args: argparse.Namespace) -> None:
    """Stage 1 as 2 pipeline stages, then MindSpore's steps: merge the stage layouts, convert the rank files."""
    from lightning_sink.layout import merge_pipeline_strategies
    from lightning_sink.reshard import transform_checkpoints

    from pipeline_stage1 import run_pipeline_stage1

    out = Path(args.out_dir)
    started = time.perf_counter()
    run_pipeline_stage1(args)
    print(f"stage 1: 8 processes in 2 pipeline stages of 2 x 2 in {time.perf_counter() - started:.1f} s", flush=True)
    stage_files = out / "stage1_pipeline"
    merged = merge_pipeline_strategies(stage_files / "strategy", stage_files / "merged_layout.json")
    print(
        f"merged {merged.pipeline.num_stages} stage layouts: {len(merged.tensors)} tensors on mesh"
        f" {dict(zip(merged.mesh.dim_names, merged.mesh.shape))}",
        flush=True,
    )
    if not args.per_rank_conversion:
        transform_checkpoints(
            stage_files / "checkpoints",
            out / "resharded",
            "checkpoint_",
            stage_files / "merged_layout.json",
            out / "stage2_layout.json",
            overwrite=True,
        )


def run(command: list[str]) -> None:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    subprocess.run([sys.executable, __file__, *command], check=True, env=env)


def orchestrate(args: argparse.Namespace, argv: list[str]) -> None:
    """The tutorial's steps in order, each stage in its own set of processes."""
    from lightning_sink.layout import save_layout
    from lightning_sink.layout_inference import infer_layout

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Compile the target network, MindSpore-style: its layout, predicted without launching its 4 processes.
    save_layout(
        infer_layout(SeedMLP, *MESHES["stage2"], init_args={"plan": "stage2", "lr": args.lr}),
        out / "stage2_layout.json",
    )
    if args.pipeline:
        convert_pipeline_stages(args)
    else:
        run([*argv, "--run", "stage1"])
    if args.per_rank_conversion:
        import shutil

        shutil.rmtree(out / "resharded", ignore_errors=True)
        workers = [
            subprocess.Popen([sys.executable, __file__, *argv, "--convert-rank", str(rank)])
            for rank in range(MESHES["stage2"][0] * MESHES["stage2"][1])
        ]
        if any(worker.wait() != 0 for worker in workers):
            raise SystemExit("a per-rank conversion failed (see its error above)")
    run([*argv, "--run", "stage2"])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=None, help="folder holding MNIST/raw (torchvision layout)")
    parser.add_argument("--out-dir", default="runs/reshard_8_to_4")
    parser.add_argument("--train-samples", type=int, default=1024)
    parser.add_argument("--test-samples", type=int, default=1000)
    parser.add_argument("--probe-samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size per data-parallel rank")
    parser.add_argument("--accumulation-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--stage1-epochs", type=int, default=1)
    parser.add_argument("--stage2-epochs", type=int, default=1)
    parser.add_argument(
        "--per-rank-conversion",
        action="store_true",
        help="convert with transform_checkpoint_by_rank, one process per target rank",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="stage 1 in 2 pipeline stages (plain PyTorch), merged with merge_pipeline_strategies",
    )
    parser.add_argument("--run", choices=("stage1", "stage2"), help=argparse.SUPPRESS)
    parser.add_argument("--convert-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run == "stage1":
        run_stage1(args)
    elif args.run == "stage2":
        run_stage2(args)
    elif args.convert_rank is not None:
        convert_rank(args)
    else:
        orchestrate(args, argv)


if __name__ == "__main__":
    exit_on_missing_data(main)
