"""``micro_steps_per_call=None`` (the default): the compiled programs decide how many micro-steps one call runs from
the step's size (``compiled/call_length.py``). The rule itself; the FLOPs it reads, against ``FlopCounterMode`` on a
plain forward and backward written here, counted without changing anything of the run; and fits with the default,
bit for bit against one call per micro-batch, saying what was built and why.

The programs are built with the ``aot_eager`` backend, as in ``test_several_per_call.py``."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from lightning_sink import SinkStrategy
from lightning_sink._torch_compat import compiled_graph_count
from lightning_sink.compiled import (
    ProgramSettings,
    StepPrograms,
    build_step_programs,
    call_length,
    program_compile,
    traced_programs,
)
from lightning_sink.compiled.call_length import (
    LOADER_CALL_BYTES,
    LONGEST_CALL,
    LOOP_STEP_FLOPS,
    default_micro_steps,
    loader_call,
    longest_call,
)
from tests.compiled.test_lightning_fit import (
    Net,
    RecordingLogger,
    dataset,
    fit,
    flat,
    plain_loop,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
)
from tests.helpers import quiet_trainer

SMALL, LARGE = LOOP_STEP_FLOPS / 10, LOOP_STEP_FLOPS * 10


@pytest.mark.parametrize(
    "flops, steps, device, capacity, expected",
    [
        (SMALL, 1, "cpu", None, 8),
        (SMALL, 2, "cpu", None, 8),
        (SMALL, 3, "cpu", None, 6),  # whole windows: two of three
        (SMALL, 5, "cpu", None, 5),  # one window, longer than half of eight
        (SMALL, 12, "cpu", None, 12),  # one window, up to sixteen
        (SMALL, 32, "cpu", None, 1),  # too long to unroll
        (SMALL, 1, "cpu", 3, 3),  # a sink that stages three micro-batches
        (SMALL, 4, "cpu", 3, 1),  # ... which a window of four does not fit
        (LARGE, 1, "cpu", None, 1),
        (SMALL, 1, "cuda", None, 1),
    ],
)
def test_the_rule_runs_whole_windows_of_a_small_step_per_call_on_a_cpu(flops, steps, device, capacity, expected):
    count, why = default_micro_steps(flops, steps, device, capacity)
    assert count == expected
    assert "MFLOP" in why or device != "cpu"
    assert ("per call, one loop over its windows" in why) == (expected > 1)


@pytest.mark.parametrize(
    "count, steps, capacity, expected",
    [
        (8, 1, 500, 500),  # a staged sink of 500: one call
        (8, 2, 15, 14),  # whole windows of the sink
        (8, 1, 5000, LONGEST_CALL),
        (8, 1, 8, None),  # no longer than the short call
        (8, 1, None, None),  # no capacity: a loader whose sink length or batch size is unknown
        (1, 1, 500, None),  # one micro-step per call: no call of several at all
    ],
)
def test_a_staged_sink_is_one_call_beside_the_short_calls(count, steps, capacity, expected):
    assert longest_call(count, steps, capacity) == expected


def test_from_a_loader_a_call_stacks_a_sink_within_its_bytes():
    batch = (torch.zeros(32, 64), torch.zeros(32, dtype=torch.int64))  # 8,448 bytes
    assert loader_call(batch, 500, 2**63 - 1) == 500
    assert loader_call(batch, 50_000, 2**63 - 1) == LOADER_CALL_BYTES // 8448
    assert loader_call(batch, 500, 8448 * 20) == 20  # the device-data budget bounds it too
    assert loader_call(batch, 500, 0) == 0  # device_data_budget=0: no longer call
    assert loader_call(batch, None, 2**63 - 1) is None  # the sink's length unknown


class Wide(pl.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Dropout(0.1), nn.Linear(width, 4))

    def training_step(self, batch: Any, batch_idx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_the_flops_read_are_a_plain_forward_and_backward_and_change_nothing():
    module = Wide(64)
    optimizer = module.configure_optimizers()
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(copy.deepcopy(module.net)(batch[0]), batch[1]).backward()
    programs = build_step_programs(
        module, optimizer, batch, ProgramSettings(backend="aot_eager", micro_steps_per_call=None)
    )
    assert isinstance(programs, StepPrograms), programs
    before = flat(module.net), torch.random.get_rng_state()
    assert programs.micro_step_flops(batch) == counter.get_total_flops() > 0
    assert torch.equal(flat(module.net), before[0]) and torch.equal(torch.random.get_rng_state(), before[1])
    assert not any(buffer.any() for buffer in programs.window.buffers)
    assert programs.several == (8, 1) and programs.call_lengths == (8,)  # (the loader path: no longer call)
    assert "8 micro-steps per call" in programs.call_note


def default_fit(model: pl.LightningModule, steps: int, calls: int | None, caplog: Any) -> dict[str, Any]:
    logger = RecordingLogger()
    strategy = SinkStrategy(accumulation_steps=steps, sink_size=10, graph_mode="compile", micro_steps_per_call=calls)
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, logger=logger, log_every_n_steps=1)
    fit(trainer, model, dataset(), caplog)
    said = [r.getMessage() for r in caplog.records if "whole" in r.getMessage()]
    return {"model": model, "trainer": trainer, "points": logger.points, "said": said[0]}


def test_the_default_runs_a_staged_sink_in_one_call_and_trains_what_one_per_call_trains(caplog, several_calls):
    one = default_fit(Net("adamw"), 2, 1, caplog)
    assert several_calls == []
    model = Net("adamw")
    reference = copy.deepcopy(model.net)
    default = default_fit(model, 2, None, caplog)
    # sinks of 10 staged micro-batches: each one call of its five windows
    assert several_calls == [10, 10, 10]
    said = default["said"]
    assert "8 micro-steps per call, one loop over its windows (a micro-step of" in said, said
    assert "and 10 per call for a whole staged sink" in said, said
    assert torch.equal(flat(default["model"].net), flat(one["model"].net))
    assert default["points"] == one["points"] and default["trainer"].global_step == 15
    expected = plain_loop(reference, "adamw", 30, 2, dataset())
    assert relative_error(flat(model.net), flat(reference)) <= 1e-5 and expected["updates"] == 15


class GraphsAtSinkEnds(pl.Callback):
    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.counts.append(compiled_graph_count())


def test_the_build_runs_no_whole_sink_where_every_call_length_is_one_loop_graph(caplog, monkeypatch):
    """Staged sinks of 10 in windows of 2, calls of 8 beside them: on a CPU both lengths run one graph of the loop,
    so the build compiles it with the call of 8 alone (on copies of the state, then timed) and never runs a whole
    sink there; the fit's calls of 10 compile nothing more."""
    windows: list[int] = []  # the windows of each run of the loop, in the build and in the fit
    one_graph = program_compile._windows_may_vary

    def counted(several: Any) -> Any:
        run = one_graph(several)

        def counting(state: Any, call: Any) -> Any:
            windows.append(len(call["hyper"][0]))
            return run(state, call)

        return counting

    monkeypatch.setattr(program_compile, "_windows_may_vary", counted)
    graphs = compiled_graph_count()
    at_sink_ends = GraphsAtSinkEnds()
    strategy = SinkStrategy(accumulation_steps=2, sink_size=10, graph_mode="compile")
    trainer = quiet_trainer(strategy=strategy, max_epochs=3, callbacks=[at_sink_ends])
    fit(trainer, Net("adamw"), dataset(), caplog)
    assert windows == [4] + [4, 4, 4] + [5, 5, 5]  # built with 8, timed with 8, then the three sinks
    assert at_sink_ends.counts == [graphs + 1] * 3  # the loop's one graph, compiled in the build


