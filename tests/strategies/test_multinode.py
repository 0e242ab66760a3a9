"""A cluster on one machine: two launcher invocations of 2 processes each (``Trainer(num_nodes=2, devices=2)``, gloo on
127.0.0.1, a working directory per node) against one node of 4, for SinkDDPStrategy and SinkModelParallelStrategy.

The shared filesystem is an absolute folder both nodes see; a node's own disk is a relative path under its working
directory. Where the checkpoint path is node-private, or each node holds another checkpoint at the same path (a stale copy of an
earlier step), saves and resumes must fail on every rank with one error that
says the directory is not shared between nodes, within seconds - never a hang (``run_nodes`` kills a launch that
outlives its bound, which fails the test). SinkModelParallelStrategy clips (by norm and by value) a model whose
parameters live on two meshes, against a single-process PyTorch loop.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_failing_nodes, run_nodes
from tests.helpers import ddp_reference_windows, make_dataset, reference_train, relative_error
from tests.strategies import multinode_worker as worker
from tests.strategies.mp_models import MixedMeshClassifier, flat

WORKER = "tests.strategies.multinode_worker"
# A launch of 4 processes on a busy 2-core machine is slow: the bound only has to tell a hang from a slow start.
LAUNCH_TIMEOUT = 720
NOT_SHARED = "the checkpoint directory is not shared between nodes"


def launch(root: Path, nodes: int, devices: int, *scenarios: str) -> Path:
    shared = root / "shared"
    shared.mkdir()
    run_nodes(
        WORKER, shared, nodes, devices, *scenarios, nodes=nodes, devices=devices, root=root, timeout=LAUNCH_TIMEOUT
    )
    return root


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    """The failing cases last: on code that hangs there, the runs before them are already written."""
    return launch(
        tmp_path_factory.mktemp("two_nodes"),
        2,
        2,
        "ddp",
        "mp_norm",
        "ddp_resume_private",
        "mp_resume_private",
        "resharded_resume_private",
        "reshard_callback_private",
        "ddp_resume_different_steps",
        "ddp_resume_last",
        "mp_resume_different_steps",
        "reshard_callback_private_output",
    )


@pytest.fixture(scope="module")
def one_node(tmp_path_factory) -> Path:
    return launch(tmp_path_factory.mktemp("one_node"), 1, 4, "ddp", "mp_norm", "mp_value")


def every_rank(root: Path, scenario: str) -> list[dict]:
    return [json.loads((root / "shared" / f"{scenario}.rank{rank}.json").read_text()) for rank in range(4)]


@pytest.mark.slow
def test_two_nodes_of_two_equal_one_node_of_four_bit_for_bit(two_nodes, one_node):
    for name in ("ddp", "mp_norm"):
        two = torch.load(two_nodes / "shared" / f"{name}.pt")
        one = torch.load(one_node / "shared" / f"{name}.pt")
        assert two["params"].keys() == one["params"].keys()
        for key, value in one["params"].items():
            assert torch.equal(two["params"][key], value), (name, key)
    # The shared checkpoint holds every rank's file once: DCP's own .metadata names 4 shard files, all present.
    from lightning_sink.layout import read_dcp_metadata

    ckpt = two_nodes / "shared" / "mp_ckpt"
    files = {info.relative_path for info in read_dcp_metadata(ckpt).storage_data.values()}
    assert len(files) == 4 and all((ckpt / name).is_file() for name in files)


def clipped_reference(algorithm: str) -> tuple[torch.Tensor, list[float]]:
    """A plain PyTorch loop over the full model: one clipped AdamW step per window; the pre-clip gradient sizes."""
    windows = ddp_reference_windows(worker.SAMPLES, worker.MICRO_BATCH, worker.STEPS, 1, "scale", worker.DP)
    model = MixedMeshClassifier(optimizer="adamw", lr=0.01)
    sizes = []
    real_norm, real_value = torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad_value_

    def measuring_norm(parameters, max_norm):
        parameters = list(parameters)
        sizes.append(float(torch.cat([p.grad.reshape(-1) for p in parameters]).norm()))
        return real_norm(parameters, max_norm)

    def measuring_value(parameters, clip_value):
        parameters = list(parameters)
        sizes.append(float(torch.cat([p.grad.reshape(-1) for p in parameters]).abs().max()))
        return real_value(parameters, clip_value)

    clip = worker.CLIP_NORM if algorithm == "norm" else worker.CLIP_VALUE
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.utils, "clip_grad_norm_", measuring_norm)
        patch.setattr(torch.nn.utils, "clip_grad_value_", measuring_value)
        reference_train(model, make_dataset(num_samples=worker.SAMPLES), windows, clip=(clip, algorithm))
    assert len(sizes) == len(windows) == 2
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()]), sizes


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_clipping_over_parameters_on_two_meshes_equals_the_single_process_reference(one_node, algorithm):
    result = torch.load(one_node / "shared" / f"mp_{algorithm}.pt")
    expected, sizes = clipped_reference(algorithm)
    clip = worker.CLIP_NORM if algorithm == "norm" else worker.CLIP_VALUE
    assert all(size > 2 * clip for size in sizes)  # every update really is clipped
    assert result["global_step"] == 2
    assert relative_error(flat(result["params"]), expected) <= 1e-5
    if algorithm == "norm":  # the global norm costs the window one all-reduce, in its update batch, nothing else
        assert [batch["all_reduce"] for batch in result["per_batch"]] == [0, 1, 0, 1]
        assert [batch["updates"] for batch in result["per_batch"]] == [0, 1, 0, 1]


@pytest.mark.slow
def test_a_save_into_a_node_private_folder_fails_on_every_rank_and_leaves_nothing(two_nodes):
    for rank, record in enumerate(every_rank(two_nodes, "mp_save_private")):
        assert record["error"] is not None, f"rank {rank}: the save succeeded"
        assert NOT_SHARED in record["error"] and "ranks 2, 3" in record["error"], record["error"]
        assert "Timed out" not in record["error"]
        assert record["seconds"] < worker.ERROR_WITHIN
        # nothing half-written on either node: no checkpoint, no staging folder
        assert not [name for name in record["private"] if "mp_ckpt" in name], (rank, record["private"])


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["ddp_resume_private", "mp_resume_private", "resharded_resume_private"])
def test_a_resume_from_a_node_private_folder_fails_on_every_rank_within_seconds(two_nodes, scenario):
    records = every_rank(two_nodes, scenario)
    errors = {record["error"] for record in records}
    assert len(errors) == 1 and None not in errors, errors  # one error, the same on every rank
    (error,) = errors
    assert NOT_SHARED in error and "Timed out" not in error, error
    assert "ranks 0, 1" in error and "ranks 2, 3" in error and "see nothing at that path" in error, error
    assert all(record["seconds"] < worker.ERROR_WITHIN for record in records)


@pytest.mark.slow
def test_reshard_checkpoint_with_a_node_private_source_says_the_folder_is_not_shared(two_nodes):
    for rank, record in enumerate(every_rank(two_nodes, "reshard_callback_private")):
        assert record["error"] is not None and NOT_SHARED in record["error"], (rank, record["error"])
        assert not [name for name in record["private"] if "src" in name], (rank, record["private"])
    assert not (two_nodes / "shared" / "resharded").exists()


def one_error_on_every_rank(root: Path, scenario: str) -> str:
    records = every_rank(root, scenario)
    errors = {record["error"] for record in records}
    assert len(errors) == 1 and None not in errors, errors  # one error, the same on every rank
    (error,) = errors
    assert "\n" not in error and "Timed out" not in error, error
    assert all(record["seconds"] < worker.ERROR_WITHIN for record in records), records
    return error


def sees(error: str, ranks: str, what: str) -> bool:
    return re.search(rf"{ranks} \(host [^)]*\) {what}", error) is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario, steps", [("ddp_resume_different_steps", (1, 2)), ("mp_resume_different_steps", (2, 1))]
)
def test_nodes_holding_different_steps_at_one_path_fail_on_every_rank_naming_the_steps(two_nodes, scenario, steps):
    error = one_error_on_every_rank(two_nodes, scenario)
    assert "the ranks would load different checkpoints" in error and NOT_SHARED in error, error
    assert sees(error, "ranks 0, 1", f"see step {steps[0]} ") and sees(error, "ranks 2, 3", f"see step {steps[1]} "), (
        error
    )


@pytest.mark.slow
def test_a_last_checkpoint_on_one_node_only_fails_on_every_rank(two_nodes):
    error = one_error_on_every_rank(two_nodes, "ddp_resume_last")
    assert sees(error, "ranks 0, 1", "see '[^']*last.ckpt' step 1 "), error
    assert sees(error, "ranks 2, 3", "resolve no checkpoint"), error


@pytest.mark.slow
def test_reshard_checkpoint_into_a_node_private_output_fails_on_every_rank(two_nodes):
    error = one_error_on_every_rank(two_nodes, "reshard_callback_private_output")
    assert error.startswith("CheckpointNotSharedError: cannot use the resharded checkpoint from"), error
    assert sees(error, "ranks 2, 3", "see nothing at that path"), error


@pytest.mark.slow
def test_a_failed_resume_launch_fails_on_every_node_with_one_line_and_leaves_no_process(two_nodes, tmp_path):
    """As a user runs it: the error is not caught, each node's launcher exits non-zero, no rank outlives it."""
    for node in range(2):
        private = tmp_path / f"node{node}" / "private"
        private.mkdir(parents=True)
        shutil.copy(two_nodes / "shared" / "ddp_steps" / f"step={node + 1}.ckpt", private / "resume.ckpt")
    (tmp_path / "shared").mkdir()
    done, survivors = run_failing_nodes(
        WORKER, tmp_path / "shared", 2, 2, "ddp_resume_uncaught", nodes=2, root=tmp_path, timeout=LAUNCH_TIMEOUT
    )
    assert survivors == [], f"nodes {survivors} left a rank running after their launcher exited"
    lines = set()
    for node, completed in enumerate(done):
        assert completed.returncode != 0, f"node {node} exited 0:\n{completed.stderr[-3000:]}"
        found = [line for line in completed.stderr.splitlines() if "CheckpointNotSharedError: " in line]
        assert found, f"node {node}:\n{completed.stderr[-3000:]}"
        lines |= {line.split("CheckpointNotSharedError: ", 1)[1] for line in found}
    assert len(lines) == 1, lines
    assert "see step 1 " in next(iter(lines)) and "see step 2 " in next(iter(lines))
