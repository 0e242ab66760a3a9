"""The training data on resume and per epoch, side by side with stock Lightning.

The sink strategies resume a loader whose order a second pass reproduces by skipping the batches already trained
(``test_shuffled_resume.py``). Any other loader is Lightning's: it restores one with ``state_dict`` and replays any
other from its first batch with a warning; the sink strategies must see the same batches and warnings. The
sampler's ``set_epoch`` calls are Lightning's too.
"""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any
from unittest.mock import Mock, call

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.callbacks import Callback
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, make_dataset, quiet_trainer

SAMPLES, MICRO = 32, 4
NOT_RESUMABLE = "resuming from a checkpoint that ended before the epoch ended"


class SeenBatches(TinyClassifier):
    """Records the tag of every training batch (which batch it is); the tag modulo 4 is the label."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, tag = batch
        self.seen.append(int(tag[0]))
        return F.cross_entropy(self(x), tag % 4)


class SaveAt(Callback):
    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


INPUTS = make_dataset(num_samples=SAMPLES).tensors[0]


class Indexed(torch.utils.data.Dataset):
    """The samples of batch ``i`` (in order) are tagged ``i``, so a batch names itself."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return INPUTS[index], torch.tensor(index // MICRO)


class CustomIterable:
    """Not a DataLoader: Lightning cannot know whether a second pass repeats the first."""

    def __init__(self) -> None:
        self.start = 0

    def __iter__(self):
        for i in range(self.start, len(self)):
            yield INPUTS[i * MICRO : (i + 1) * MICRO], torch.full((MICRO,), i)

    def __len__(self) -> int:
        return SAMPLES // MICRO


class StatefulIterable(CustomIterable):
    """Lightning saves and restores its position itself."""

    def __init__(self) -> None:
        super().__init__()
        self.position = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.position = int(batch[1][0]) + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"start": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["start"]


def make_data(kind: str) -> Any:
    if kind == "shuffled_without_generator":
        return DataLoader(Indexed(), batch_size=MICRO, shuffle=True)
    return {"custom_iterable": CustomIterable, "stateful_iterable": StatefulIterable}[kind]()