class Samples(torch.utils.data.Dataset):
    """A map-style dataset that is not a ``TensorDataset``: the loader reads it (it is not staged)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        return self.data[index]


def test_from_a_loader_the_default_runs_a_sink_in_one_call_with_one_loop_graph(caplog, several_calls):
    """Batches read by the loader (not staged): the default stacks a sink's batches into one call of its five
    windows (the calls of 8 beside it share the loop's graph), bit for bit what one call per micro-batch trains."""

    def run(calls: int | None) -> dict[str, Any]:
        strategy = SinkStrategy(accumulation_steps=2, sink_size=10, graph_mode="compile", micro_steps_per_call=calls)
        logger = RecordingLogger()
        trainer = quiet_trainer(strategy=strategy, max_epochs=3, logger=logger, log_every_n_steps=1)
        model = Net("adamw")
        reference = copy.deepcopy(model.net)
        fit(trainer, model, Samples(dataset()), caplog)
        said = [r.getMessage() for r in caplog.records if "whole" in r.getMessage()]
        return {"model": model, "trainer": trainer, "points": logger.points, "said": said[0], "reference": reference}

    one = run(1)
    assert several_calls == []
    graphs = compiled_graph_count()
    default = run(None)
    assert several_calls == [10, 10, 10]
    assert "8 micro-steps per call, one loop over its windows" in default["said"], default["said"]
    assert "and 10 per call for a sink's batches from the loader" in default["said"], default["said"]
    assert "gathered on the device" not in default["said"]
    # one loop: every micro-batch ran in a call of 10, so the one-micro-step pair was never built
    assert compiled_graph_count() - graphs == 1
    assert "the accumulate and update programs of one micro-step compile when first needed" in default["said"]
    assert torch.equal(flat(default["model"].net), flat(one["model"].net))
    assert default["points"] == one["points"] and default["trainer"].global_step == 15
    reference = default["reference"]  # the same 30 micro-batches through a plain PyTorch loop
    expected = plain_loop(reference, "adamw", 30, 2, dataset())
    assert relative_error(flat(default["model"].net), flat(reference)) <= 1e-5 and expected["updates"] == 15


def test_a_sink_cut_by_a_pass_end_runs_each_part_in_one_call_of_its_length(caplog, several_calls):
    """Sinks of 20 over a data pass of 30: the first sink is one call; the second meets the pass's end after 10,
    so each of its passes' parts, 10 micro-batches, is one call of 10: bit for bit one per call, every call length
    one compiled graph, and no program of one micro-step built."""

    def run(calls: int | None) -> dict[str, Any]:
        strategy = SinkStrategy(accumulation_steps=2, sink_size=20, graph_mode="compile", micro_steps_per_call=calls)
        logger = RecordingLogger()
        trainer = quiet_trainer(strategy=strategy, max_epochs=2, logger=logger, log_every_n_steps=1)
        model = Net("adamw")
        x, y = dataset().tensors
        caplog.clear()
        fit(trainer, model, TensorDataset(x.repeat(3, 1), y.repeat(3)), caplog)  # a pass of 30 micro-batches
        said = [r.getMessage() for r in caplog.records if "programs of one micro-step compiled in" in r.getMessage()]
        return {"model": model, "trainer": trainer, "points": logger.points, "pair_built": said}

    one = run(1)
    assert several_calls == [] and one["pair_built"] == []  # (built with the fit's build: nothing later)
    graphs = compiled_graph_count()
    default = run(None)
    assert several_calls == [20, 10, 10]
    # one loop: the calls of 20 and of 10 share its graph (the number of windows, the hyperparameter rows' length, is
    # a size the graph leaves open), and no accumulate or update program is built
    assert compiled_graph_count() - graphs == 1
    assert default["pair_built"] == []
    assert default["trainer"].global_step == one["trainer"].global_step == 20
    assert torch.equal(flat(default["model"].net), flat(one["model"].net))
    assert default["points"] == one["points"]


def test_the_default_runs_a_large_step_one_per_call_and_says_so(caplog, several_calls, monkeypatch):
    class Large(Wide):
        pass

    threshold = 8e6  # (the rule's own is a billion FLOPs: a model that large would make a slow test)
    monkeypatch.setattr(call_length, "LOOP_STEP_FLOPS", threshold)
    model = Large(int(threshold // (6 * 4 * 8)) + 64)  # (6 FLOPs a weight a sample: above the threshold)
    large = default_fit(model, 1, None, caplog)
    assert several_calls == []
    assert "one micro-step per call (a micro-step of" in large["said"], large["said"]
    assert large["trainer"].global_step == 30


def test_a_loop_that_does_not_build_leaves_the_step_compiled_one_per_call(caplog, several_calls, monkeypatch):
    """Where torch's loop cannot hold the step (Inductor refuses some operations inside ``scan``), the build keeps
    the one-micro-step programs rather than falling back to the eager step, and its line says why."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("no rule for this operation inside a loop")

    monkeypatch.setattr(traced_programs, "scan_loop", refused)
    one = default_fit(Net("adamw"), 2, 1, caplog)
    default = default_fit(Net("adamw"), 2, None, caplog)
    assert several_calls == []
    said = default["said"]
    assert "one micro-step per call (the loop over windows did not build: " in said, said
    assert not [r for r in caplog.records if "no whole-step programs" in r.getMessage()]
    assert torch.equal(flat(default["model"].net), flat(one["model"].net))
    assert default["points"] == one["points"] and default["trainer"].global_step == 15


def test_the_flops_read_are_the_steps_own_and_change_nothing():
    module = Wide(64)  # one dropout: the eager run that counts the FLOPs draws on copies of the random state
    batch = (torch.randn(16, 8), torch.randint(0, 4, (16,)))
    programs = build_step_programs(module, module.configure_optimizers(), batch, ProgramSettings(backend="aot_eager"))
    assert isinstance(programs, StepPrograms), programs
    state = torch.random.get_rng_state()
    # forward 2*16*8*64 + 2*16*64*4, backward twice that less the input's gradient (2*16*8*64)
    forward = 2 * 16 * 8 * 64 + 2 * 16 * 64 * 4
    assert programs.micro_step_flops(batch) == 3 * forward - 2 * 16 * 8 * 64
    assert torch.equal(torch.random.get_rng_state(), state)
