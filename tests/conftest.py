"""Shared fixtures: keep in-process distributed runs from leaking into later tests and subprocesses."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

# Variables Lightning and torch.distributed set in the launching process; a child that inherits them believes it
# was already launched as one rank and waits for peers that never come.
DISTRIBUTED_ENV = (
    "LOCAL_RANK",
    "NODE_RANK",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PL_TRAINER_GPUS",
)


def clean_subprocess_env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in DISTRIBUTED_ENV}
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def isolated_distributed():
    """Restore the environment and tear down any process group an in-process run created."""
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
