"""Two ranks (``SinkModelParallelStrategy``, mesh 2 x 1, gloo) resuming from a DCP folder they saved, sharing the check
of ``SAVE_DIGESTS.json``; started once by ``tests.distributed.run_nodes`` (Lightning's launcher starts rank 1).

Run as ``python -m tests.strategies.save_digests_worker OUT_DIR``. Every rank counts the files the digest check opens
(``open_inside`` of ``checkpoint_format/save_digests.py``, wrapped) and writes ``OUT_DIR/<case>.rank<r>.json``: the
files it opened, the error it got and how long the resume took to fail, for three resumes of the same folder:

- ``clean``: the folder as saved (it resumes);
- ``flipped``: one byte flipped in the middle of a tensor's record in a storage file that only rank 1 checked in
  ``clean`` (rank 0 picks it from DCP's own metadata and writes ``OUT_DIR/flipped.json``: file and tensor);
- ``unreadable``: that byte restored, and every storage file unreadable for rank 1 only (its open raises
  PermissionError, as on a node where the file's permissions differ).
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from lightning_sink import SinkModelParallelStrategy
from lightning_sink.checkpoint_format import save_digests
from tests.distributed import leave_the_group_and_exit
from tests.helpers import loader, make_dataset, quiet_trainer
from tests.strategies.mp_models import TPClassifier

DP, TP, STEPS, SAMPLES, MICRO_BATCH = 2, 1, 2, 16, 2
PG_TIMEOUT = timedelta(seconds=180)  # (start-up on a busy machine; the failures under test come far sooner)

opened: list[str] = []
_real_open_inside = save_digests.open_inside
_unreadable = False


def counting_open_inside(folder, name, what, *args, **kwargs):
    opened.append(name)
    if _unreadable and name.endswith(".distcp"):
        raise PermissionError(13, "Permission denied", str(Path(folder, name)))
    return _real_open_inside(folder, name, what, *args, **kwargs)


def fit(ckpt_path=None, epochs=1):
    strategy = SinkModelParallelStrategy(
        data_parallel_size=DP,
        tensor_parallel_size=TP,
        accumulation_steps=STEPS,
        process_group_backend="gloo",
        timeout=PG_TIMEOUT,
    )
    trainer = quiet_trainer(strategy=strategy, devices=DP * TP, max_epochs=epochs)
    trainer.fit(
        TPClassifier(optimizer="adamw", lr=0.01),
        loader(make_dataset(num_samples=SAMPLES), MICRO_BATCH),
        ckpt_path=ckpt_path,
    )
    return trainer


def resume(out_dir: Path, case: str) -> list[str]:
    opened.clear()
    start, error = time.monotonic(), None
    try:
        fit(out_dir / "ckpt", epochs=2)
    except Exception as failure:
        error = f"{type(failure).__name__}: {failure}"
    record = {"opened": list(opened), "error": error, "seconds": time.monotonic() - start}
    (out_dir / f"{case}.rank{dist.get_rank()}.json").write_text(json.dumps(record))
    return record["opened"]


def flip_a_tensor_byte_in(folder: Path, file_name: str) -> dict:
    """Rank 0: flip the middle byte of the first tensor record DCP's metadata places in ``file_name``."""
    metadata = FileSystemReader(folder).read_metadata()  # (the test's own save: DCP's plain reader is fine here)
    records = [
        (index, info)
        for index, info in metadata.storage_data.items()
        if info.relative_path == file_name and index.offset is not None and index.fqn.startswith("state_dict.")
    ]
    index, info = min(records, key=lambda record: record[1].offset)
    path = folder / file_name
    data = bytearray(path.read_bytes())
    position = info.offset + info.length // 2
    data[position] ^= 0x10
    path.write_bytes(bytes(data))
    return {"file": file_name, "tensor": index.fqn, "offsets": list(index.offset), "position": position}


def main(out_dir: Path) -> None:
    global _unreadable
    trainer = fit()
    trainer.save_checkpoint(out_dir / "ckpt")
    save_digests.open_inside = counting_open_inside
    mine = resume(out_dir, "clean")
    shares: list = [None] * dist.get_world_size()
    dist.all_gather_object(shares, mine)
    only_rank_1 = sorted(n for n in shares[1] if n.endswith(".distcp") and n not in shares[0])
    if dist.get_rank() == 0 and only_rank_1:
        flipped = flip_a_tensor_byte_in(out_dir / "ckpt", only_rank_1[0])
        (out_dir / "flipped.json").write_text(json.dumps(flipped))
    dist.barrier()
    if not only_rank_1:
        return  # (the test reports that the ranks did not share the files)
    resume(out_dir, "flipped")
    dist.barrier()
    if dist.get_rank() == 0:
        flip_a_tensor_byte_in(out_dir / "ckpt", only_rank_1[0])  # (the same byte again: restored)
    dist.barrier()
    _unreadable = dist.get_rank() == 1
    resume(out_dir, "unreadable")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    leave_the_group_and_exit()  # (tests/distributed.py: the group torn down before the process ends)
