"""``LossScaleMonitor``: the loss scale, the last update's overflow flag and the skipped updates of a run.

Reads ``LossScalePrecision``'s device-resident scaler once per printed line. The sink strategies already log
``loss_scale``, ``overflow`` and ``skipped_updates`` at every update (``LightningModule.log``, Lightning's step) when
a logger is attached; this monitor logs the same three names only when that does not happen (a stock Lightning
strategy, or manual optimization), so no name is ever written twice.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_sink import LossScalePrecision, SinkDDPStrategy, SinkStrategy
from lightning_sink import _lightning_compat as compat
from lightning_sink.callbacks._progress import StepCounter, log_scalars
from lightning_sink.counts import check_count_fits

__all__ = ["LossScaleMonitor"]


def _strategy_logs_loss_scale(trainer: pl.Trainer) -> bool:
    """Mirrors the sink strategies' ``_log_loss_scale``: their update step logs the three names itself."""
    sink_strategy = isinstance(trainer.strategy, (SinkStrategy, SinkDDPStrategy))
    return sink_strategy and trainer.lightning_module.automatic_optimization


class LossScaleMonitor(Callback):
    """Print (and, where the strategy does not, log) the loss-scaling state every ``per_print_times`` updates.

    Args:
        per_print_times: print when at least this many optimizer updates (``trainer.global_step``) have passed since
            the last line; looked at the end of every Lightning batch (once per sink in sink mode).

    Line (global rank 0): ``epoch: E step: S, loss scale is 65536.0, overflow is False, skipped updates is 0``, with
    E and S as in ``LossMonitor`` (1-based epoch, step within the epoch), ``overflow`` the flag of the last update
    and ``skipped updates`` the run's total. Needs ``Trainer(plugins=[LossScalePrecision(...)])``.
    """

    def __init__(self, per_print_times: int = 1) -> None:
        check_count_fits("per_print_times", per_print_times)
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) or per_print_times < 1:
            raise ValueError(
                f"per_print_times={per_print_times!r} is not valid: pass an int >= 1 (optimizer updates between lines)."
            )
        self.per_print_times = per_print_times
        self.steps = StepCounter()
        self.last_print_update = 0

    @property
    @override
    def state_key(self) -> str:
        return compat.callback_state_key(self, per_print_times=self.per_print_times)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        plugin = trainer.precision_plugin
        if stage == "fit" and not isinstance(plugin, LossScalePrecision):
            raise TypeError(
                f"LossScaleMonitor reads a LossScalePrecision plugin, but the Trainer's precision plugin is"
                f" {type(plugin).__name__}: add plugins=[lightning_sink.LossScalePrecision(...)] or drop the monitor."
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.steps.start_epoch()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.steps.advance(outputs, batch, batch_idx)
        updates = trainer.global_step
        if updates - self.last_print_update < self.per_print_times:
            return
        self.last_print_update = updates
        if not trainer.is_global_zero:
            return  # only rank 0 prints and logs; the scale is the same on every rank
        plugin = trainer.precision_plugin
        assert isinstance(plugin, LossScalePrecision)  # (checked at setup)
        scaler = plugin.scaler
        if scaler is None:  # bf16/fp32 without scaling: the scale is 1 and nothing is ever skipped
            scale, overflow, skipped = 1.0, False, 0
        else:
            # Host sync: one read of the three device values per printed line.
            scale, found_inf, skipped = torch.stack(
                [scaler.scale.float(), scaler.found_inf.float(), scaler.skipped.float()]
            ).tolist()
            overflow, skipped = found_inf > 0, int(skipped)
        print(
            f"epoch: {trainer.current_epoch + 1} step: {self.steps.in_epoch}, loss scale is {scale},"
            f" overflow is {overflow}, skipped updates is {skipped}",
            flush=True,
        )
        if scaler is not None and not _strategy_logs_loss_scale(trainer):
            # Lightning's step for a value of update u is u - 1 (as self.log and the sink strategies use).
            log_scalars(
                trainer,
                {"loss_scale": scale, "overflow": float(overflow), "skipped_updates": float(skipped)},
                step=updates - 1,
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_print_update": self.last_print_update}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_print_update = int(state_dict["last_print_update"])
