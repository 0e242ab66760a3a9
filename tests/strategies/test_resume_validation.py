"""A training checkpoint's ``lightning_sink`` state is checked on resume: a real checkpoint, edited as someone could
(``torch.load(weights_only=True)`` / ``torch.save``, no pickled code), is refused in one line naming the file and
the field, before training starts."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

DATASET = make_dataset(num_samples=40)  # 10 batches of 4
STEPS = 4


class SaveAt(Callback):
    def __init__(self, path, at_batch=None, at_epoch_end=None):
        self.path, self.at_batch, self.at_epoch_end = path, at_batch, at_epoch_end

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == self.at_batch:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.at_epoch_end:
            trainer.save_checkpoint(self.path)


def saved_checkpoint(tmp_path, model=None, epochs=1, strategy_kwargs=None, **where):
    path = tmp_path / "saved.ckpt"
    strategy = SinkStrategy(**(strategy_kwargs or dict(accumulation_steps=STEPS)))
    quiet_trainer(strategy=strategy, max_epochs=epochs, callbacks=[SaveAt(path, **where)]).fit(
        model or TinyClassifier(), loader(DATASET, 4)
    )
    return path


def edit(path, change):
    """The edit of someone who also drops the tensor digests (``test_checkpoint_digests.py`` refuses changed tensors):
    the fields are checked on their own, as in a checkpoint saved with ``checkpoint_digests=False``."""
    checkpoint = torch.load(path, weights_only=True)
    del checkpoint["lightning_sink"]["tensor_digests"]
    change(checkpoint["lightning_sink"], checkpoint)
    torch.save(checkpoint, path)


def resume(path, strategy_kwargs=None, model=None, epochs=1):
    trainer = quiet_trainer(
        strategy=SinkStrategy(**(strategy_kwargs or dict(accumulation_steps=STEPS))), max_epochs=epochs
    )
    trainer.fit(model or TinyClassifier(), loader(DATASET, 4), ckpt_path=path)
    return trainer


def setter(section, name, value):
    def change(state, checkpoint):
        (state if section is None else state[section])[name] = value

    return change


def remover(section, name):
    def change(state, checkpoint):
        del (state if section is None else state[section])[name]

    return change


def both_counts(value):
    def change(state, checkpoint):
        state["window"]["micro_steps"] = state["window"]["micro_batches"] = value

    return change


def replace_state(value):
    def change(state, checkpoint):
        checkpoint["lightning_sink"] = value

    return change


MID_WINDOW_EDITS = [
    # (the edit, the field named, what is said of it)
    (setter("window", "micro_steps", 7), "window.micro_steps", r"is 7, expected at most window.micro_batches=2"),
    (setter("window", "micro_steps", -1), "window.micro_steps", r"is -1, expected an int >= 0"),
    (setter("window", "micro_steps", 2.0), "window.micro_steps", r"is 2.0, expected an int >= 0"),
    (setter("window", "micro_batches", 7), "window.micro_batches", r"is 7, expected an int in \[0, 4\]"),
    (both_counts(4), "window.micro_steps", r"is 4, expected an int in \[0, 3\] \(a window of accumulation_steps=4"),
    (setter("data", "trained_in_pass", -5), "data.trained_in_pass", r"is -5, expected an int >= 0"),
    (
        setter("data", "trained_in_pass", 10**12),
        "data.trained_in_pass",
        r"is 1000000000000, expected an int in \[0, 10\]",
    ),
    (setter("data", "trained_in_pass", "2"), "data.trained_in_pass", r"is '2', expected an int >= 0"),
    (remover(None, "data"), "data", r"is missing, expected a dict"),
    (remover("data", "trained_in_pass"), "data.trained_in_pass", r"is missing"),
    (remover("window", "buffers"), "window.buffers", r"is None, expected saved partial sums"),
    (
        setter("window", "buffers", [torch.zeros(3, dtype=torch.int64)]),
        "window.buffers",
        r"is a list, expected None or",
    ),
    (setter("window", "buffers", "x"), "window.buffers", r"is 'x', expected None or a list"),
    (setter("window", "drop", 1), "window.drop", r"is 1, expected a bool"),
    (setter("window", "reached", [True, "yes"]), "window.reached", r"is a list, expected a list of bools"),
    (setter(None, "window", 5), "window", r"is 5, expected None or a dict"),
    (setter(None, "accumulation_steps", 0), "accumulation_steps", r"is 0, expected an int >= 1"),
    (setter("data", "trained_in_sink", -1), "data.trained_in_sink", r"is -1, expected an int >= 0"),
    (setter("data", "trained_total", "9"), "data.trained_total", r"is '9', expected an int >= 0"),
    (setter(None, "random", "x"), "random", r"is 'x', expected a list of each rank's random state"),
    (replace_state([1, 2]), "the state", r"is a list, expected a dict"),
]


@pytest.fixture(scope="module")
def mid_window_checkpoint(tmp_path_factory):
    # after 2 of the 4 micro-batches of the first window: an open window, 2 batches of the pass trained
    path = saved_checkpoint(tmp_path_factory.mktemp("mid_window"), at_batch=1)
    state = torch.load(path, weights_only=True)["lightning_sink"]
    assert state["window"]["micro_steps"] == state["window"]["micro_batches"] == 2
    assert state["data"]["trained_in_pass"] == 2
    return path.read_bytes()


@pytest.mark.parametrize(("change", "field", "said"), MID_WINDOW_EDITS)
def test_an_edited_state_is_refused_naming_the_file_and_the_field(tmp_path, mid_window_checkpoint, change, field, said):
    path = tmp_path / "saved.ckpt"
    path.write_bytes(mid_window_checkpoint)
    edit(path, change)
    message = rf"saved.ckpt: the checkpoint's 'lightning_sink' state is not valid: {field} {said}"
    with pytest.raises(ValueError, match=message):
        resume(path)


def test_the_unedited_checkpoint_resumes_through_the_same_round_trip(tmp_path, mid_window_checkpoint):
    # the edit harness itself (load and save again) changes nothing a resume checks
    path = tmp_path / "saved.ckpt"
    path.write_bytes(mid_window_checkpoint)
    edit(path, lambda state, checkpoint: None)
    assert resume(path).global_step == 3  # 10 batches in windows of 4: 4, 4, and the last 2 scaled


@pytest.mark.parametrize(("trained", "said"), [(-5, r"an int >= 0"), (10**12, r"an int in \[0, 10\]")])
def test_a_sink_mode_data_position_outside_the_pass_is_refused(tmp_path, trained, said):
    kwargs = dict(accumulation_steps=2, sink_size=4)
    path = saved_checkpoint(tmp_path, strategy_kwargs=kwargs, at_epoch_end=0)
    assert torch.load(path, weights_only=True)["lightning_sink"]["data"]["trained_in_pass"] == 4
    edit(path, setter("data", "trained_in_pass", trained))
    message = rf"saved.ckpt: the checkpoint's 'lightning_sink' state is not valid: data.trained_in_pass is {trained}"
    with pytest.raises(ValueError, match=rf"{message}, expected {said}"):
        resume(path, kwargs, epochs=3)


class NoneAtFirst(TinyClassifier):
    """Its first two micro-batches return None: they belong to the window but add no gradient."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if self.trainer.fit_loop.total_batch_idx < 2 else loss


