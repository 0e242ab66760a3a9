"""``SinkStrategyHooks``: Lightning's ``Strategy`` hooks as every sink strategy answers them, written once.

Each of ``SinkStrategy``, ``SinkDDPStrategy`` and ``SinkModelParallelStrategy`` is this class placed before its
Lightning base (``class SinkStrategy(SinkStrategyHooks, SingleDeviceStrategy)``): a hook hands the fit's work to the
strategy's ``SinkFit`` and, once training started, its ``StepEngine``, and keeps the Lightning base's own behaviour
around it through ``super()``. What differs between the strategies stays in theirs: the constructor and its options,
the window's parts (``_window_parts``: the gradient store, the reducer), the process group, checkpoints' files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sink.cuda_check import CudaCheckDuringFit
from lightning_sink.sink_data import SinkToken
from lightning_sink.strategies import checkpoint_state
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.fit_lifecycle import SinkFit, WindowParts, fit_setting

__all__ = ["SinkStrategyHooks"]


class SinkStrategyHooks(Strategy):
    """The ``Strategy`` hooks a sink strategy hands to its fit and step engine (see the module's docstring)."""

    sink_fit: SinkFit  # set by the strategy's constructor
    _cuda_check: CudaCheckDuringFit | None = None  # from setup to teardown (cuda_check.py)

    accumulation_steps = fit_setting("accumulation_steps")
    partial_window = fit_setting("partial_window")
    sink_size = fit_setting("sink_size")
    prefetch_depth = fit_setting("prefetch_depth")
    graph_mode = fit_setting("graph_mode")
    sink_config = fit_setting("sink_config")
    micro_steps_in_window = fit_setting("micro_steps_in_window")
    # what tests and benchmarks look into
    _accumulator = fit_setting("store")
    _hooks = fit_setting("hooks")
    _data_position = fit_setting("data_position")

    def _window_parts(self) -> WindowParts:
        """The window's gradient store, reducer and ranks in its sum, as this strategy builds them."""
        raise NotImplementedError

    def _check_fit_settings(self) -> None:
        """Refuse, before Lightning's setup, what this strategy cannot train (the fit's settings are settled)."""

    @property
    def engine(self) -> StepEngine | None:
        """This fit's step engine (``None`` before train start and under manual optimization)."""
        return self.sink_fit.engine

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._cuda_check = CudaCheckDuringFit()
        self._cuda_check.begin()
        self.sink_fit.configure_for_trainer(trainer)
        self._check_fit_settings()
        super().setup(trainer)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.sink_fit.process_dataloader(dataloader)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.sink_fit.start(self._window_parts())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.sink_fit.batch_started()

    @override
    def on_train_end(self) -> None:
        self.sink_fit.end()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        self.sink_fit.teardown()
        super().teardown()
        if self._cuda_check is not None:
            self._cuda_check.end()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        engine = self.engine
        if engine is None:
            return super().training_step(*args, **kwargs)
        return self._run_sink() if self.sink_fit.sink_loop is not None else engine.training_step(*args, **kwargs)

    def accumulate_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        """The forward of a micro-batch that does not end its window; Lightning's closure runs its backward."""
        return self.sink_fit.running_engine().forward(*args, **kwargs)

    def update_step(self, optimizer: Optimizer, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """The window's last micro-batch (the closure) and the window's update."""
        return self.sink_fit.running_engine().update_step(optimizer, closure, **kwargs)

    def _run_sink(self) -> dict[str, Tensor] | None:
        return self.sink_fit.running_sink_loop().run()

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.engine is not None:
            self.engine.pre_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.post_backward()
        super().post_backward(closure_loss)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        engine = self.engine
        if engine is None or engine.passthrough:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.update_step(optimizer, closure, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self.sink_fit.direct_transfer or isinstance(batch, SinkToken):
            return move_data_to_device(batch, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    def sink_state_dict(self) -> dict[str, Any]:
        """Everything the strategy needs to resume exactly: the window, saved whole, and the data position."""
        return self.sink_fit.state_dict(checkpoint_state.gather_flat_buffers(self.sink_fit.host.world_size))
