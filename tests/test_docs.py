"""The documentation covers every public class, callback and CLI command, refers only to what the repository
contains, and its Python snippets run as written."""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

import lightning_sink
import lightning_sink.callbacks
from lightning_sink.cli import main as cli_main
from lightning_sink.layout import load_layout
from lightning_sink.reshard import load_resharded_checkpoint, unpickle_carried, verify_checkpoint
from tests.conftest import clean_subprocess_env
from tests.doc_worlds import flat_names, forget_my_pkg, rank_shard, target_rank_1, write_my_pkg

REPO = Path(__file__).resolve().parents[1]
DOCS = "\n".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
# Material a reader of the repository does not have: development notes, design cards, session logs.
INTERNAL = re.compile(r"\bseeds? ?0\d\d\b|design card|DESIGN\.md|this session|been lent|notes/README", re.IGNORECASE)


@pytest.mark.parametrize(
    "name", [n for n in lightning_sink.__all__ if not n.startswith("__")] + list(lightning_sink.callbacks.__all__)
)
def test_every_public_name_has_documentation(name: str) -> None:
    assert re.search(rf"`[\w.]*\b{name}\b", DOCS), f"{name} is public but no page in docs/ names it"


def test_every_cli_command_has_documentation(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    commands = re.search(r"\{([a-z_,-]+)\}", capsys.readouterr().out).group(1).split(",")
    assert set(commands) == {"layout", "reshard", "verify"}
    for command in commands:
        assert f"lightning-sink {command}" in DOCS, f"`lightning-sink {command}` is not documented in docs/"


def test_no_reference_to_material_outside_the_repository() -> None:
    files = [
        path
        for pattern in ("*.py", "*.md", "*.yaml", "*.toml")
        for path in REPO.rglob(pattern)
        if not any(part.startswith(".") for part in path.relative_to(REPO).parts) and path != Path(__file__).resolve()
    ]
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert found == []


# ------------------------------------------------------------------------------ every Python snippet in docs/ runs
SNIPPET = re.compile(r"```python\n(.*?)```", re.DOTALL)
SNIPPETS = {
    f"{path.name}:{index}": code
    for path in sorted((REPO / "docs").glob("*.md"))
    for index, code in enumerate(SNIPPET.findall(path.read_text()))
}
# Snippets that start several processes: Lightning's launcher starts the other ranks by running the script again, so
# they run as a script of their own.
AS_SCRIPT = {"model_parallel.md:0"}
# Snippets that convert or load checkpoints: each runs, as written, in the world its own test below prepares (the
# reader's model, data, checkpoints and layouts); the generic test runs every other snippet.
IN_A_PREPARED_WORLD = {
    "reshard_in_lightning.md:0": "test_reshard_in_lightning_continues_training_from_a_resharded_folder",
    "reshard_in_lightning.md:1": "test_reshard_in_lightning_trains_on_3_processes_and_hands_over_for_2",
    "resharding.md:0": "test_resharding_converts_a_3_rank_dcp_checkpoint_and_loads_rank_1",
    "resharding.md:1": "test_resharding_converts_a_one_device_lightning_checkpoint",
}
PRINTED_LOSS = re.compile(r"^# (epoch: \d+ step: \d+, loss is) ", re.MULTILINE)


def test_every_snippet_is_executed():
    """A snippet is run by the generic test unless a test of its own, named here, runs it in a prepared world."""
    assert set(IN_A_PREPARED_WORLD) <= set(SNIPPETS)  # a snippet that is gone must leave the list
    for name, test in IN_A_PREPARED_WORLD.items():
        assert f'"{name}"' in inspect.getsource(globals()[test]), f"{test} does not run docs/{name}"


@pytest.fixture
def my_pkg(tmp_path, monkeypatch):
    """The reader's package, importable in this process and in the snippet's subprocesses (their working folder)."""
    write_my_pkg(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    forget_my_pkg()  # the next test's my_pkg is another folder's


def run_as_script(name: str, folder: Path, preamble: str = "", epilogue: str = "") -> str:
    """``docs/{name}`` run as a script in ``folder`` (Lightning's launcher starts the other ranks by running it
    again); ``preamble`` and ``epilogue`` are the test's, around the snippet's unchanged lines. Returns stdout."""
    script = folder / "snippet.py"
    script.write_text(f"{preamble}\n{SNIPPETS[name]}\n{epilogue}")
    env = clean_subprocess_env(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("name", [name for name in SNIPPETS if name not in IN_A_PREPARED_WORLD])
def test_docs_python_snippet_runs(name, tmp_path, monkeypatch, capsys, request):
    code = SNIPPETS[name]
    monkeypatch.chdir(tmp_path)
    if "my_pkg." in code:
        request.getfixturevalue("my_pkg")
    if name in AS_SCRIPT:
        printed = run_as_script(name, tmp_path)
    else:
        exec(compile(code, f"docs/{name}", "exec"), {"__name__": "__main__"})
        printed = capsys.readouterr().out
    # a loss line the snippet shows in a comment is printed (its value is the reader's run's own)
    for shown in PRINTED_LOSS.findall(code):
        assert shown in printed, f"docs/{name} shows `{shown} ...` but the run printed:\n{printed[-2000:]}"


# -------------------------------------------------- the resharding snippets, in worlds prepared for them
HIDDEN = 64  # the width the snippets give my_pkg.models.MLP


def tensors_of(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_resharded_checkpoint(folder / f"rank_{rank}" / f"checkpoint_{rank}.pt")["tensors"]


def dcp_reference(folder: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """A DCP folder's full tensors under the rank files' names, by DCP's own offline loader."""
    dcp_to_torch_save(folder, scratch)
    return {
        name: value
        for name, value in flat_names(torch.load(scratch, weights_only=True)).items()
        if isinstance(value, torch.Tensor)
    }


def assert_is_the_reference_resharded(folder: Path, reference: dict[str, torch.Tensor]) -> None:
    """Every tensor of the 2 rank files is its rank's part of the reference's tensor, bit for bit."""
    verify_checkpoint(folder)
    for rank in (0, 1):
        tensors = tensors_of(folder, rank)
        assert set(tensors) == set(reference)
        for fqn, tensor in tensors.items():
            assert torch.equal(tensor, rank_shard(fqn, reference[fqn], rank)), (rank, fqn)


@pytest.fixture(scope="module")
def stage_runs(tmp_path_factory):
    """reshard_in_lightning.md:1 run once (3 training processes): its stage-1 DCP folder and stage-2 rank files
    are the checkpoints the other resharding snippets convert and load."""
    folder = write_my_pkg(tmp_path_factory.mktemp("stage_runs"))
    run_as_script("reshard_in_lightning.md:1", folder)
    return folder


def test_reshard_in_lightning_trains_on_3_processes_and_hands_over_for_2(stage_runs, tmp_path):
    """What "reshard_in_lightning.md:1" (run by the stage_runs fixture) says it writes, checked against DCP's own
    loader: the 3-rank DCP folder of stage 1 and its conversion to the 2 rank files of stage 2's layout."""
    stage1, stage2 = stage_runs / "ckpts" / "stage1", stage_runs / "ckpts" / "stage2"
    assert sorted(path.name for path in stage1.glob("*.distcp")) == [f"__{rank}_0.distcp" for rank in range(3)]
    assert load_layout(stage1 / "layout.json").mesh.shape == (3, 1)
    assert load_layout(stage2 / "layout.json") == load_layout(stage_runs / "stage2_layout.json")
    assert verify_checkpoint(stage2).world_size == 2
    assert_is_the_reference_resharded(stage2, dcp_reference(stage1, tmp_path / "stage1.pt"))
    carried = load_resharded_checkpoint(stage2 / "rank_0" / "checkpoint_0.pt")["extra_files"]["meta.pt"]
    meta = unpickle_carried(carried, weights_only=False)
    # 192 samples over 3 data-parallel ranks, micro-batches of 16, windows of 2: 2 updates in the one epoch
    assert (meta["epoch"], meta["global_step"]) == (1, 2)  # epoch: the epochs done, as trainer.current_epoch


def test_reshard_in_lightning_continues_training_from_a_resharded_folder(stage_runs, my_pkg):
    (my_pkg / "ckpts").mkdir()
    shutil.copytree(stage_runs / "ckpts" / "stage2", my_pkg / "ckpts" / "step100_tp2")
    preamble = f"""
import torch
from my_pkg.data import RandomDigits
from my_pkg.models import MLP


class MLPSeenAtTrainStart(MLP):  # tests/test_docs.py: keeps the weights the fit starts from
    def on_train_start(self):
        weights = {{name: parameter.full_tensor() for name, parameter in self.named_parameters()}}
        if self.global_rank == 0:
            torch.save(weights, "weights_at_train_start.pt")


model = MLPSeenAtTrainStart(hidden={HIDDEN})  # the reader's model and data
data = RandomDigits(samples=64, batch_size=8)
"""
    epilogue = 'print(f"rank {trainer.global_rank}: epoch {trainer.current_epoch}, global step {trainer.global_step}")'
    printed = run_as_script("reshard_in_lightning.md:0", my_pkg, preamble, epilogue)
    # stage 1 ended after epoch 0 at step 2; one more epoch of 8 micro-batches in windows of 2: 4 more updates
    assert "rank 0: epoch 2, global step 6" in printed and "rank 1: epoch 2, global step 6" in printed
    # the fit started from stage 1's final weights (DCP's own loader of stage 1's folder is the reference)
    reference = dcp_reference(stage_runs / "ckpts" / "stage1", my_pkg / "stage1.pt")
    start = torch.load(my_pkg / "weights_at_train_start.pt", weights_only=True)
    assert set(start) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    for name, weight in start.items():
        assert torch.equal(weight, reference[f"state_dict.{name}"]), name


@pytest.fixture(scope="module")
def target_layout(tmp_path_factory):
    """target_layout.json for 2 processes, 1 x 2, written by `lightning-sink layout` as the doc suggests."""
    folder = write_my_pkg(tmp_path_factory.mktemp("target_layout"))
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        cli_main(
            ["layout", "--model", "my_pkg.models.MLP", "--init-args", f'{{"hidden": {HIDDEN}}}']
            + ["--data-parallel-size", "1", "--tensor-parallel-size", "2", "--output", str(folder / "layout.json")]
        )
    forget_my_pkg()
    return folder / "layout.json"


def test_resharding_converts_a_3_rank_dcp_checkpoint_and_loads_rank_1(stage_runs, target_layout, my_pkg, monkeypatch):
    monkeypatch.chdir(my_pkg)
    (my_pkg / "ckpts").mkdir()
    shutil.copytree(stage_runs / "ckpts" / "stage1", my_pkg / "ckpts" / "step100")  # saved by 3 ranks, mesh 3 x 1
    shutil.copy(target_layout, my_pkg / "target_layout.json")
    namespace = {"__name__": "__main__"}
    exec(compile(target_rank_1(HIDDEN), "tests/test_docs.py", "exec"), namespace)  # model, optimizer, device_mesh
    exec(compile(SNIPPETS["resharding.md:0"], "docs/resharding.md:0", "exec"), namespace)

    reference = dcp_reference(my_pkg / "ckpts" / "step100", my_pkg / "step100.pt")
    assert_is_the_reference_resharded(my_pkg / "ckpts" / "step100_tp2", reference)
    assert namespace["rank_list_for_transform"](1, "ckpts/step100", "target_layout.json") == [0, 1, 2]  # as shown
    by_rank = load_resharded_checkpoint(my_pkg / "out" / "rank_1" / "checkpoint_1.pt")["tensors"]
    whole = tensors_of(my_pkg / "ckpts" / "step100_tp2", 1)
    assert set(by_rank) == set(whole) and all(torch.equal(by_rank[fqn], whole[fqn]) for fqn in whole)
    # the live model and optimizer of rank 1 now hold rank 1's shards; the DTensors wrap the same shards
    model, optimizer = namespace["model"], namespace["optimizer"]
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.to_local(), whole[f"state_dict.{name}"]), name
        for key, value in optimizer.state[parameter].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            assert torch.equal(local, whole[f"optimizer_0.state.{name}.{key}"]), (name, key)
    dtensors = namespace["dtensors"]
    assert set(dtensors) == set(whole)
    for fqn, value in dtensors.items():
        assert torch.equal(value.to_local() if isinstance(value, DTensor) else value, whole[fqn]), fqn
    assert dtensors["state_dict.net.0.weight"].shape == (HIDDEN, 784)


def test_resharding_converts_a_one_device_lightning_checkpoint(target_layout, my_pkg, monkeypatch):
    from my_pkg.data import RandomDigits
    from my_pkg.models import MLP

    monkeypatch.chdir(my_pkg)
    shutil.copy(target_layout, my_pkg / "target_layout.json")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(MLP(hidden=HIDDEN), datamodule=RandomDigits(samples=32, batch_size=8))
    trainer.save_checkpoint("last.ckpt")  # the reader's one-device checkpoint
    exec(compile(SNIPPETS["resharding.md:1"], "docs/resharding.md:1", "exec"), {"__name__": "__main__"})

    saved = torch.load("last.ckpt", weights_only=True)
    names = list(saved["state_dict"])  # the optimizer's parameter indices follow the module's parameter order
    reference = {f"state_dict.{name}": value for name, value in saved["state_dict"].items()} | {
        f"optimizer_0.state.{names[index]}.{key}": value
        for index, state in saved["optimizer_states"][0]["state"].items()
        for key, value in state.items()
    }
    assert_is_the_reference_resharded(my_pkg / "ckpts" / "tp2", reference)
    by_rank = load_resharded_checkpoint(my_pkg / "out" / "rank_1" / "checkpoint_1.pt")["tensors"]
    whole = tensors_of(my_pkg / "ckpts" / "tp2", 1)
    assert set(by_rank) == set(whole) and all(torch.equal(by_rank[fqn], whole[fqn]) for fqn in whole)
    meta = unpickle_carried(
        load_resharded_checkpoint(my_pkg / "ckpts" / "tp2" / "rank_0" / "checkpoint_0.pt")["extra_files"]["meta.pt"],
        weights_only=False,
    )
    assert meta["global_step"] == trainer.global_step == 4
