"""A Lightning fit whose compiled programs gather their batches from the training set staged on the device
(``SinkStrategy(graph_mode="compile", device_data_budget=...)``, ``sink/staging.py``), against the same fit on the
loader path (``device_data_budget=0``, or a loader that does not qualify): every parameter bit-identical, the
``self.log`` values equal, a resume mid-sink equal to the uninterrupted run.

The loaders shuffle (their permutations drawn from torch's global generator at each pass's start, as the dropout in
the step draws from it), so the batch order, the sampler epochs and the random state are all checked by the
parameters. The programs are built with the ``aot_eager`` backend (the same graphs with eager kernels: much faster
to build than Inductor's code). On the CPU "staged" copies nothing: the tensors are gathered inside the program."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, default_collate

import lightning_sink.sink.programs.compiled_choice as compiled_choice
from lightning_sink import SinkStrategy
from lightning_sink.compiled import Unavailable
from lightning_sink.compiled.cuda_graphs import CapturedProgram
from lightning_sink.compiled.device_dataset import SinkIndices
from lightning_sink.data import DataPosition
from lightning_sink.sink.staging import StagingConditions, plan_staging
from tests.compiled.test_lightning_fit import quick_backend  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
from tests.helpers import RecordingLogger, quiet_trainer

MICRO = 4
STAGED = "each batch gathered on the device from the training set staged there"
NOT_STAGED = "batches read by the loader path (not staged on the device:"


@pytest.fixture
def uploads(monkeypatch):
    """The number of index rows of each ``SinkIndices.load`` (one upload each)."""
    loaded: list[int] = []
    load = SinkIndices.load

    def counting(self: SinkIndices, batches: Any) -> None:
        loaded.append(len(batches))
        load(self, batches)

    monkeypatch.setattr(SinkIndices, "load", counting)
    return loaded


def dataset(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(samples, 8, generator=generator), torch.randint(0, 4, (samples,), generator=generator)
    )


def shuffled(data: TensorDataset, **kwargs: Any) -> DataLoader:
    return DataLoader(data, batch_size=MICRO, shuffle=True, **kwargs)


class Net(pl.LightningModule):
    """Dropout (random numbers drawn inside the program), BatchNorm (buffers), two logged values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.3))
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.head(self.net(x))
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("logits_double", 2 * logits.mean(), on_epoch=True)  # the epoch value weighs each batch's size
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.95)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def trainer_for(
    steps: int, sink_size: int, epochs: int, budget: int | None, graph_mode: str = "compile", **kwargs: Any
) -> pl.Trainer:
    strategy = SinkStrategy(
        accumulation_steps=steps, sink_size=sink_size, graph_mode=graph_mode, device_data_budget=budget
    )
    return quiet_trainer(strategy=strategy, **{"max_epochs": epochs, **kwargs})


def run(trainer: pl.Trainer, loader: DataLoader, caplog: Any, seed: int = 7, **kwargs: Any) -> tuple[Net, str]:
    """The fit (the global generator seeded first: the shuffling and the dropout draw from it) and its one line on
    the compiled programs."""
    torch._dynamo.reset()  # each fit builds its programs afresh
    model = Net()
    torch.manual_seed(seed)
    caplog.clear()
    with caplog.at_level("INFO"):
        trainer.fit(model, loader, **kwargs)
    # "the step programs are compiled whole" (calls of several: their loop alone), "the accumulate and update
    # programs are compiled whole", or under cuda_graph "... compiled and captured as CUDA graphs whole"
    built = "programs are compiled"
    lines = [record.getMessage() for record in caplog.records if built in record.getMessage()]
    assert len(lines) == 1, lines
    return model, lines[0]


def state(model: nn.Module) -> list[torch.Tensor]:
    return [tensor.detach().clone() for tensor in [*model.parameters(), *model.buffers()]]


