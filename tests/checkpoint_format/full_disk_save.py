"""Run as ``python -m tests.checkpoint_format.full_disk_save TARGET``: ``save_dcp_atomically`` (the save
``ReshardCheckpoint`` makes of the source) under a 4 KiB file-size limit, a disk that fills up mid-save. Prints the
error's one line."""

from __future__ import annotations

import resource
import signal
import sys
import warnings
from pathlib import Path

import torch

from lightning_sink.checkpoint_format.dcp_folder import save_dcp_atomically

if __name__ == "__main__":
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    warnings.simplefilter("ignore")
    state = {"w": torch.zeros(100_000)}
    try:
        save_dcp_atomically(state, {"epoch": 1}, Path(sys.argv[1]), global_rank=0, world_size=1, barrier=lambda: None)
    except OSError as error:
        print(f"{type(error).__name__}: {error}")
