"""``ReshardCheckpoint``: at the end of fit, save the final distributed checkpoint and reshard it for another layout.

MindSpore's multi-stage recipe (train on 8 cards, transform the checkpoint, fine-tune or infer on 4) as one callback:

1. the final state is saved as a DCP folder with its layout file in ``src_dir``:
   - a model-parallel run (``SinkModelParallelStrategy``, or Lightning's ``ModelParallelStrategy`` with
     ``save_distributed_checkpoint=True``) saves through ``trainer.save_checkpoint`` on every rank;
   - a one-device run (``SinkStrategy``, Lightning's single-device strategy) writes, with ``source="dcp"`` (the
     default), the full model and optimizer state as a one-rank DCP folder with the structure a model-parallel run
     writes (``{"state_dict": get_model_state_dict, "optimizer_0": get_optimizer_state_dict}``, FQN-keyed), so
     its names match a model-parallel target layout, plus Lightning's metadata (``meta.pt``); with
     ``source="ckpt"``, Lightning's own one-device checkpoint ``src_dir/last.ckpt`` (what stock Lightning resumes
     from), converted as a one-device source. A ``.ckpt`` keys optimizer state by parameter index, so that choice
     needs each optimizer to hold the module's parameters in the module's order (checked before training);
2. global rank 0 converts it with ``transform_checkpoints`` (in this process, or in ``workers`` processes, one target
   rank each) into ``dst_dir/rank_{r}/{ckpt_prefix}{r}.pt`` with a progress bar, while the other ranks wait.
   The engine stages the whole output beside ``dst_dir`` and commits it with one rename, manifest last; converting
   on rank 0 keeps that single commit (spreading target ranks over the training ranks would need a second,
   hand-written commit protocol for a gain that only matters for checkpoints far larger than a host's memory -
   use ``workers`` for parallelism);
3. rank 0 runs ``verify_checkpoint`` (digests, completeness, every file against the layout).

A failure leaves nothing at ``dst_dir`` (the engine removes its staging folder) and raises on every rank with the
reason; the source checkpoint in ``src_dir`` stays (it is a complete, committed checkpoint).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.checkpoint_format.destination import (
    check_destination_path,
    check_replaceable,
    check_save_replaceable,
    is_distributed_save_file,
)
from lightning_sink.checkpoint_format.fs import check_file_prefix
from lightning_sink.checkpoint_format.resume_agreement import agree_on_resume
from lightning_sink.checkpoint_format.sink_section import drop_tensor_digests
from lightning_sink.counts import check_count_fits
from lightning_sink.layout import load_layout
from lightning_sink.reshard import ReshardReport, transform_checkpoints, verify_checkpoint

__all__ = ["ONE_DEVICE_CHECKPOINT", "SOURCES", "ReshardCheckpoint"]

SOURCES = ("dcp", "ckpt")
ONE_DEVICE_CHECKPOINT = "last.ckpt"  # in src_dir, with source="ckpt"


def _path(name: str, value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r} must be a path (str or os.PathLike).")
    if not os.fspath(value):
        raise ValueError(f"{name}={value!r} is empty: pass a path.")
    return Path(value)


class ReshardCheckpoint(Callback):
    """Save the final checkpoint at ``on_fit_end`` and reshard it to the layout in ``dst_strategy_file``.

    Args:
        dst_strategy_file: the target layout (e.g. written by ``lightning-sink layout``).
        dst_dir: the resharded output folder (``Trainer.fit(ckpt_path=dst_dir)`` on the target mesh loads it).
        ckpt_prefix: rank files are ``rank_{r}/{ckpt_prefix}{r}.pt``.
        workers: None: convert in rank 0's process; k: in k spawned processes (one target rank each).
        src_dir: where the final distributed checkpoint is saved; default ``<dst_dir>.source`` beside ``dst_dir``.
        overwrite: replace a ``dst_dir`` that holds a different checkpoint.
        source: what a one-device run saves in ``src_dir`` and converts: ``"dcp"``, a one-rank DCP folder
            (parameter names recorded); ``"ckpt"``, Lightning's ``last.ckpt``. Model-parallel runs save DCP.
    """

    def __init__(
        self,
        dst_strategy_file: str | os.PathLike,
        dst_dir: str | os.PathLike,
        ckpt_prefix: str = "checkpoint_",
        workers: int | None = None,
        src_dir: str | os.PathLike | None = None,
        overwrite: bool = False,
        source: str = "dcp",
    ) -> None:
        self.dst_strategy_file = _path("dst_strategy_file", dst_strategy_file)
        self.dst_dir = _path("dst_dir", dst_dir)
        check_destination_path(self.dst_dir, {}, "dst_dir")  # not the working, home or root folder, nor a link
        self.src_dir = (
            _path("src_dir", src_dir) if src_dir is not None else self.dst_dir.with_name(f"{self.dst_dir.name}.source")
        )
        if not isinstance(ckpt_prefix, str) or not ckpt_prefix:
            raise ValueError(
                f"ckpt_prefix={ckpt_prefix!r} must be a non-empty file-name prefix without path separators."
            )
        check_file_prefix(ckpt_prefix, "ckpt_prefix")
        check_count_fits("workers", workers)
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers={workers!r} must be None (convert in rank 0's process) or an int >= 1.")
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite={overwrite!r} must be a bool.")
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not one of {list(SOURCES)}.")
        src, dst = self.src_dir.resolve(), self.dst_dir.resolve()
        if src == dst or src in dst.parents or dst in src.parents:
            raise ValueError(
                f"src_dir={str(self.src_dir)!r} and dst_dir={str(self.dst_dir)!r} must not be or contain one another."
            )
        check_destination_path(self.src_dir, {}, "src_dir")  # the source save replaces src_dir as a whole too
        self.ckpt_prefix, self.workers, self.overwrite, self.source = ckpt_prefix, workers, overwrite, source
        # Folders holding what this callback did not write fail here, not after the training (and again at fit end).
        self._check_src_dir(self.src_dir)
        check_replaceable(self.dst_dir.resolve(), "dst_dir")
        self.report: ReshardReport | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):
            if not compat.saves_distributed_checkpoint(strategy):
                raise ValueError(
                    "ReshardCheckpoint needs distributed (DCP) checkpoints: use"
                    " ModelParallelStrategy(save_distributed_checkpoint=True) or SinkModelParallelStrategy."
                )
            if self.source != "dcp":
                raise ValueError(
                    f"ReshardCheckpoint(source={self.source!r}) is for one-device runs; a model-parallel run's"
                    " checkpoint is a DCP folder: pass source='dcp'."
                )
        elif trainer.world_size != 1:
            raise ValueError(
                f"ReshardCheckpoint supports model-parallel strategies and one-device runs, not"
                f" {type(strategy).__name__} on {trainer.world_size} processes."
            )
        # A missing or invalid target layout fails before training, on every rank (rank 0 reads the file).
        error = None
        if trainer.is_global_zero:
            try:
                load_layout(self.dst_strategy_file)
            except (ValueError, FileNotFoundError) as failure:
                error = failure
        self._raise_everywhere(strategy, error, f"reading the target layout {str(self.dst_strategy_file)!r}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.source == "ckpt":  # (optimizers exist from here on; training has not started)
            for index, optimizer in enumerate(trainer.optimizers):
                _check_parameter_order(pl_module, optimizer, index)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.interrupted:  # (an exception or a stop signal: the state is not final)
            return
        strategy = trainer.strategy
        src = Path(strategy.broadcast(str(self.src_dir)))
        error: Exception | None = None
        if trainer.is_global_zero:
            try:
                self._check_src_dir(src)  # (files may have been added since construction)
            except ValueError as failure:
                error = failure
        self._raise_everywhere(strategy, error, f"checking src_dir {str(src)!r}")
        if isinstance(strategy, ModelParallelStrategy):
            trainer.save_checkpoint(src, weights_only=False)  # every rank writes its shards, committed atomically
        elif self.source == "ckpt":
            src.mkdir(parents=True, exist_ok=True)
            src = src / ONE_DEVICE_CHECKPOINT
            trainer.save_checkpoint(src, weights_only=False)  # Lightning writes a whole file, then renames it
        else:
            _save_one_rank_dcp(trainer, pl_module, src)
        error = None
        if trainer.is_global_zero:
            try:
                self.report = self._transform_and_verify(src)
            except Exception as failure:  # reported to every rank, then raised
                error = failure
        self._raise_everywhere(strategy, error, f"resharding {str(src)!r}")
        # the target mesh resumes from dst_dir: every rank must see the output rank 0 committed there
        agree_on_resume(self.dst_dir, trainer.world_size, what="use the resharded checkpoint")

    def _check_src_dir(self, src: Path) -> None:
        """The save replaces ``src_dir`` (or, with ``source="ckpt"``, writes ``last.ckpt`` into it): only where it
        holds nothing but what such a save writes (a previous save of this callback)."""
        if self.source == "ckpt":
            check_save_replaceable(src, "src_dir", lambda name: name == ONE_DEVICE_CHECKPOINT, "Lightning's last.ckpt")
        else:
            check_save_replaceable(src, "src_dir", is_distributed_save_file, "a distributed checkpoint save")

    @staticmethod
    def _raise_everywhere(strategy: Any, error: Exception | None, what: str) -> None:
        """Rank 0's error raised on every rank (the others would otherwise wait for it in a collective)."""
        message = strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(f"ReshardCheckpoint: {what} failed on global rank 0: {message}")

    def _transform_and_verify(self, src: Path) -> ReshardReport:
        bar = _ProgressBar(f"resharding {src.name} -> {self.dst_dir.name}")
        try:
            report = transform_checkpoints(
                src,
                self.dst_dir,
                self.ckpt_prefix,
                None,
                self.dst_strategy_file,
                workers=self.workers,
                overwrite=self.overwrite,
                progress=bar.update,
            )
        finally:
            bar.close()
        try:
            verify_checkpoint(self.dst_dir)
        except Exception:
            shutil.rmtree(self.dst_dir, ignore_errors=True)  # committed but not whole: leave nothing that looks whole
            raise
        return report


