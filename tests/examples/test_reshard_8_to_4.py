"""The model-transformation example run as a user runs it (8 gloo processes, then 4), on a small setting.

Checked: the fine-tuning starts at stage 1's global step and loss and then lowers it; the inference accuracy
printed by the 4-process ``Trainer.test`` equals a plain PyTorch evaluation of the resharded weights (the full
tensors put together from the 4 rank files by the layout's chunks); the per-rank conversion
(``transform_checkpoint_by_rank``, one process per target rank) writes the same tensors as ``ReshardCheckpoint``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import clean_subprocess_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "reshard_8_to_4.py"
ARGS = ["--train-samples", "1024", "--test-samples", "1000", "--probe-samples", "512"]


def run_script(*args: str) -> str:
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=500
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("reshard_8_to_4")
    return out, run_script("--out-dir", str(out), *ARGS)


def probe(stdout: str, stage: str, when: str) -> tuple[int, float]:
    match = re.search(rf"{stage} {when}: global_step (\d+) probe loss ([0-9.]+)", stdout)
    assert match, stdout
    return int(match.group(1)), float(match.group(2))


def full_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The full tensors, put together from every rank file by the chunks its layout gives that rank."""
    from lightning_sink.reshard import load_resharded_checkpoint

    full: dict[str, torch.Tensor] = {}
    for rank in range(4):
        checkpoint = load_resharded_checkpoint(folder / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        for fqn, shard in checkpoint["tensors"].items():
            tensor = checkpoint["layout"].tensors[fqn]
            target = full.setdefault(fqn, torch.full(tensor.global_shape, float("nan"), dtype=shard.dtype))
            (chunk,) = tensor.chunks_of_rank(rank)
            target[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = shard
    assert not any(torch.isnan(t).any() for t in full.values() if t.is_floating_point())  # every element covered
    return full


def plain_accuracy(full: dict[str, torch.Tensor]) -> float:
    """Test accuracy of the example's MLP with these full tensors, evaluated by plain PyTorch on the CI test set."""
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    model.load_state_dict(
        {name.removeprefix("state_dict.net."): value for name, value in full.items() if name.startswith("state_dict.")}
    )
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from digits import DigitsDataModule
    finally:
        sys.path.remove(str(REPO / "examples"))
    data = DigitsDataModule(max_test_samples=1000)
    data.setup("test")
    x, y = data.test_set.tensors
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


@pytest.mark.slow
def test_fine_tuning_continues_stage_one(example):
    _, stdout = example
    step1, end1 = probe(stdout, "stage 1", "end")
    step2, start2 = probe(stdout, "stage 2", "start")
    final_step, end2 = probe(stdout, "stage 2", "end")
    # 1024 samples: 4 data-parallel ranks x 16 per micro-batch x windows of 2 -> 8 updates; on 2 ranks -> 16.
    assert (step1, step2, final_step) == (8, 8, 8 + 16)
    assert start2 == pytest.approx(end1, rel=1e-4)  # the same parameters, another sharding
    assert end2 < start2 - 0.05


@pytest.mark.slow
def test_inference_accuracy_equals_plain_pytorch_on_the_resharded_weights(example):
    out, stdout = example
    printed = float(re.search(r"inference on the converted checkpoint .*: test accuracy ([0-9.]+)", stdout).group(1))
    accuracy = plain_accuracy(full_tensors(out / "resharded"))
    assert printed == pytest.approx(accuracy, abs=1.5e-3)  # (argmax of a rounding-level tie: one sample at most)
    assert accuracy > 0.5  # 10 classes: chance is 0.1


def convert_each_target_rank(out_dir: Path, *options: str) -> list[str]:
    """The script's per-rank conversion, one process per target rank at once, as a user launches it."""
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    workers = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), "--out-dir", str(out_dir), *options, "--convert-rank", str(rank)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    outputs = [worker.communicate(timeout=200)[0] for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0, 0, 0], outputs
    return outputs


@pytest.mark.slow
def test_per_rank_conversion_writes_what_reshard_checkpoint_wrote(example, tmp_path: Path):
    from lightning_sink.checkpoint_format.resharded_folder import is_resharded_checkpoint, rank_file_path
    from lightning_sink.reshard import load_resharded_checkpoint

    out, _ = example
    shutil.copytree(out / "stage1", tmp_path / "stage1")
    shutil.copy(out / "stage2_layout.json", tmp_path / "stage2_layout.json")
    outputs = convert_each_target_rank(tmp_path)
    assert re.search(r"target rank 0: read source ranks \[[0-9, ]+\]", outputs[0])
    assert is_resharded_checkpoint(tmp_path / "resharded")  # loadable by Trainer.fit(ckpt_path=...) as well
    for rank in range(4):
        mine = load_resharded_checkpoint(rank_file_path(tmp_path / "resharded", rank))  # checked against its sidecar
        theirs = load_resharded_checkpoint(out / "resharded" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        assert mine["tensors"].keys() == theirs["tensors"].keys()
        for fqn, value in theirs["tensors"].items():
            assert torch.equal(mine["tensors"][fqn], value), (rank, fqn)
        assert mine["extra_files"] == theirs["extra_files"]


@pytest.fixture(scope="module")
def pipeline_example(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("reshard_pipeline")
    return out, run_script("--out-dir", str(out), "--pipeline", *ARGS)


def pipeline_full_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The pipeline's full tensors, put together from the 8 ranks' own files by the merged stage layouts."""
    from lightning_sink.layout import load_layout

    merged = load_layout(folder / "merged_layout.json")
    files = {
        rank: torch.load(folder / "checkpoints" / f"rank_{rank}" / f"checkpoint_{rank}.pt", weights_only=True)
        for rank in range(8)
    }
    full = {}
    for fqn, tensor in merged.tensors.items():
        target = full[fqn] = torch.full(
            tensor.global_shape, float("nan"), dtype=files[tensor.chunks[0].rank][fqn].dtype
        )
        for chunk in tensor.chunks:
            target[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = files[chunk.rank][fqn]
    return full


@pytest.mark.slow
def test_pipeline_stage_checkpoints_merge_reshard_and_continue(pipeline_example):
    out, stdout = pipeline_example
    merged = re.search(
        r"merged 2 stage layouts: (\d+) tensors on mesh \{'pipeline': 2, 'data_parallel': 2,"
        r" 'tensor_parallel': 2\}",
        stdout,
    )
    assert merged, stdout
    end1 = float(re.search(r"stage 1 \(pipeline\) end: updates 32 probe loss ([0-9.]+)", stdout).group(1))
    step2, start2 = probe(stdout, "stage 2", "start")
    _, end2 = probe(stdout, "stage 2", "end")
    assert step2 == 0 and start2 == pytest.approx(end1, rel=1e-4)  # the pipeline's parameters, on 4 ranks
    assert end2 < start2 - 0.05  # and the Adam state carried over works: it trains on
    # Every tensor of the 4 target files (parameters, Adam moments and steps) is exactly the pipeline's.
    pipeline, resharded = pipeline_full_tensors(out / "stage1_pipeline"), full_tensors(out / "resharded")
    assert set(resharded) == set(pipeline) and len(resharded) == int(merged.group(1))
    for fqn, value in resharded.items():
        assert torch.equal(value, pipeline[fqn]), fqn
    printed = float(re.search(r"inference on the converted checkpoint .*: test accuracy ([0-9.]+)", stdout).group(1))
    assert printed == pytest.approx(plain_accuracy(resharded), abs=1.5e-3)


@pytest.mark.slow
def test_per_rank_conversion_of_pipeline_stage_files(pipeline_example, tmp_path: Path):
    from lightning_sink.reshard import load_resharded_checkpoint

    out, _ = pipeline_example
    shutil.copytree(out / "stage1_pipeline", tmp_path / "stage1_pipeline")
    shutil.copy(out / "stage2_layout.json", tmp_path / "stage2_layout.json")
    convert_each_target_rank(tmp_path, "--pipeline")
    for rank in range(4):
        mine = load_resharded_checkpoint(tmp_path / "resharded" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        theirs = load_resharded_checkpoint(out / "resharded" / f"rank_{rank}" / f"checkpoint_{rank}.pt")
        assert mine["tensors"].keys() == theirs["tensors"].keys()
        assert all(torch.equal(mine["tensors"][fqn], value) for fqn, value in theirs["tensors"].items()), rank