def assert_identical(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        assert torch.equal(left, right)


# (accumulation, samples, sink size, epochs): 11 micro-batches per pass, sinks of 7 (passes end inside sinks, windows
# run on across sinks and passes); 42 samples: each pass ends with a partial batch of 2 (read on the host); a sink of
# one such pass (-1): the call as long as a staged sink stops before the partial batch, which trains apart
CASES = [
    (1, 44, 7, 4),
    (4, 44, 7, 5),
    (4, 42, 7, 4),
    (1, 42, -1, 3),
    pytest.param(3, 44, -1, 3, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("steps, samples, sink_size, epochs", CASES)
def test_a_staged_fit_trains_what_the_loader_fit_trains(steps, samples, sink_size, epochs, caplog, uploads):
    data = dataset(samples)
    runs = {}
    for budget in (0, None):  # 0: over budget, the loader path; None: the CPU's default (staged)
        logger = RecordingLogger()
        trainer = trainer_for(steps, sink_size, epochs, budget, logger=logger, log_every_n_steps=1)
        uploads.clear()
        model, line = run(trainer, shuffled(data), caplog)
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
        runs[budget] = (state(model), logger.points, metrics, trainer.global_step, line, list(uploads))
    loader_state, loader_points, loader_metrics, loader_steps, loader_line, loader_uploads = runs[0]
    staged_state, points, metrics, global_step, line, staged_uploads = runs[None]
    assert NOT_STAGED in loader_line and "over device_data_budget=0" in loader_line and not loader_uploads
    assert STAGED in line
    # one upload per run of micro-batches within a segment and a data pass; a partial batch's indices never
    per_pass = -(-samples // MICRO)
    trained = (sink_size if sink_size > 0 else per_pass) * epochs
    partial = samples % MICRO != 0
    expected = sum(1 for micro in range(trained) if not (partial and micro % per_pass == per_pass - 1))
    assert sum(staged_uploads) == expected
    assert max(staged_uploads) <= min(per_pass, sink_size if sink_size > 0 else per_pass)
    assert global_step == loader_steps > 0
    assert_identical(staged_state, loader_state)
    assert points == loader_points and len(points) >= 3
    assert metrics == loader_metrics and {"train_loss", "logits_double_epoch"} <= metrics.keys()


def test_a_resume_mid_sink_reaches_the_uninterrupted_staged_run_bit_for_bit(tmp_path, caplog):
    """A max_steps stop inside a sink (and inside a data pass), its checkpoint, the resume to the end:
    equal to the uninterrupted run, both staged; the resume shuffles the interrupted pass again from the
    checkpoint's generator states. (The loader has its own generator: one drawing from the global generator draws
    a new base seed when the resumed pass starts, on the loader path as here, and resumes inexactly.)"""
    data = dataset(44)

    def loader() -> DataLoader:
        return shuffled(data, generator=torch.Generator().manual_seed(3))

    uninterrupted, line = run(trainer_for(3, 7, 100, None, max_steps=12), loader(), caplog)
    assert STAGED in line
    first = trainer_for(3, 7, 100, None, max_steps=4)
    run(first, loader(), caplog)  # stopped after 12 micro-batches: 5 into the second sink, 1 into the second pass
    first.save_checkpoint(tmp_path / "stop.ckpt")
    again = trainer_for(3, 7, 100, None, max_steps=12)
    resumed, line = run(again, loader(), caplog, seed=99, ckpt_path=tmp_path / "stop.ckpt")
    assert STAGED in line
    assert again.global_step == 12
    assert_identical(state(resumed), state(uninterrupted))


@pytest.mark.parametrize("budget", [-1, 1.5, True, "1GB"])
def test_an_invalid_budget_is_refused_at_construction(budget):
    with pytest.raises(ValueError, match=rf"device_data_budget={budget!r} is not valid: pass an int >= 0 \(bytes"):
        SinkStrategy(sink_size=4, graph_mode="compile", device_data_budget=budget)


def one_collate(batch: Any) -> Any:
    return default_collate(batch)  # the same batches, but not default_collate itself: read by the loader


@pytest.mark.parametrize("kind", ["over budget by one byte", "own collate_fn"])
def test_a_loader_that_is_not_staged_trains_the_same(kind, caplog, uploads):
    data = dataset(44)
    size = sum(tensor.numel() * tensor.element_size() for tensor in data.tensors)
    staged_model, line = run(trainer_for(4, 7, 3, size), shuffled(data), caplog)  # exactly within the budget
    assert STAGED in line and uploads
    uploads.clear()
    if kind == "own collate_fn":
        model, line = run(trainer_for(4, 7, 3, None), shuffled(data, collate_fn=one_collate), caplog)
        assert f"{NOT_STAGED} the training loader is not a DataLoader over a TensorDataset read by indexing" in line
    else:
        model, line = run(trainer_for(4, 7, 3, size - 1), shuffled(data), caplog)
        assert f"{NOT_STAGED} the dataset's tensors take {size} bytes, over device_data_budget={size - 1}" in line
    assert not uploads
    assert_identical(state(model), state(staged_model))


class GraphBreak(Net):
    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        if float(batch[0].sum()) > 1e9:  # a host read: the programs are refused at their build
            raise AssertionError("unreachable")
        return super().training_step(batch, batch_idx)


def test_programs_refused_at_their_build_leave_staged_batches_to_the_loader_path(uploads):
    """The data was planned for staging, the programs' build fails at the first sink: the eager pair trains the
    batches read on the host from the same indices, as on the loader path."""
    data = dataset(42)
    results = []
    for budget in (0, None):
        torch._dynamo.reset()  # each fit compiles its forward afresh
        model = GraphBreak()
        torch.manual_seed(7)
        with pytest.warns(UserWarning, match="no whole-step programs.*did not compile to one graph"):
            trainer_for(2, 5, 4, budget).fit(model, shuffled(data))
        results.append(state(model))
    assert not uploads
    assert_identical(results[1], results[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="staging copies the dataset to a CUDA device")
@pytest.mark.parametrize("graph_mode", ["compile", "cuda_graph"])
def test_on_cuda_a_staged_fit_trains_what_the_loader_fit_trains(graph_mode, caplog, uploads, monkeypatch):
    """On the GPU (Inductor, and CUDA graphs replaying over the staged tensors): staged against the loader path,
    equal within float tolerance (the gather and the host copy give the same batches; kernels may differ)."""
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "inductor")
    data = dataset(48)  # whole batches: the captured programs take one shape
    models = {}
    for budget in (0, None):
        trainer = trainer_for(2, 7, 4, budget, graph_mode, accelerator="gpu", devices=1)
        model, line = run(trainer, shuffled(data), caplog)
        assert (STAGED in line) is (budget is None), line
        models[budget] = [tensor.cpu() for tensor in state(model)]
    assert uploads  # the staged fit uploaded its indices
    for staged, loaded in zip(models[None], models[0]):
        torch.testing.assert_close(staged, loaded, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_on_cuda_a_whole_staged_sink_replays_as_one_cuda_graph(monkeypatch):
    """``graph_mode="cuda_graph"`` with ``micro_steps_per_call=sink_size``: a staged sink's micro-steps (windows of 2,
    the step scheduler's values inside the call) captured as one CUDA graph and replayed once per sink, training what
    one captured program per micro-batch trains (no dropout: the loop and the one-step programs are compiled apart,
    and Inductor's GPU random numbers are its own per graph)."""
    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "inductor")
    replays: list[int] = []
    replay = CapturedProgram.__call__

    def counting(self: CapturedProgram, batch: Any) -> Any:
        replays[-1] += 1
        return replay(self, batch)

    monkeypatch.setattr(CapturedProgram, "__call__", counting)
    data = dataset(64)  # 16 micro-batches a pass: two sinks of 8, four windows each
    models = {}
    for per_call in (1, 8):
        replays.append(0)
        torch._dynamo.reset()
        model = Net()
        model.net[3] = nn.Identity()
        strategy = SinkStrategy(
            accumulation_steps=2, sink_size=8, graph_mode="cuda_graph", micro_steps_per_call=per_call
        )
        torch.manual_seed(7)
        quiet_trainer(strategy=strategy, max_epochs=2, accelerator="gpu", devices=1).fit(model, shuffled(data))
        models[per_call] = [tensor.cpu() for tensor in state(model)]
    assert replays == [16, 2]  # (sink mode: an epoch is a sink) one replay per micro-batch, then one per sink
    for whole_sink, one_per_call in zip(models[8], models[1]):
        torch.testing.assert_close(whole_sink, one_per_call, rtol=1e-5, atol=1e-6)


def test_captured_programs_refuse_a_pass_that_ends_with_a_partial_batch():
    # (CUDA graphs read one batch shape; the check itself needs no CUDA device)
    conditions = StagingConditions("cuda_graph", 0, direct_transfer=True, converts_input=False)
    plan = partial(
        plan_staging, conditions=conditions, budget=2**40, position=DataPosition(), device=torch.device("cpu")
    )
    refused = plan(DataLoader(dataset(42), batch_size=MICRO), sink_size=7)
    assert isinstance(refused, Unavailable) and "ends with a partial batch" in refused.reason
    assert not isinstance(plan(DataLoader(dataset(42), batch_size=MICRO, drop_last=True), sink_size=7), Unavailable)