def _check_parameter_order(module: pl.LightningModule, optimizer: Any, index: int) -> None:
    """A ``.ckpt`` names optimizer state by position: the one-device source maps position i to the i-th entry of the
    module's state dict that is not a buffer. Refuse, before training, an optimizer for which that is wrong."""
    buffers = {name for name, _ in module.named_buffers()}
    by_position = [name for name in module.state_dict(keep_vars=True) if name not in buffers]
    name_of = {id(param): name for name, param in module.named_parameters()}
    held = [name_of.get(id(param), "<not a module parameter>") for g in optimizer.param_groups for param in g["params"]]
    if held != by_position:
        first = next((i for i, (a, b) in enumerate(zip(held, by_position)) if a != b), min(len(held), len(by_position)))
        raise ValueError(
            f"ReshardCheckpoint(source='ckpt'): optimizer {index} holds {len(held)} parameters, at position {first}"
            f" {held[first] if first < len(held) else 'none'!r}, where the module's order has"
            f" {by_position[first] if first < len(by_position) else 'none'!r}; a .ckpt names optimizer state by"
            " position, so pass source='dcp' (a DCP checkpoint records parameter names)."
        )


class _ProgressBar:
    """Target bytes written, as the engine reports them, on stderr (tqdm: Lightning's progress bar needs it too)."""

    def __init__(self, description: str) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            desc=description,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            leave=True,
            dynamic_ncols=True,
        )

    def update(self, done: int, total: int) -> None:
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._bar.close()


