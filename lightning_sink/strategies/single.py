"""``SinkStrategy``: the step programs on one device."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from lightning_sink import _lightning_compat as compat
from lightning_sink.checkpoint_format.ckpt_file import read_ckpt_file
from lightning_sink.strategies import checkpoint_state
from lightning_sink.strategies.config import SinkConfig, validate_device
from lightning_sink.strategies.fit_lifecycle import SinkFit, WindowParts, fit_setting
from lightning_sink.strategies.sink_hooks import SinkStrategyHooks
from lightning_sink.window import NoReduction

__all__ = ["SinkStrategy"]


class SinkStrategy(SinkStrategyHooks, SingleDeviceStrategy):
    """Gradient accumulation in fp32 window buffers on a single device.

    Args:
        accumulation_steps: micro-batches per optimizer update (N). ``None`` takes
            ``Trainer(accumulate_grad_batches=...)``; giving both with different values is an error.
        partial_window: what the last, incomplete window of an epoch does. ``"scale"`` (default) updates with the
            mean over its k micro-batches, exactly one batch of k*b; ``"drop"`` leaves those batches out of the
            epoch; ``"carry"`` keeps the window open into the next epoch; ``"lightning"`` updates as stock
            Lightning does, dividing it by N (the full window) as if it were whole: bit-identical to stock.
        sink_size: micro-batches per sink (MindSpore's ``sink_size``): each Lightning epoch is one sink of K
            micro-batches drawn from an endless pass over the loader, run inside one Lightning batch. ``-1``: one
            data pass per sink; ``None`` (default): no sinking, one Lightning batch per micro-batch.
        prefetch_depth: micro-batches a background thread reads ahead in sink mode (on CUDA it also copies them to
            the GPU: pinned memory, non-blocking copies on a side stream); ``0`` reads in the training thread.
            ``None`` (default): 0 on CPU, and on CUDA for a ``DataLoader`` over in-memory tensors (read by
            indexing), where the thread's GIL hand-offs cost more than the reads it hides (measured in
            ``benchmarks/``); 2 on CUDA for other loaders. Set it for loaders that wait on I/O.
        graph_mode: ``"eager"`` (default); ``"compile"``: ``training_step`` and its backward compiled with
            ``torch.compile`` (both step programs share the forward and backward graphs); ``"cuda_graph"``: the
            same graphs captured as CUDA graphs (``torch.compile(mode="reduce-overhead")``), CUDA only.
        device: the device to train on, one this machine has; ``None`` takes the Trainer's accelerator (``cuda:0``,
            ``cpu``, ...).
        checkpoint_random_state: checkpoints hold the global random generators (torch's CPU and CUDA, Python's,
            NumPy's; ``random_state.py``) and a resume restores them, so that a step drawing random numbers
            (dropout) continues as the uninterrupted run (default ``True``). ``False`` leaves them out.
        checkpoint_digests: record the SHA-256 of every tensor in each ``.ckpt`` saved and, on resume, refuse a
            checkpoint whose tensors do not match, naming the file and the tensor (``tensor_digests.py``). Costs a
            read of every saved byte at save and at resume; ``False`` writes and checks none.
        device_data_budget: with ``graph_mode="compile"``/``"cuda_graph"`` in sink mode, the bytes of an in-memory
            ``TensorDataset`` the whole-step programs may stage on the device, to gather each micro-batch there from
            the sampler's indices uploaded once per sink (``sink/staging.py`` says which loaders qualify); a larger
            dataset keeps the loader path. ``0`` stages nothing; ``None`` (default): a quarter of a CUDA device's
            memory, no limit on the CPU (where the data is in memory already and nothing is copied).
        micro_steps_per_call: with ``graph_mode="compile"`` or ``"cuda_graph"`` in sink mode, the micro-batches
            (whole windows: a multiple of ``accumulation_steps``) run by one compiled call, a loop over the windows
            whose build does not grow with the value. ``None`` (default): decided at the build from the step's size
            (``compiled/call_length.py``: on a CPU, for a step under a billion FLOPs, whole windows up to 8
            micro-steps, and with staged data also calls as long as the sink, so a whole sink is one call; else 1);
            ``1``: one call per
            micro-batch. Exact: every per-micro-batch effect (``self.log`` values, counters, ``global_step``, the
            data position, the ``interval="step"`` LR schedulers' steps) is done after the call, in order; where a
            call could not be exact (a window already open, fewer micro-batches left before the segment's or the
            pass's end or ``max_steps``) those micro-batches run in shorter calls or one per call
            (``docs/sink_mode.md``, "Graph modes").
    """

    strategy_name = "sink"

    def __init__(
        self,
        accumulation_steps: int | None = None,
        partial_window: str = "scale",
        sink_size: int | None = None,
        prefetch_depth: int | None = None,
        graph_mode: str = "eager",
        device: str | torch.device | None = None,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        checkpoint_random_state: bool = True,
        checkpoint_digests: bool = True,
        device_data_budget: int | None = None,
        micro_steps_per_call: int | None = None,
    ) -> None:
        config = SinkConfig(
            accumulation_steps,
            partial_window,
            sink_size,
            prefetch_depth,
            graph_mode,
            checkpoint_random_state=checkpoint_random_state,
            checkpoint_digests=checkpoint_digests,
            device_data_budget=device_data_budget,
            micro_steps_per_call=micro_steps_per_call,
        )
        validate_device("device", device)
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._explicit_device = device is not None
        self.sink_fit = SinkFit(self, config)

    micro_steps_per_call = fit_setting("micro_steps_per_call")

    # The accelerator connector reads this (refusing a device that contradicts ``Trainer(accelerator=...)``) and
    # fills it in when ``device=None``, so that the strategy follows ``Trainer(accelerator=..., devices=...)``.
    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return [compat.single_device(self)] if self._explicit_device else None

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device | int | str]) -> None:
        if len(devices) != 1:
            raise ValueError(
                f"SinkStrategy runs on one device but the Trainer asks for {len(devices)} ({devices}); use"
                " strategy='sink_ddp' (SinkDDPStrategy) for several devices."
            )
        compat.set_single_device(self, torch.device(devices[0]))

    # ------------------------------------------------------------------ the parts this strategy passes
    def _window_parts(self) -> WindowParts:
        return WindowParts(make_store=self.sink_fit.flat_store, reducer=NoReduction(), ranks_in_sum=1)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        checkpoint[checkpoint_state.CHECKPOINT_KEY] = self.sink_state_dict()
        if self.is_global_zero:  # (the rank that writes the file)
            self.sink_fit.seal(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        load = super().load_checkpoint
        checkpoint = read_ckpt_file(lambda: load(checkpoint_path, weights_only=weights_only), checkpoint_path)
        self.sink_fit.check_digests(checkpoint, checkpoint_path)  # before anything of it is restored
        self.sink_fit.restore(checkpoint, checkpoint_path)
        return checkpoint

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: compat.StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Two-step-program gradient accumulation on one device (lightning-sink)"
        )

    def __repr__(self) -> str:
        return (
            f"SinkStrategy(accumulation_steps={self.accumulation_steps}, partial_window={self.partial_window!r},"
            f" sink_size={self.sink_size}, graph_mode={self.graph_mode!r})"
        )
