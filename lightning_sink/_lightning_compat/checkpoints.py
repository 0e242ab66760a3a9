"""What Lightning writes in and reads from a checkpoint, and where it starts restoring a run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.load import _METADATA_FILENAME

# The file in which Lightning's ModelParallelStrategy keeps the non-tensor part (loops, callbacks, ...) of a DCP folder.
DCP_METADATA_FILE_NAME: str = _METADATA_FILENAME


def checkpoint_every_n_train_steps(callback: Any) -> int:
    """``ModelCheckpoint(every_n_train_steps=n)``'s n (0 when it does not save by steps); Lightning keeps it private."""
    return int(callback._every_n_train_steps or 0)


def save_points_read(trainer: Any, val_check_interval: float) -> Callable[[], None]:
    """Each ``ModelCheckpoint`` that decides by itself whether to save at a training epoch's end or after each
    validation (``save_on_train_epoch_end=None``) reads ``trainer.val_check_interval`` for it at every epoch's end;
    while a sink fit holds that setting at 1.0 (its own schedule places the validations), they read
    ``val_check_interval``, the user's, instead. Returns what gives them Lightning's own reading back."""
    shadowed = []
    for callback in trainer.checkpoint_callbacks:
        if getattr(callback, "_save_on_train_epoch_end", False) is not None:
            continue  # (decided by its own argument, or not a ModelCheckpoint)
        lightning_decides = type(callback)._should_save_on_train_epoch_end.__get__(callback)

        def decides(trainer: Any, lightning_decides: Callable[[Any], bool] = lightning_decides) -> bool:
            held, trainer.val_check_interval = trainer.val_check_interval, val_check_interval
            try:
                return lightning_decides(trainer)
            finally:
                trainer.val_check_interval = held

        callback._should_save_on_train_epoch_end = decides
        shadowed.append(callback)

    def give_back() -> None:
        for callback in shadowed:
            callback.__dict__.pop("_should_save_on_train_epoch_end", None)

    return give_back


def callback_state_key(callback: Any, **settings: Any) -> str:
    """Lightning's state key format for a callback: its class name and the settings that tell instances apart."""
    return callback._generate_state_key(**settings)


def reopen_interrupted_epoch(checkpoint: dict[str, Any]) -> bool:
    """In a checkpoint Lightning saved after a stop inside an epoch (``max_steps``), mark that epoch as interrupted
    rather than finished, as in a checkpoint saved during it: a resume then continues it instead of starting the
    next. Returns whether the checkpoint was changed (it is left alone when its epoch is already open)."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if not isinstance(fit_loop, dict):
        return False
    progress = fit_loop.get("epoch_progress")
    if not isinstance(progress, dict):
        return False
    total, current = progress.get("total"), progress.get("current")
    if not (isinstance(total, dict) and isinstance(current, dict)):
        return False
    trackers: list[dict[str, Any]] = [total, current]
    if any(tracker.get("completed") != tracker.get("ready") or not tracker.get("ready") for tracker in trackers):
        return False
    for tracker in trackers:
        tracker["processed"] = tracker["completed"] = tracker["ready"] - 1
    checkpoint["epoch"] = max(0, int(checkpoint.get("epoch", 1)) - 1)
    return True


def check_before_resume(strategy: Any, check: Callable[[Any], None]) -> None:
    """Have ``check(checkpoint_path)`` run where Lightning starts restoring a run, before it loads anything: on every
    rank, with the path that rank resolved (``None`` where it resolved none, e.g. a ``ckpt_path="last"`` with no
    last checkpoint on its node), so that it may be a collective. Replaces any check installed before."""
    module = strategy.lightning_module
    trainer = getattr(module, "_trainer", None) if module is not None else None
    if trainer is None:
        return
    connector = trainer._checkpoint_connector
    stock = type(connector).resume_start.__get__(connector)

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        check(checkpoint_path)
        stock(checkpoint_path, weights_only=weights_only)

    vars(connector)["resume_start"] = resume_start


def recorded_step_counts(checkpoint: dict[str, Any]) -> set[int]:
    """The optimizer step counts a checkpoint's loop state records (automatic and manual optimization's), from which
    Lightning restores ``global_step``; the checkpoint's top-level ``global_step`` is one of them in every checkpoint
    a run writes. Empty where the loop state is absent or not in this shape."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop") if isinstance(checkpoint.get("loops"), dict) else None
    if not isinstance(fit_loop, dict):
        return set()
    automatic = fit_loop.get("epoch_loop.automatic_optimization.optim_progress")
    manual = fit_loop.get("epoch_loop.manual_optimization.optim_step_progress")
    totals = [
        automatic.get("optimizer", {}).get("step", {}).get("total") if isinstance(automatic, dict) else None,
        manual.get("total") if isinstance(manual, dict) else None,
    ]
    return {
        total["completed"]
        for total in totals
        if isinstance(total, dict)
        and isinstance(total.get("completed"), int)
        and not isinstance(total["completed"], bool)
    }
