"""``SinkModelParallelStrategy``: the step programs on FSDP2 + tensor parallelism, one reduction per window."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.accumulation import MicroStep
from lightning_sink.strategies.atomic_dcp import check_checkpoint_dir, save_dcp_atomically
from lightning_sink.strategies.fsdp_window import FSDPWindow
from lightning_sink.strategies.resharded_load import (
    adapt_sink_state,
    is_resharded_checkpoint,
    load_resharded_into_strategy,
)
from lightning_sink.strategies.config import SinkConfig, validate_process_group_backend, validate_timeout
from lightning_sink.strategies.step_programs import CHECKPOINT_KEY, StepProgramsMixin

__all__ = ["SinkModelParallelStrategy"]


def _validate_size(name: str, value: object) -> None:
    if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1 or 'auto'.")


class SinkModelParallelStrategy(StepProgramsMixin, ModelParallelStrategy):
    """Gradient accumulation with two step programs on Lightning's ``ModelParallelStrategy`` (FSDP2 + TP).

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
        accumulation_steps, partial_window, sink_size, prefetch_depth: see ``SinkStrategy``.
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
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        _validate_size("data_parallel_size", data_parallel_size)
        _validate_size("tensor_parallel_size", tensor_parallel_size)
        config = SinkConfig(accumulation_steps, partial_window, sink_size, prefetch_depth)
        validate_process_group_backend(process_group_backend)
        validate_timeout(timeout)
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_step_programs(config)
        self._in_update_step = False

    @override
    def setup_environment(self) -> None:
        if self._process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise ValueError(
                f"SinkModelParallelStrategy(process_group_backend='nccl') needs CUDA devices, but this run is on"
                f" {self.root_device.type!r}: use process_group_backend='gloo' (or None) on CPU."
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._configure_for_trainer(trainer)
        scaling = self._loss_scaling
        if scaling is not None and scaling.skip_window_on_overflow:
            raise ValueError(
                "LossScalePrecision(skip_window_on_overflow=True) is not supported by SinkModelParallelStrategy:"
                " the window's partial sums are FSDP2's unsharded gradients, which it cannot check between"
                " micro-steps. Use skip_window_on_overflow=False (the overflowing window is still skipped)."
            )
        super().setup(trainer)

    # ------------------------------------------------------------------ the window
    @override
    def _make_accumulator(self, params: list[torch.nn.Parameter]) -> FSDPWindow:
        assert self.model is not None
        return FSDPWindow(self.model, params, self.device_mesh["data_parallel"].size())

    def _window_ends_here(self) -> bool:
        """Whether this backward must reduce: the update step's, or the last one of a window being dropped."""
        if self._in_update_step:
            return True
        return self._stream is None and self._plan_micro_step() is MicroStep.ACCUMULATE_THEN_DROP

    @override
    def accumulate_step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        self._accumulator.restore_pending()  # after a resume inside a window: its partial sums, once
        self._accumulator.set_gradient_sync(self._window_ends_here())
        return super().accumulate_step(batch, batch_idx)

    @override
    def update_step(self, batch: Any, batch_idx: int) -> STEP_OUTPUT:
        self._in_update_step = True
        try:
            return super().update_step(batch, batch_idx)
        finally:
            self._in_update_step = False

    @override
    def _apply_window_update(self) -> None:
        """After the update step's backward FSDP2 has reduce-scattered the window's sum, averaged over the
        data-parallel ranks, into the sharded ``param.grad``: divide by the micro-steps, unscale, clip, step."""
        window, optimizer = self._accumulator, self.optimizers[0]
        scaling = self._loss_scaling
        found_inf = None
        if scaling is None:
            window.divide_(window.micro_steps)
        else:
            found_inf = self._unscale_window(scaling, window)
        self._finish_window(optimizer, scaling, found_inf)

    @torch.no_grad()
    def _unscale_window(self, scaling: Any, window: FSDPWindow) -> torch.Tensor | None:
        grads = window.local_gradients()
        flat = torch.cat([grad.reshape(-1).float() for grad in grads])
        found_inf = scaling.unscale_window(flat, window.micro_steps)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        if found_inf is not None and self.world_size > 1:
            # Each rank checked only its shards; one all-reduce of the flag makes every rank skip together.
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return found_inf

    # ------------------------------------------------------------------ checkpoints
    @override
    def _gather_buffers(self, buffer: list[torch.Tensor | None]) -> list[list[torch.Tensor | None]]:
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
        state.update({f"optimizer_{index}": optimizer_state
                      for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", []))})
        save_dcp_atomically(state, checkpoint, path, global_rank=self.global_rank, world_size=self.world_size,
                            barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A DCP folder (Lightning's loading), or a ``transform_checkpoints`` output folder: each rank then reads only
        its own file (see ``resharded_load.py`` for what happens to the window and the data position)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        check_checkpoint_dir(path)
        if not is_resharded_checkpoint(path):
            return super().load_checkpoint(path, weights_only=weights_only)
        checkpoint = load_resharded_into_strategy(self, path, weights_only)
        if CHECKPOINT_KEY in checkpoint:
            checkpoint[CHECKPOINT_KEY] = adapt_sink_state(checkpoint[CHECKPOINT_KEY], path, self.sink_size is not None)
        self._restore_sink_state(checkpoint, path)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls,
            description="Two-step-program gradient accumulation on FSDP2 + tensor parallelism (lightning-sink)",
        )

    def __repr__(self) -> str:
        return (f"SinkModelParallelStrategy(data_parallel_size={self._data_parallel_size!r},"
                f" tensor_parallel_size={self._tensor_parallel_size!r}, accumulation_steps={self.accumulation_steps},"
                f" partial_window={self.partial_window!r})")
