"""A training checkpoint's counters and random states within what a run can produce, and a ``.ckpt`` that cannot be
read: each refused in one line naming the file (and the field), before training starts. The checkpoints are real
ones, edited as someone could (``torch.load(weights_only=True)`` / ``torch.save``), or cut short."""

from __future__ import annotations

import pytest
import torch

from tests.strategies.test_resume_validation import edit, resume, saved_checkpoint, setter

SINK = dict(accumulation_steps=2, sink_size=4)


def top(name, value):
    def change(state, checkpoint):
        checkpoint[name] = value

    return change


def loop_steps(value):
    """The step count Lightning restores ``global_step`` from, and the top-level copy, both edited."""

    def change(state, checkpoint):
        fit_loop = checkpoint["loops"]["fit_loop"]
        fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] = value
        checkpoint["global_step"] = value

    return change


def random_state(change_rank_state):
    def change(state, checkpoint):
        change_rank_state(state["random"][0])

    return change


def python_gauss(value):
    return random_state(lambda rank: rank["python"].__setitem__("gauss_next", value))


def torch_state_of_zeros():
    return random_state(lambda rank: rank.__setitem__("torch", torch.zeros_like(rank["torch"])))


def numpy_cached_gaussian(value):
    return random_state(lambda rank: rank["numpy"].__setitem__("cached_gaussian", value))


STATE = r"the checkpoint's 'lightning_sink' state is not valid: "
RANDOM = r"the checkpoint's random state is not valid: "
EDITS = [
    # (the edit, what the error says after the file name)
    (setter("data", "pass_index", 10**12), STATE + r"data.pass_index is 1000000000000, expected an int in \[0, 1\]"),
    (
        top("global_step", -1),
        r"the checkpoint is not valid: global_step is -1, expected an int in \[0, 9223372036854775807\]",
    ),
    (
        top("global_step", 10**18),
        r"the checkpoint is not valid: global_step is 1000000000000000000, expected 0 \(the optimizer steps its loop",
    ),
    (
        loop_steps(10**18),
        r"the checkpoint is not valid: global_step is 1000000000000000000, expected an int in \[0, 10\] \(at most one",
    ),
    (top("epoch", -3), r"the checkpoint is not valid: epoch is -3, expected an int in \[0, 9223372036854775807\]"),
    (python_gauss(float("nan")), RANDOM + r"'python' is not Python's random state \(version, 625 words, a finite"),
    (torch_state_of_zeros(), RANDOM + r"'torch' is not a valid MT19937 state of torch's CPU generator"),
    (numpy_cached_gaussian(float("inf")), RANDOM + r"'numpy' is not NumPy's MT19937 state .* a finite cached_gaussian"),
]


@pytest.fixture(scope="module")
def mid_window_checkpoint(tmp_path_factory):
    return saved_checkpoint(tmp_path_factory.mktemp("mid_window"), at_batch=1).read_bytes()


@pytest.mark.parametrize(("change", "said"), EDITS)
def test_a_counter_or_random_state_no_run_produces_is_refused_naming_file_and_field(
    tmp_path, mid_window_checkpoint, change, said
):
    path = tmp_path / "saved.ckpt"
    path.write_bytes(mid_window_checkpoint)
    edit(path, change)
    with pytest.raises(ValueError, match=rf"^{path}: {said}"):
        resume(path)


def test_a_saved_sink_size_that_its_own_sink_contradicts_is_refused(tmp_path):
    path = saved_checkpoint(tmp_path, strategy_kwargs=SINK, at_epoch_end=0)
    data = torch.load(path, weights_only=True)["lightning_sink"]["data"]
    assert (data["trained_in_sink"], data["sink_open"]) == (4, False)  # a sink of 4, ended
    edit(path, setter(None, "sink_size", 10**9))
    message = rf"^{path}: {STATE}sink_size is 1000000000, expected 4 \(data.trained_in_sink=4 with data.sink_open=False"
    with pytest.raises(ValueError, match=message):
        resume(path, SINK, epochs=3)


def test_a_sink_mode_pass_index_beyond_the_micro_batches_trained_is_refused(tmp_path):
    path = saved_checkpoint(tmp_path, strategy_kwargs=SINK, at_epoch_end=0)
    edit(path, setter("data", "pass_index", 10**12))
    with pytest.raises(
        ValueError, match=rf"^{path}: {STATE}data.pass_index is 1000000000000, expected an int in \[0, 1\]"
    ):
        resume(path, SINK, epochs=3)


@pytest.mark.parametrize("keep", [0, 100, 0.5, -100])
def test_an_empty_or_truncated_ckpt_is_one_line_naming_the_file(tmp_path, mid_window_checkpoint, keep):
    whole = mid_window_checkpoint
    size = int(len(whole) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(whole) + keep)
    path = tmp_path / "cut.ckpt"
    path.write_bytes(whole[:size])
    with pytest.raises(ValueError) as caught:
        resume(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {str(path)!r} could not be read: ") and "\n" not in message, message


def test_a_sink_mode_step_count_beyond_one_update_per_micro_batch_is_refused(tmp_path):
    path = saved_checkpoint(tmp_path, strategy_kwargs=SINK, at_epoch_end=0)
    edit(path, loop_steps(10**6))
    message = rf"^{path}: the checkpoint is not valid: global_step is 1000000, expected an int in \[0, \d+\] \(at most"
    with pytest.raises(ValueError, match=message):
        resume(path, SINK, epochs=3)