class _CaptureCheckpoint(CheckpointIO):
    """Keeps the dict ``Trainer.save_checkpoint`` hands to the strategy's CheckpointIO instead of writing it: the
    full checkpoint as the strategy completes it, with no file written and read back (unpickled) in between."""

    def __init__(self) -> None:
        self.checkpoint: dict[str, Any] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.checkpoint = checkpoint

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        raise NotImplementedError("only captures a checkpoint being saved")

    @override
    def remove_checkpoint(self, path: Any) -> None:
        pass


def _checkpoint_dict(trainer: pl.Trainer, target: Path) -> dict[str, Any]:
    strategy = trainer.strategy
    capture, original = _CaptureCheckpoint(), strategy.checkpoint_io
    strategy.checkpoint_io = capture
    try:
        trainer.save_checkpoint(target, weights_only=False)  # (the full state: optimizers, callbacks, loops)
    finally:
        strategy.checkpoint_io = original
    if capture.checkpoint is None:
        raise RuntimeError(f"{type(strategy).__name__} did not hand its checkpoint to its CheckpointIO")
    return capture.checkpoint


def _save_one_rank_dcp(trainer: pl.Trainer, pl_module: pl.LightningModule, target: Path) -> None:
    """A one-device run's full state as the one-rank DCP folder a model-parallel run would write (module docstring).

    Lightning's metadata (loops, callbacks, schedulers, the strategy's own state) is what ``trainer.save_checkpoint``
    writes minus the weights and optimizer states, which go through DCP under FQN keys instead.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    target.parent.mkdir(parents=True, exist_ok=True)
    metadata = _checkpoint_dict(trainer, target)
    metadata.pop("state_dict", None)
    metadata.pop("optimizer_states", None)
    metadata = drop_tensor_digests(metadata)  # this folder's files have SAVE_DIGESTS.json instead
    state: dict[str, Any] = {"state_dict": get_model_state_dict(pl_module)}
    for index, optimizer in enumerate(trainer.optimizers):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(pl_module, optimizer)
    with warnings.catch_warnings():  # DCP warns that it saves without a process group: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_dcp_atomically(state, metadata, target, global_rank=0, world_size=1, barrier=lambda: None)
