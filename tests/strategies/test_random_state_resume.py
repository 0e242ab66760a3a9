"""A run that draws random numbers in its step (dropout on torch's CPU generator, and Python's and NumPy's global
generators) resumes from a checkpoint to the uninterrupted run's parameters, bit for bit, in and out of sink mode:
the sink strategies save every global generator's state and restore it at train start (beyond stock Lightning,
which does not). Old checkpoints without that state still load."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from tests.helpers import quiet_trainer

SAMPLES, BATCH, STEPS = 24, 4, 3  # 6 micro-batches per pass, windows of 3


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(SAMPLES, 8, generator=generator), torch.randint(0, 4, (SAMPLES,), generator=generator)
    )
    return DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))


class RandomStep(pl.LightningModule):
    """Dropout (torch's CPU generator), and a loss weight from Python's and NumPy's generators, in every step."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        weight = 1.0 + random.random() + float(np.random.rand())
        return F.cross_entropy(self.net(x), y) * weight

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Killed(Exception):
    pass


class SaveThenKill(Callback):
    """Saves after Lightning batch ``at_batch`` (a micro-batch without sinks, a sink with them), then dies; the
    generators then draw on (as a killed process's would have) so that only the checkpoint can restore them."""

    def __init__(self, path: Path, at_batch: int) -> None:
        self.path, self.at_batch = path, at_batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            trainer.save_checkpoint(self.path)
            torch.rand(100), random.random(), np.random.rand()
            raise Killed


MODES = {
    "no_sink": dict(sink_size=None, max_epochs=3),  # 18 micro-batches, an epoch per pass
    "sink": dict(sink_size=4, max_epochs=4),  # 16 micro-batches in sinks of 4 (passes run on across sinks)
}


def fit(mode: str, module: RandomStep, ckpt_path: Path | None = None, callbacks=(), **strategy_args: Any):
    settings = MODES[mode]
    if settings["sink_size"] is None:  # windows run on across epochs, as they do across sinks
        strategy = SinkStrategy(accumulation_steps=STEPS, partial_window="carry", **strategy_args)
    else:
        strategy = SinkStrategy(accumulation_steps=STEPS, sink_size=settings["sink_size"], **strategy_args)
    trainer = quiet_trainer(strategy=strategy, max_epochs=settings["max_epochs"], callbacks=list(callbacks))
    trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
    return trainer


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def uninterrupted(mode: str) -> tuple[torch.Tensor, int]:
    module = RandomStep()
    seed_all(1)
    trainer = fit(mode, module)
    return flat(module), trainer.global_step


def killed_and_resumed(mode: str, tmp_path: Path, at_batch: int, **strategy_args: Any) -> tuple[torch.Tensor, int]:
    module = RandomStep()
    seed_all(1)
    killer = SaveThenKill(tmp_path / "killed.ckpt", at_batch)
    with pytest.raises(Killed):
        fit(mode, module, callbacks=[killer], **strategy_args)
    seed_all(99)  # a new process: other seeds, other init; everything must come from the checkpoint
    resumed = RandomStep(seed=5)
    trainer = fit(mode, resumed, ckpt_path=killer.path, **strategy_args)
    return flat(resumed), trainer.global_step


# without sinks: mid-window in the first pass, at a window boundary mid-pass, at a pass end mid-window (batch 5);
# with sinks: after the first sink (mid-window, mid-pass) and after the second (a pass ended inside it)
POINTS = [("no_sink", 1), ("no_sink", 8), ("no_sink", 5), ("sink", 0), ("sink", 1)]


@pytest.mark.parametrize("mode, at_batch", POINTS)
def test_a_run_with_dropout_resumes_bit_identical(tmp_path, mode, at_batch):
    expected, global_step = uninterrupted(mode)
    resumed, resumed_step = killed_and_resumed(mode, tmp_path, at_batch)
    assert resumed_step == global_step
    assert torch.equal(resumed, expected)


def test_a_max_steps_stop_inside_a_sink_resumes_bit_identical(tmp_path):
    """Stopped by max_steps inside a sink (2 updates = 6 micro-batches, in the second sink of 4), saved after the
    fit, resumed to 5 updates: the uninterrupted run's parameters."""

    def sink_fit(module: RandomStep, max_steps: int, ckpt_path: Path | None = None) -> pl.Trainer:
        strategy = SinkStrategy(accumulation_steps=STEPS, sink_size=4)
        trainer = quiet_trainer(strategy=strategy, max_epochs=-1, max_steps=max_steps)
        trainer.fit(module, make_loader(), ckpt_path=ckpt_path)
        return trainer

    expected = RandomStep()
    seed_all(1)
    sink_fit(expected, max_steps=5)
    stopped = RandomStep()
    seed_all(1)
    sink_fit(stopped, max_steps=2).save_checkpoint(tmp_path / "stopped.ckpt")
    seed_all(99)
    resumed = RandomStep(seed=5)
    trainer = sink_fit(resumed, max_steps=5, ckpt_path=tmp_path / "stopped.ckpt")
    assert trainer.global_step == 5
    assert torch.equal(flat(resumed), flat(expected))


def test_without_the_random_state_the_resume_draws_other_numbers(tmp_path):
    """The opt-out: the checkpoint holds no generator state, so the resumed dropout masks differ."""
    expected, _ = uninterrupted("no_sink")
    resumed, _ = killed_and_resumed("no_sink", tmp_path, 8, checkpoint_random_state=False)
    assert "random" not in torch.load(tmp_path / "killed.ckpt", weights_only=True)["lightning_sink"]
    assert not torch.equal(resumed, expected)


def test_the_checkpoint_holds_each_generator_and_loads_with_weights_only(tmp_path):
    module = RandomStep()
    killer = SaveThenKill(tmp_path / "killed.ckpt", 2)
    seed_all(3)
    with pytest.raises(Killed):
        fit("no_sink", module, callbacks=[killer])
    state = torch.load(killer.path, weights_only=True)["lightning_sink"]["random"]
    assert len(state) == 1  # one rank
    assert set(state[0]) >= {"torch", "python", "numpy"}
    assert state[0]["torch"].dtype == torch.uint8


def test_a_checkpoint_without_random_state_still_loads(tmp_path):
    """Checkpoints written before the random state was saved resume as they did: the generators run on."""
    module = RandomStep()
    seed_all(1)
    killer = SaveThenKill(tmp_path / "killed.ckpt", 8)
    with pytest.raises(Killed):
        fit("no_sink", module, callbacks=[killer])
    checkpoint = torch.load(killer.path, weights_only=True)
    del checkpoint["lightning_sink"]["random"]
    del checkpoint["lightning_sink"]["tensor_digests"]  # a checkpoint written before both
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    torch.manual_seed(42)
    before = torch.get_rng_state()
    resumed = RandomStep(seed=5)
    torch.set_rng_state(before)
    trainer = fit("no_sink", resumed, ckpt_path=old)
    assert trainer.global_step == 6


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("torch", torch.zeros(3, dtype=torch.uint8), "'torch'"),
        ("python", {"version": 3, "internal": torch.zeros(5, dtype=torch.int64), "gauss_next": None}, "'python'"),
        ("numpy", {"keys": "nonsense"}, "'numpy'"),
        ("cuda", [torch.zeros(2)], "'cuda'"),
    ],
)
def test_a_bad_random_state_is_refused_naming_the_file_and_field(tmp_path, field, value, named):
    module = RandomStep()
    killer = SaveThenKill(tmp_path / "killed.ckpt", 2)
    with pytest.raises(Killed):
        fit("no_sink", module, callbacks=[killer])
    checkpoint = torch.load(killer.path, weights_only=True)
    checkpoint["lightning_sink"]["random"][0][field] = value
    del checkpoint["lightning_sink"]["tensor_digests"]  # crafted: its maker leaves out the digests that would refuse it
    bad = tmp_path / "bad.ckpt"
    torch.save(checkpoint, bad)
    with pytest.raises(ValueError, match=rf"bad\.ckpt: the checkpoint's random state is not valid: {named}"):
        fit("no_sink", RandomStep(), ckpt_path=bad)


def test_a_checkpoint_of_another_world_size_leaves_the_generators_and_says_so(tmp_path):
    module = RandomStep()
    killer = SaveThenKill(tmp_path / "killed.ckpt", 2)
    with pytest.raises(Killed):
        fit("no_sink", module, callbacks=[killer])
    checkpoint = torch.load(killer.path, weights_only=True)
    checkpoint["lightning_sink"]["random"] *= 2  # as if saved by two ranks
    del checkpoint["lightning_sink"]["tensor_digests"]  # (edited: the digests would refuse the added tensors)
    two = tmp_path / "two.ckpt"
    torch.save(checkpoint, two)
    with pytest.warns(UserWarning, match="saved by 2 rank"):
        fit("no_sink", RandomStep(), ckpt_path=two)


def test_the_argument_is_checked_at_construction():
    with pytest.raises(TypeError, match=r"checkpoint_random_state='no' is not valid: pass True .* or False"):
        SinkStrategy(checkpoint_random_state="no")
