"""Every use of a private Lightning attribute, in one place.

Lightning's automatic optimization drives the strategies' windows (zero-grad, the ``optimizer_step`` hook, the
closure, the counters). Where no extension point exists (sinks, windows across epochs, LR schedulers held on a
skipped update) the functions below reach into the loop. ``tests/test_lightning_compat.py`` fails loudly when a Lightning release moves any of these.

The package's modules import these names from here; the submodules hold them by concept: ``loop_overrides``
(Lightning loop methods a fit replaces), ``progress`` (batch and optimizer counters), ``logging`` (the step and
hook name values are logged under), ``hooks`` (Lightning's own hook calls), ``metrics`` (torchmetrics as Lightning
reads it), ``checkpoints`` (checkpoint contents and resume), ``data_loading`` (the training fetcher and loader
states), ``strategy`` (strategy settings and devices), ``fit_length`` (stopping, timers, estimated updates),
``trainer_reads`` (what ``training_step`` reads from its trainer) and ``trainer_settings``. Every module outside this package calls these through the package, so a function patched
here is patched for all of them; the few calls between compat functions (``install_loop_overrides`` removing the
previous overrides, ``run_before_optimizer_step`` calling the precision plugin, ``step_time_left`` typing the
trainer) go to the callee's own submodule, since a submodule importing this package back would be an import cycle.
"""

from __future__ import annotations

from lightning_sink._lightning_compat.checkpoints import (
    DCP_METADATA_FILE_NAME,
    callback_state_key,
    check_before_resume,
    checkpoint_every_n_train_steps,
    recorded_step_counts,
    reopen_interrupted_epoch,
    save_points_read,
)
from lightning_sink._lightning_compat.data_loading import (
    forget_saved_loader_states,
    shut_down_loader_workers,
    skip_training_batches,
    training_loader_count,
)
from lightning_sink._lightning_compat.fit_length import (
    can_stop_early,
    set_estimated_stepping_batches,
    step_time_left,
    stock_estimated_stepping_batches,
)
from lightning_sink._lightning_compat.hooks import (
    before_batch_transfer,
    call_lightning_module_hook,
    lightning_optimizer,
    precision_after_closure,
    run_before_optimizer_step,
    run_zero_grad,
)
from lightning_sink._lightning_compat.logging import (
    first_batch_flag,
    logging_step_set_to,
    set_first_batch_flag,
    set_logging_step,
    swap_hook_name,
)
from lightning_sink._lightning_compat.loop_overrides import _SHADOWED as _SHADOWED
from lightning_sink._lightning_compat.loop_overrides import (
    LoopOverrides,
    install_loop_overrides,
    remove_loop_overrides,
)
from lightning_sink._lightning_compat.metrics import (
    COLLECTION_STATE_SHARING,
    logged_collection_items,
    metric_step_value,
    metric_step_value_set_to,
)
from lightning_sink._lightning_compat.progress import (
    UpdateCounters,
    batch_index_in_epoch,
    epoch_batches_over,
    is_last_batch_of_epoch,
)
from lightning_sink._lightning_compat.strategy import (
    StrategyRegistry,
    model_parallel_sizes,
    process_group_backend,
    saves_distributed_checkpoint,
    set_module_device_mesh,
    set_single_device,
    single_device,
)
from lightning_sink._lightning_compat.trainer_reads import trainer_read_hint, trainer_reads
from lightning_sink._lightning_compat.trainer_settings import TrainerSettings, trainer_settings

__all__ = [
    "recorded_step_counts",
    "check_before_resume",
    "TrainerSettings",
    "trainer_read_hint",
    "trainer_reads",
    "trainer_settings",
    "LoopOverrides",
    "install_loop_overrides",
    "remove_loop_overrides",
    "epoch_batches_over",
    "is_last_batch_of_epoch",
    "batch_index_in_epoch",
    "UpdateCounters",
    "set_logging_step",
    "run_zero_grad",
    "lightning_optimizer",
    "process_group_backend",
    "logging_step_set_to",
    "swap_hook_name",
    "first_batch_flag",
    "set_first_batch_flag",
    "metric_step_value",
    "metric_step_value_set_to",
    "logged_collection_items",
    "COLLECTION_STATE_SHARING",
    "run_before_optimizer_step",
    "call_lightning_module_hook",
    "before_batch_transfer",
    "checkpoint_every_n_train_steps",
    "DCP_METADATA_FILE_NAME",
    "set_module_device_mesh",
    "saves_distributed_checkpoint",
    "skip_training_batches",
    "training_loader_count",
    "shut_down_loader_workers",
    "forget_saved_loader_states",
    "StrategyRegistry",
    "single_device",
    "set_single_device",
    "model_parallel_sizes",
    "precision_after_closure",
    "callback_state_key",
    "can_stop_early",
    "step_time_left",
    "set_estimated_stepping_batches",
    "stock_estimated_stepping_batches",
    "reopen_interrupted_epoch",
    "save_points_read",
]
