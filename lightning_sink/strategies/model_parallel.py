"""``SinkModelParallelStrategy``: the step programs on FSDP2 + tensor parallelism, one reduction per window."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.nn import Parameter
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.agreement import agree_on_checkpoint_path
from lightning_sink.checkpoint_format.atomic import check_checkpoint_dir
from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically
from lightning_sink.checkpoint_format.dcp_load import RankInWorld, load_dcp_folder
from lightning_sink.checkpoint_format.resharded_folder import is_resharded_checkpoint
from lightning_sink.checkpoint_format.resharded_load import adapt_sink_state, load_resharded_into_strategy
from lightning_sink.checkpoint_format.resume_agreement import agree_on_resume
from lightning_sink.counts import check_count_fits
from lightning_sink.layout.dcp_metadata import DCP_METADATA_FILE
from lightning_sink.strategies.checkpoint_state import CHECKPOINT_KEY
from lightning_sink.strategies.config import SinkConfig, validate_process_group_backend, validate_timeout
from lightning_sink.strategies.fit_lifecycle import SinkFit, WindowParts
from lightning_sink.strategies.fsdp_window import FSDPWindow
from lightning_sink.strategies.mesh_clipping import MeshClipping
from lightning_sink.strategies.sink_hooks import SinkStrategyHooks
from lightning_sink.window import OverflowFlagAllReduce

__all__ = ["SinkModelParallelStrategy"]


def _validate_size(name: str, value: object) -> None:
    check_count_fits(name, value)
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1 or 'auto'.")


class SinkModelParallelStrategy(SinkStrategyHooks, ModelParallelStrategy):
    """Gradient accumulation on Lightning's ``ModelParallelStrategy`` (FSDP2 + TP).

    The LightningModule shards itself in ``configure_model`` with ``parallelize_module`` on
    ``self.device_mesh["tensor_parallel"]`` and ``fully_shard`` on ``self.device_mesh["data_parallel"]``, as with
    Lightning's own strategy. Accumulate steps run with FSDP2's gradient sync off: FSDP2 sums the unsharded
    gradients locally (in ``reduce_dtype``, fp32 if the module's ``MixedPrecisionPolicy`` says so) and nothing is
    reduce-scattered; the update step's backward runs with sync on, so each FSDP parameter group is reduce-scattered
    once per window. With a ``LossScalePrecision`` the window's overflow flag is all-reduced once (each rank checks
    only its shard). Every checkpoint is a DCP folder with Lightning's ``meta.pt`` and a ``layout.json``, committed
    atomically; a save inside a window also keeps every rank's partial sums (in ``meta.pt``), so a resume on the
    same mesh continues the window exactly.

    Args:
        data_parallel_size, tensor_parallel_size: the device mesh, ``(data_parallel, tensor_parallel)``; see
            ``lightning.pytorch.strategies.ModelParallelStrategy``.
        accumulation_steps, partial_window, sink_size, prefetch_depth, graph_mode, checkpoint_random_state: see
            ``SinkStrategy`` (the random generators are saved per rank).
        process_group_backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA; ``None`` picks by device.
        timeout: the process-group timeout.
    """

    strategy_name = "sink_model_parallel"

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        accumulation_steps: int | None = None,
        partial_window: str = "scale",
        sink_size: int | None = None,
        prefetch_depth: int | None = None,
        graph_mode: str = "eager",
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_random_state: bool = True,
    ) -> None:
        _validate_size("data_parallel_size", data_parallel_size)
        _validate_size("tensor_parallel_size", tensor_parallel_size)
        config = SinkConfig(
            accumulation_steps, partial_window, sink_size, prefetch_depth, graph_mode, checkpoint_random_state
        )
        validate_process_group_backend(process_group_backend)
        validate_timeout(timeout)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.sink_fit = SinkFit(self, config)
        self._clipping: MeshClipping | None = None

    @override
    def setup_environment(self) -> None:
        if compat.process_group_backend(self) == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"SinkModelParallelStrategy(process_group_backend='nccl') needs CUDA devices, but this run is on"
                f" {self.root_device.type!r}: use process_group_backend='gloo' (or None) on CPU."
            )
        super().setup_environment()
        # ranks agree on the one checkpoint they resume from, or all stop before anything is loaded
        compat.check_before_resume(self, partial(agree_on_resume, world_size=self.world_size))

    @override
    def _check_fit_settings(self) -> None:
        scaling = self.sink_fit.loss_scaling
        if scaling is not None and scaling.skip_window_on_overflow:
            raise ValueError(
                "LossScalePrecision(skip_window_on_overflow=True) is not supported by SinkModelParallelStrategy:"
                " the window's partial sums are FSDP2's unsharded gradients, which it cannot check between"
                " micro-steps. Use skip_window_on_overflow=False (the overflowing window is still skipped)."
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        # gradient_clip_val over parameters on different meshes (FSDP2-only layers beside tensor-parallel ones)
        self._clipping = MeshClipping(self.precision_plugin, self.world_size)

    # ------------------------------------------------------------------ the parts this strategy passes
    def _window_parts(self) -> WindowParts:
        return WindowParts(
            make_store=self._fsdp_window,
            reducer=OverflowFlagAllReduce(self.world_size),
            ranks_in_sum=1,  # the window-ending backward's reduce-scatter already averaged over the data-parallel ranks
        )

    def _fsdp_window(self, params: list[Parameter]) -> FSDPWindow:
        assert self.model is not None
        return FSDPWindow(self.model, params, self.device_mesh["data_parallel"].size())

    @override
    def teardown(self) -> None:
        if self._clipping is not None:
            self._clipping.remove()
            self._clipping = None
        super().teardown()

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: the LightningModule is called directly, so DDP's reducer never fires."""
        yield

    # ------------------------------------------------------------------ checkpoints
    def sink_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly: the window, saved whole, and the data position."""
        return self.sink_fit.state_dict(self._gather_partial_sums)

    def _gather_partial_sums(self, buffer: list[Tensor | None]) -> list[list[Tensor | None]]:
        """Every rank's partial sums of the open window (shapes differ between ranks), for rank 0's ``meta.pt``."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, buffer)
        return gathered

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"SinkModelParallelStrategy.save_checkpoint(storage_options={storage_options!r}) is not supported:"
                " checkpoints are DCP folders written by torch.distributed.checkpoint, not through a CheckpointIO."
            )
        checkpoint[CHECKPOINT_KEY] = self.sink_state_dict()
        path = Path(self.broadcast(str(filepath)))  # every rank writes into rank 0's path
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update(
            {
                f"optimizer_{index}": optimizer_state
                for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", []))
            }
        )
        save_dcp_atomically(
            state, checkpoint, path, global_rank=self.global_rank, world_size=self.world_size, barrier=self.barrier
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DCP folder (Lightning's loading), or a ``transform_checkpoints`` output folder: each rank then reads only
        its own file (see ``checkpoint_format/resharded_load.py`` for what happens to the window and the data position)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        agree_on_checkpoint_path(path, self.world_size)  # every rank sees the same files, or all stop here
        check_checkpoint_dir(path)
        weights_only = True if weights_only is None else weights_only  # untrusted files run no code unless asked
        if (path / DCP_METADATA_FILE).is_file():
            module = self.lightning_module
            assert self.model is not None and module is not None  # (Lightning loads checkpoints after setup)
            checkpoint = load_dcp_folder(
                path,
                self.model,
                self.optimizers,
                module.strict_loading,
                weights_only,
                RankInWorld(self.global_rank, self.world_size),
            )
            self.sink_fit.restore(checkpoint, path)
            return checkpoint
        if not is_resharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = load_resharded_into_strategy(self, path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            checkpoint[CHECKPOINT_KEY] = adapt_sink_state(checkpoint[CHECKPOINT_KEY], path, self.sink_size is not None)
        self.sink_fit.restore(checkpoint, path)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="Two-step-program gradient accumulation on FSDP2 + tensor parallelism (lightning-sink)",
        )

    def __repr__(self) -> str:
        data_parallel_size, tensor_parallel_size = compat.model_parallel_sizes(self)
        return (
            f"SinkModelParallelStrategy(data_parallel_size={data_parallel_size!r},"
            f" tensor_parallel_size={tensor_parallel_size!r}, accumulation_steps={self.accumulation_steps},"
            f" partial_window={self.partial_window!r})"
        )
