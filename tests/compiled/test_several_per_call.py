"""``SinkStrategy(graph_mode="compile", micro_steps_per_call=M)``: M micro-batches (whole windows) per compiled call,
against the same fit with one micro-batch per call (bit for bit: parameters, ``global_step``, every logged point)
and against a plain PyTorch loop written in ``test_lightning_fit.py``; the cases that run one per call instead; a
resume inside a sink; the argument's checks.

The programs are built with the ``aot_eager`` backend (the same graphs, eager kernels), as in
``test_lightning_fit.py``: there an unrolled program computes exactly what the one-per-call programs compute."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_sink import SinkStrategy
from lightning_sink.loss_scale import DynamicLossScale
from lightning_sink.precision import LossScalePrecision
from tests.compiled.test_lightning_fit import (
    Net,
    RecordingLogger,
    SaveAtEpochEnd,
    dataset,
    fit,
    flat,
    plain_loop,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
)
from tests.helpers import quiet_trainer


def trainer_for(steps: int, sink_size: int, epochs: int, calls: int, **kwargs: Any) -> pl.Trainer:
    plugins = kwargs.pop("plugins", None)
    strategy = SinkStrategy(
        accumulation_steps=steps, sink_size=sink_size, graph_mode="compile", micro_steps_per_call=calls
    )
    return quiet_trainer(strategy=strategy, plugins=plugins, **{"max_epochs": epochs, **kwargs})


def logged_fit(steps: int, sink_size: int, epochs: int, calls: int, caplog: Any, **kwargs: Any) -> dict[str, Any]:
    optimizer, batch_norm = kwargs.pop("optimizer", "adamw"), kwargs.pop("batch_norm", False)
    poisoned = kwargs.pop("poison_at", ())
    model = Net(optimizer, batch_norm)
    logger = RecordingLogger()
    trainer = trainer_for(steps, sink_size, epochs, calls, logger=logger, log_every_n_steps=1, **kwargs)
    fit(trainer, model, dataset(poisoned), caplog)
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    return {"model": model, "trainer": trainer, "points": logger.points, "metrics": metrics}


# (optimizer, accumulation, sink size, epochs, micro-steps per call, clipping, BatchNorm): sinks that are not a
# multiple of a call (a rest of two windows or more is a shorter call, of one window runs one per call), windows
# open across sinks, passes of 10 micro-batches
CASES = [
    ("sgd", 1, 7, 4, 3, {}, True),
    ("adamw", 2, 10, 3, 4, {"gradient_clip_val": 0.5}, False),
    ("adam", 3, 7, 5, 3, {"gradient_clip_val": 0.05, "gradient_clip_algorithm": "value"}, False),
]


@pytest.mark.parametrize("optimizer, steps, sink_size, epochs, calls, clip, batch_norm", CASES)
def test_several_micro_batches_per_call_equal_one_per_call(
    optimizer, steps, sink_size, epochs, calls, clip, batch_norm, caplog, several_calls
):
    one = logged_fit(steps, sink_size, epochs, 1, caplog, optimizer=optimizer, batch_norm=batch_norm, **clip)
    assert several_calls == []
    reference = copy.deepcopy(Net(optimizer, batch_norm).net)
    several = logged_fit(steps, sink_size, epochs, calls, caplog, optimizer=optimizer, batch_norm=batch_norm, **clip)
    assert len(several_calls) >= 3 and max(several_calls) == calls  # the unrolled program ran
    assert all(count % steps == 0 and count >= min(calls, 2 * steps) for count in several_calls)
    assert torch.equal(flat(several["model"].net), flat(one["model"].net))
    assert several["trainer"].global_step == one["trainer"].global_step
    assert several["points"] == one["points"] and len(several["points"]) >= 6
    assert several["metrics"] == one["metrics"]
    clip_setting = None if not clip else (clip.get("gradient_clip_algorithm", "norm"), clip["gradient_clip_val"])
    expected = plain_loop(reference, optimizer, sink_size * epochs, steps, dataset(), clip_setting)
    assert several["trainer"].global_step == expected["updates"]
    assert relative_error(flat(several["model"].net), flat(reference)) <= 1e-5


def test_a_segments_rest_of_two_windows_or_more_is_one_call_and_no_pair_is_built(caplog, several_calls):
    """Calls of 3, windows of one, sinks of 7 over passes of 10: each sink's or pass's part is split into calls of
    two or more (3, 2, 2: a rest of one window would need the one-micro-step programs), none of them is built, and
    the fit is the one with one call per micro-batch, bit for bit."""
    one = logged_fit(1, 7, 2, 1, caplog)
    caplog.clear()
    several = logged_fit(1, 7, 2, 3, caplog)
    assert several_calls == [3, 2, 2, 3, 2, 2]  # (the second sink: 3 before the pass's end, 4 after it)
    assert not [r for r in caplog.records if "programs of one micro-step compiled in" in r.getMessage()]
    assert torch.equal(flat(several["model"].net), flat(one["model"].net))
    assert several["points"] == one["points"] and several["metrics"] == one["metrics"]


def test_dynamic_loss_scaling_logs_each_updates_scale(caplog, several_calls):
    """Overflowing windows inside calls: the skipped updates, the scale and the per-update ``loss_scale`` /
    ``overflow`` / ``skipped_updates`` points as one call per micro-batch logs them."""
    runs = {}
    for calls in (1, 4):
        scale = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**8, scale_window=2))
        runs[calls] = logged_fit(2, 10, 3, calls, caplog, poison_at=(5, 22), plugins=[scale])
        runs[calls]["scaler"] = scale.scaler
    assert set(several_calls) == {4}
    one, several = runs[1], runs[4]
    assert torch.equal(flat(several["model"].net), flat(one["model"].net))
    assert several["points"] == one["points"]
    scales = [point["loss_scale"] for _, point in several["points"] if "loss_scale" in point]
    overflows = [point["overflow"] for _, point in several["points"] if "overflow" in point]
    assert len(set(scales)) >= 3 and 1.0 in overflows and 0.0 in overflows  # the values move within calls
    assert several["scaler"].scale.item() == one["scaler"].scale.item()


def test_max_steps_inside_a_sink_stops_at_the_same_micro_batch(caplog, several_calls):
    runs = {calls: logged_fit(2, 10, 5, calls, caplog, max_steps=7) for calls in (1, 4)}
    assert several_calls and set(several_calls) == {4}
    assert runs[4]["trainer"].global_step == runs[1]["trainer"].global_step == 7
    assert torch.equal(flat(runs[4]["model"].net), flat(runs[1]["model"].net))
    assert runs[4]["points"] == runs[1]["points"]


def test_validation_inside_a_sink_sees_the_same_model(caplog, several_calls):
    """Validation every 3 micro-batches splits each sink of 10 into segments: no call crosses a validation."""

    class Validated(Net):
        def __init__(self) -> None:
            super().__init__("sgd")
            self.seen: list[float] = []

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.seen.append(float(flat(self.net).sum()))

    from torch.utils.data import DataLoader

    runs = {}
    for calls in (1, 2):
        model = Validated()
        trainer = trainer_for(1, 10, 2, calls, val_check_interval=3, limit_val_batches=1)
        caplog.clear()
        with caplog.at_level("INFO"):
            trainer.fit(model, DataLoader(dataset(), batch_size=4), DataLoader(dataset(), batch_size=4))
        runs[calls] = model
    assert several_calls and set(several_calls) == {2}
    assert runs[2].seen == runs[1].seen and len(runs[1].seen) >= 4
    assert torch.equal(flat(runs[2].net), flat(runs[1].net))


@pytest.mark.slow
def test_resume_inside_a_sink_and_a_window_is_bit_for_bit(tmp_path, caplog, several_calls):
    path = tmp_path / "inside.ckpt"
    uninterrupted = Net("adamw", batch_norm=True)
    fit(trainer_for(2, 7, 5, 4, callbacks=[SaveAtEpochEnd(path, 1)]), uninterrupted, dataset(), caplog)
    resumed = Net("sgd", batch_norm=True)  # other weights and optimizer: all come from the checkpoint
    resumed.optimizer_kind = "adamw"
    torch.nn.init.normal_(resumed.net[0].weight)
    trainer = trainer_for(2, 7, 5, 4)
    fit(trainer, resumed, dataset(), caplog, ckpt_path=path)  # after 14 micro-batches, in the second pass
    one = Net("adamw", batch_norm=True)
    fit(trainer_for(2, 7, 5, 1), one, dataset(), caplog)
    assert trainer.global_step == 17
    assert torch.equal(flat(resumed.net), flat(uninterrupted.net))
    assert torch.equal(flat(resumed.net), flat(one.net))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"micro_steps_per_call": 0}, r"micro_steps_per_call=0 is not valid: pass an int >= 1"),
        ({"micro_steps_per_call": True}, r"micro_steps_per_call=True is not valid: pass an int >= 1"),
        ({"micro_steps_per_call": 2.0}, r"micro_steps_per_call=2.0 is not valid: pass an int >= 1"),
        ({"micro_steps_per_call": 4}, r"micro_steps_per_call=4 needs the compiled step programs of sink mode"),
        (
            {"micro_steps_per_call": 4, "graph_mode": "compile"},
            r"graph_mode='compile' and sink_size=None: set graph_mode='compile'",
        ),
        (
            {"micro_steps_per_call": 6, "graph_mode": "compile", "sink_size": 8, "accumulation_steps": 4},
            r"micro_steps_per_call=6 is not valid with accumulation_steps=4: .* pass a multiple of 4",
        ),
    ],
)
def test_micro_steps_per_call_is_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SinkStrategy(**kwargs)


class PaddedSequences(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.head = torch.nn.Embedding(30, 8, padding_idx=0), torch.nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        mask = (tokens != 0).float().unsqueeze(-1)
        pooled = (self.embedding(tokens) * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled), labels)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _padded_loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 12, (48,), generator=generator).tolist()
    items = [(torch.randint(1, 30, (length,), generator=generator), index % 3) for index, length in enumerate(lengths)]

    def pad(batch: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(len(batch), max(len(sequence) for sequence, _ in batch), dtype=torch.long)
        for row, (sequence, _) in enumerate(batch):
            tokens[row, : len(sequence)] = sequence
        return tokens, torch.tensor([label for _, label in batch])

    return torch.utils.data.DataLoader(items, batch_size=4, collate_fn=pad)


def test_batches_of_differing_shapes_run_a_call_each(several_calls):
    """A loader that pads each batch to its longest sequence: a call's batches cannot be stacked, so each runs in a
    call of its own (a call of several had stopped the fit stacking them)."""
    modules = []
    for graph_mode in ("eager", "compile"):
        module = PaddedSequences()
        calls = 6 if graph_mode == "compile" else None
        strategy = SinkStrategy(accumulation_steps=2, sink_size=6, graph_mode=graph_mode, micro_steps_per_call=calls)
        quiet_trainer(strategy=strategy, max_epochs=2).fit(module, _padded_loader())
        modules.append(module)
    assert several_calls == []  # (every call of this fit had batches of differing shapes)
    for (name, eager), (_, compiled) in zip(modules[0].state_dict().items(), modules[1].state_dict().items()):
        assert relative_error(compiled, eager) < 1e-5, name
