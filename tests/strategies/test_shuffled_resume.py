"""A run killed and resumed from a checkpoint ends with the uninterrupted run's parameters, bit for bit, with
shuffled data: a DataLoader with a generator, a DistributedSampler, torchdata's StatefulDataLoader; mid-window,
mid-epoch and epoch-boundary checkpoints; with sink mode off and on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer

DATASET = make_dataset(num_samples=40)  # 10 batches of 4 per pass
STEPS = 3  # windows of 3 micro-batches: window boundaries fall mid-epoch, epoch ends fall mid-window ("carry")
MODES = {
    "no_sink": dict(partial_window="carry", epochs=3),  # Lightning epoch = data pass
    "sink": dict(sink_size=4, epochs=8),  # Lightning epoch = sink of 4 micro-batches, passes run on across sinks
}


class Killed(Exception):
    pass


class SaveThenKill(Callback):
    """Saves a checkpoint after Lightning batch ``at_batch`` (or at the end of epoch ``at_epoch_end``), then dies."""

    def __init__(self, path: Path, at_batch: int | None = None, at_epoch_end: int | None = None):
        self.path, self.at_batch, self.at_epoch_end = path, at_batch, at_epoch_end
        self.window_position: int | None = None

    def _save_and_die(self, trainer):
        trainer.save_checkpoint(self.path)
        self.window_position = trainer.strategy._accumulator.micro_steps
        raise Killed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            self._save_and_die(trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.at_epoch_end:
            self._save_and_die(trainer)


def make_loader(kind: str):
    if kind == "generator":
        return DataLoader(DATASET, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    if kind == "distributed_sampler":
        sampler = DistributedSampler(DATASET, num_replicas=1, rank=0, shuffle=True, seed=7)
        return DataLoader(DATASET, batch_size=4, sampler=sampler)
    if kind == "stateful":
        return StatefulDataLoader(DATASET, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    raise ValueError(kind)


def fit(mode: str, kind: str, model: TinyClassifier, ckpt_path: Path | None = None, callbacks=()):
    settings = MODES[mode]
    strategy = SinkStrategy(
        accumulation_steps=STEPS,
        partial_window=settings.get("partial_window", "scale"),
        sink_size=settings.get("sink_size"),
    )
    trainer = quiet_trainer(strategy=strategy, max_epochs=settings["epochs"], callbacks=list(callbacks))
    trainer.fit(model, make_loader(kind), ckpt_path=ckpt_path)
    return trainer


def flat(model: TinyClassifier) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


_REFERENCES: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}


def uninterrupted(mode: str, kind: str) -> tuple[torch.Tensor, int]:
    if (mode, kind) not in _REFERENCES:
        model = TinyClassifier(lr=0.05)
        trainer = fit(mode, kind, model)
        _REFERENCES[mode, kind] = flat(model), trainer.global_step
    return _REFERENCES[mode, kind]


# Lightning batches are micro-batches without sinks (10 per epoch) and sinks of 4 micro-batches with them.
POINTS = {
    "no_sink": {
        "mid_window_first_epoch": dict(at_batch=4),
        "window_boundary_mid_epoch": dict(at_batch=5),
        "epoch_boundary": dict(at_epoch_end=0),
        "mid_window_later_epoch": dict(at_batch=13),
        "mid_window_third_epoch": dict(at_batch=24),
    },
    "sink": {
        "mid_window_first_pass": dict(at_epoch_end=1),
        "window_boundary_mid_pass": dict(at_epoch_end=2),
        "pass_boundary": dict(at_epoch_end=4),
        "later_pass": dict(at_epoch_end=5),
    },
}
CASES = [(mode, point) for mode in POINTS for point in POINTS[mode]]


@pytest.mark.parametrize("kind", ["generator", "distributed_sampler", "stateful"])
@pytest.mark.parametrize("mode, point", CASES)
def test_killed_and_resumed_run_reaches_the_uninterrupted_parameters(tmp_path, mode, point, kind):
    reference, global_step = uninterrupted(mode, kind)
    killer = SaveThenKill(tmp_path / "last.ckpt", **POINTS[mode][point])
    with pytest.raises(Killed):
        fit(mode, kind, TinyClassifier(lr=0.05), callbacks=[killer])
    if "mid_window" in point:
        assert killer.window_position not in (None, 0), "the checkpoint must be taken inside a window"
    resumed = TinyClassifier(lr=0.05, seed=123)  # a different init: everything must come from the checkpoint
    trainer = fit(mode, kind, resumed, ckpt_path=killer.path)
    assert trainer.global_step == global_step
    assert torch.equal(flat(resumed), reference)


def test_without_the_recorded_generator_state_the_resume_diverges(tmp_path):
    # The control for the test above: what stock Lightning does with a plain loader (its generator restarts from its
    # initial state) gives other parameters, so the shuffled order is what the recorded state reproduces.
    reference, global_step = uninterrupted("no_sink", "generator")
    killer = SaveThenKill(tmp_path / "last.ckpt", at_batch=13)
    with pytest.raises(Killed):
        fit("no_sink", "generator", TinyClassifier(lr=0.05), callbacks=[killer])
    checkpoint = torch.load(killer.path, weights_only=False)
    del checkpoint["lightning_sink"]["data"]["pass_start_generators"]
    del checkpoint["lightning_sink"]["tensor_digests"]  # (a tensor removed: as a checkpoint written before both)
    torch.save(checkpoint, tmp_path / "without.ckpt")
    resumed = TinyClassifier(lr=0.05)
    trainer = fit("no_sink", "generator", resumed, ckpt_path=tmp_path / "without.ckpt")
    assert trainer.global_step == global_step
    assert not torch.equal(flat(resumed), reference)


def test_a_strategy_can_be_deep_copied_as_lightning_copies_loops():
    import copy

    from lightning_sink import SinkStrategy

    strategy = SinkStrategy(accumulation_steps=2)
    strategy._data_position.advance(3)
    copied = copy.deepcopy(strategy)
    assert copied._data_position.state_dict() == strategy._data_position.state_dict()
    copied._data_position.next_pass()  # its lock works