def resumed_run(strategy_factory, kind: str, tmp_path: Path) -> tuple[list[int], list[str]]:
    """Fit one epoch, saving after batch 3; resume a fresh run from it: the batches the resumed run trains and its
    warnings about resuming."""
    path = tmp_path / "mid.ckpt"
    torch.manual_seed(1)
    first = quiet_trainer(strategy=strategy_factory(), max_epochs=1, callbacks=[SaveAt(path, 3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(SeenBatches(), make_data(kind))
    torch.manual_seed(2)
    model = SeenBatches()
    resumed = quiet_trainer(strategy=strategy_factory(), max_epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(model, make_data(kind), ckpt_path=path)
    return model.seen, [str(w.message) for w in caught if NOT_RESUMABLE in str(w.message)]


@pytest.mark.parametrize("kind", ["custom_iterable", "stateful_iterable", "shuffled_without_generator"])
def test_a_loader_without_a_reproducible_order_resumes_as_with_stock(kind, tmp_path):
    stock = resumed_run(lambda: "auto", kind, tmp_path / "stock")
    assert len(stock[0]) == SAMPLES // MICRO - 4  # Lightning ends the epoch where the interrupted one would have
    assert bool(stock[1]) == (kind != "stateful_iterable")
    for steps in (1, 2):
        # Without the global generators restored, as stock: the same batches (a new shuffle from the new seed).
        no_random_state = partial(SinkStrategy, accumulation_steps=steps, checkpoint_random_state=False)
        sink = resumed_run(no_random_state, kind, tmp_path / f"sink{steps}")
        assert sink == stock, steps
    # With them (the default) the new shuffle is drawn from the checkpoint's generator instead: as many batches, the
    # same warning.
    seen, warned = resumed_run(partial(SinkStrategy, accumulation_steps=2), kind, tmp_path / "sink_random_state")
    assert len(seen) == len(stock[0]) and bool(warned) == bool(stock[1])


def test_the_not_resumable_warning_is_ignored_only_for_the_resume_the_strategy_makes(tmp_path):
    """A sequential DataLoader is resumed exactly (no warning, the untrained batches); a later resume of a loader
    that is not gets Lightning's warning in the same process."""
    path = tmp_path / "mid.ckpt"
    data = lambda: DataLoader(Indexed(), batch_size=MICRO)  # noqa: E731
    first = quiet_trainer(strategy=SinkStrategy(), max_epochs=1, callbacks=[SaveAt(path, 3)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(SeenBatches(), data())
    model = SeenBatches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(strategy=SinkStrategy(), max_epochs=1).fit(model, data(), ckpt_path=path)
    assert model.seen == [4, 5, 6, 7]
    assert not [w for w in caught if NOT_RESUMABLE in str(w.message)]
    with pytest.warns(PossibleUserWarning, match=NOT_RESUMABLE):
        model = SeenBatches()
        quiet_trainer(strategy=SinkStrategy(), max_epochs=1).fit(model, CustomIterable(), ckpt_path=path)


def sampler_calls(strategy: Any, batch_sampler: bool) -> list:
    """Lightning's set_epoch calls on the training sampler over two epochs of one batch each."""
    sampler = RandomSampler(Indexed(), generator=torch.Generator().manual_seed(0))
    sampler.set_epoch = Mock()
    if batch_sampler:
        data = DataLoader(Indexed(), batch_sampler=BatchSampler(sampler, MICRO, drop_last=True))
    else:
        data = DataLoader(Indexed(), batch_size=MICRO, sampler=sampler)
    trainer = quiet_trainer(strategy=strategy, max_epochs=2, limit_train_batches=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(SeenBatches(), data)
    return sampler.set_epoch.mock_calls


@pytest.mark.parametrize("batch_sampler", [False, True])
def test_the_samplers_set_epoch_calls_are_stocks(batch_sampler):
    stock = sampler_calls("auto", batch_sampler)
    assert stock == [call(0), call(1)]
    assert sampler_calls(SinkStrategy(), batch_sampler) == stock
    assert sampler_calls(SinkStrategy(accumulation_steps=2), batch_sampler) == stock


class TwoBatchesPerStep(SeenBatches):
    """``training_step(dataloader_iter)`` that draws two batches per step: a step is not one batch."""

    def training_step(self, dataloader_iter: Any) -> torch.Tensor:
        losses = []
        for _ in range(2):
            (x, tag), _, _ = next(dataloader_iter)
            self.seen.append(int(tag[0]))
            losses.append(F.cross_entropy(self(x), tag % 4))
        return sum(losses)


def dataloader_iter_resume(strategy: Any, tmp_path: Path) -> tuple[list[int], int]:
    """Fit one epoch (saved at its end), resume to two: the batches of the resumed epoch and the global step."""
    path = tmp_path / "epoch.ckpt"

    class SaveAtEpochEnd(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            trainer.save_checkpoint(path)

    first = quiet_trainer(strategy=strategy(), max_epochs=1, callbacks=[SaveAtEpochEnd()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first.fit(TwoBatchesPerStep(), DataLoader(Indexed(), batch_size=MICRO))
        model = TwoBatchesPerStep()
        resumed = quiet_trainer(strategy=strategy(), max_epochs=2)
        resumed.fit(model, DataLoader(Indexed(), batch_size=MICRO), ckpt_path=path)
    return model.seen, resumed.global_step


def test_a_training_step_that_draws_its_own_batches_resumes_as_with_stock(tmp_path):
    stock = dataloader_iter_resume(lambda: "auto", tmp_path / "stock")
    assert stock == (list(range(SAMPLES // MICRO)), SAMPLES // MICRO)  # the whole second epoch, 4 + 4 steps
    assert dataloader_iter_resume(SinkStrategy, tmp_path / "sink") == stock
