"""The settings and devices Lightning's strategies keep private, and the registry strategies register in."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.strategy import _StrategyRegistry

# The registry a strategy class registers its names in (``Strategy.register_strategies``'s argument).
StrategyRegistry = _StrategyRegistry


def process_group_backend(strategy: Any) -> str | None:
    """``DDPStrategy``/``ModelParallelStrategy(process_group_backend=...)`` as given (``None``: chosen by device)."""
    return strategy._process_group_backend


def single_device(strategy: Any) -> torch.device:
    """The device a ``SingleDeviceStrategy`` was built with (its ``root_device``), without asking its accelerator."""
    return strategy._root_device


def set_single_device(strategy: Any, device: torch.device) -> None:
    """Point a ``SingleDeviceStrategy`` at another device (what ``root_device`` returns)."""
    strategy._root_device = device


def model_parallel_sizes(strategy: Any) -> tuple[int | str, int | str]:
    """``ModelParallelStrategy(data_parallel_size=..., tensor_parallel_size=...)`` as given (``"auto"`` or an int)."""
    return strategy._data_parallel_size, strategy._tensor_parallel_size


def set_module_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """What ``ModelParallelStrategy.setup_environment`` does, so ``configure_model`` sees ``self.device_mesh``."""
    module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: Any) -> bool:
    """``ModelParallelStrategy(save_distributed_checkpoint=...)``'s value (a DCP folder, not one full file)."""
    return bool(strategy._save_distributed_checkpoint)
