"""Sink mode's loop: K micro-batches inside one Lightning batch, each trained by a step program (``programs.py``),
with the logging and the LR schedulers that Lightning would have run per update done once per sink.

Windows run on across sinks and data passes (the data is one endless stream), so ``partial_window`` does not apply
here. A ``max_steps`` reached inside the sink ends it; the data position records what was trained. ``self.log``
calls are recorded during the sink and handed to Lightning at its end (``sink_logging.py``). Nothing is read back
to the host: the losses stay on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lightning_sink import _lightning_compat as compat
from lightning_sink.data import DataPosition
from lightning_sink.sink_data import PASS_END, MicroBatchStream
from lightning_sink.strategies.engine import StepEngine
from lightning_sink.strategies.programs import SinkPrograms, SinkUpdates, choose_programs
from lightning_sink.strategies.recompile_watch import RecompileWatch
from lightning_sink.strategies.sink_logging import SinkLogBuffer

__all__ = ["SinkLoop"]


class SinkLoop:
    """Runs the sinks of one fit."""

    def __init__(
        self,
        engine: StepEngine,
        stream: MicroBatchStream,
        data_position: DataPosition,
        log_buffer: SinkLogBuffer | None,
        sink_size: int,
        recompile_watch: RecompileWatch | None = None,
        choose: Callable[[StepEngine, SinkUpdates], SinkPrograms] = choose_programs,
    ) -> None:
        self._engine = engine
        self._choose = choose  # the pair each sink runs (compiled programs: ``compiled_step.py``)
        self.stream = stream
        self._data_position = data_position
        self._log_buffer = log_buffer
        self._sink_size = sink_size
        self._recompile_watch = recompile_watch  # (graph modes: TorchDynamo compiles the step)
        self.updates = SinkUpdates(engine)
        self.programs: SinkPrograms | None = None  # the last sink's
        host = engine.host
        # Batches need moving unless the stream's thread already did, or they are for the CPU and no transfer hook
        # runs (a loader's batches are on the CPU already, and walking them would cost a step's worth of time).
        self._to_device = stream.copier is None and not (
            engine.hooks.direct_transfer and host.root_device.type == "cpu"
        )
        # Lightning's loop converted only the sink's placeholder; "16-true" and the like convert each real batch.
        self._converts_input = type(host.precision_plugin).convert_input is not Precision.convert_input

    def batch_started(self) -> None:
        """A Lightning batch (a sink) starts: no update yet (what Lightning's ``_should_accumulate`` is told)."""
        self.updates = SinkUpdates(self._engine)

    def made_no_update(self) -> bool:
        return self.updates.count == 0

    def run(self) -> dict[str, Tensor] | None:
        """One sink (one Lightning batch)."""
        output = self._logged_sink()
        if self._recompile_watch is not None:
            self._recompile_watch.sink_ended()
        return output

    def _logged_sink(self) -> dict[str, Tensor] | None:
        buffer = self._log_buffer
        if buffer is None:
            return self._micro_batches()
        buffer.install()
        try:
            output = self._micro_batches()
            buffer.flush()
        finally:
            buffer.uninstall()
        return output

    def _micro_batches(self) -> dict[str, Tensor] | None:
        engine, stream, buffer = self._engine, self.stream, self._log_buffer
        trainer, window, updates = engine.trainer, engine.window, self.updates
        # the updates this sink may make before max_steps (global_step moves only through this sink's updates)
        updates_allowed = trainer.max_steps - trainer.global_step if trainer.max_steps != -1 else -1
        self.programs = programs = self._choose(engine, updates)
        window.loss_divisor = programs.update.loss_divisor
        accumulate, update, steps = programs.accumulate.run, programs.update.run, engine.accumulation_steps
        plugin = engine.host.precision_plugin
        losses: list[Tensor] = []
        micro_index = 0
        while self._sink_size == -1 or micro_index < self._sink_size:
            if updates_allowed != -1 and updates.count >= updates_allowed:
                break
            batch = stream.next()
            if batch is PASS_END:
                if self._sink_size == -1 and micro_index:
                    break  # one data pass per sink
                continue
            if self._converts_input:
                batch = plugin.convert_input(batch)
            if self._to_device:
                batch = self._device_batch(batch)
            if buffer is not None:
                buffer.begin_micro_step(batch)
            ends = window.micro_batches + 1 >= steps
            loss = update(batch, micro_index) if ends else accumulate(batch, micro_index)
            if loss is not None:
                losses.append(loss)
            self._data_position.advance()
            micro_index += 1
            if ends and buffer is not None:
                buffer.end_update()  # the loggers get this update's values at its step (sink_logging.py)
        if programs.end_sink is not None:
            programs.end_sink()
        compat.set_logging_step(trainer, updated=updates.count > 0)
        if not losses:
            return None  # every micro-batch returned None: Lightning skips the batch, as for a None step
        stacked = torch.stack(losses)
        return {"loss": stacked[-1], "mean_loss": stacked.mean(), "losses": stacked}

    def _device_batch(self, batch: Any) -> Any:
        """The transfer hooks, as Lightning's loop runs them for each of its batches (``batch_to_device`` alone moves
        the batch when none is overridden)."""
        host = self._engine.host
        if not self._engine.hooks.direct_transfer:
            module = host.lightning_module
            assert module is not None
            batch = compat.before_batch_transfer(module, batch)
        return host.batch_to_device(batch)

    def close(self) -> None:
        self.stream.close()