def test_a_window_of_none_returning_micro_batches_is_open_on_resume(tmp_path):
    path = saved_checkpoint(tmp_path, model=NoneAtFirst(), at_batch=1)
    window = torch.load(path, weights_only=True)["lightning_sink"]["window"]
    assert (window["micro_batches"], window["micro_steps"]) == (2, 0)  # open, without a backward pass
    message = (
        r"saved.ckpt: the checkpoint was saved inside an accumulation window \(2 micro-steps done\) with"
        r" accumulation_steps=4, but this run has accumulation_steps=2"
    )
    with pytest.raises(ValueError, match=message):
        resume(path, dict(accumulation_steps=2), model=NoneAtFirst())


def test_a_window_of_none_returning_micro_batches_is_checked_against_the_window_length(tmp_path):
    path = saved_checkpoint(tmp_path, model=NoneAtFirst(), at_batch=1)
    edit(path, setter("window", "micro_batches", 5))
    with pytest.raises(ValueError, match=r"saved.ckpt: .* window.micro_batches is 5, expected an int in \[0, 4\]"):
        resume(path, model=NoneAtFirst())


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"version": 1, "window": 5, "data": {"trained_in_pass": 0}}, "window"),
        ({"version": 1, "window": {"micro_steps": "2"}, "data": {"trained_in_pass": 0}}, "window.micro_steps"),
        ({"version": 1, "window": None, "data": {"trained_in_pass": "x"}}, "data.trained_in_pass"),
        ({"version": 1, "window": None, "data": 3}, "data"),
        ([1], "the state"),
    ],
)
def test_a_malformed_state_of_a_resharded_checkpoint_is_named(state, field):
    # a resharded checkpoint's state is adapted to the new mesh first: a malformed one reaches the check unchanged
    from pathlib import Path

    from lightning_sink.checkpoint_format.resharded_load import adapt_sink_state
    from lightning_sink.strategies.checkpoint_state import read_sink_state

    adapted = adapt_sink_state(state, Path("rank_0.pt"), sink_mode=True)
    with pytest.raises(ValueError, match=rf"rank_0.pt: the checkpoint's 'lightning_sink' state is not valid: {field} "):
        read_sink_state({"lightning_sink": adapted}, Path("rank_0.pt"))
