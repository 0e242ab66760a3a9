"""Bad arguments and bad combinations raise clear errors that name the argument, the value and what is valid."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_sink import SinkDDPStrategy, SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer


@pytest.mark.parametrize("bad", [0, -3, 2.0, "4", True])
@pytest.mark.parametrize("strategy_cls", [SinkStrategy, SinkDDPStrategy])
def test_accumulation_steps_must_be_a_positive_int(strategy_cls, bad):
    with pytest.raises(ValueError, match=rf"accumulation_steps={bad!r} is not valid: pass an int >= 1"):
        strategy_cls(accumulation_steps=bad)


def test_partial_window_must_be_known():
    with pytest.raises(
        ValueError, match=r"partial_window='sometimes' is not valid: choose one of 'scale', 'drop', 'carry'"
    ):
        SinkStrategy(accumulation_steps=2, partial_window="sometimes")


def test_conflicting_trainer_accumulation_is_an_error():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4), accumulate_grad_batches=2, max_epochs=1)
    with pytest.raises(ValueError, match=r"accumulation_steps=4\) conflicts with Trainer\(accumulate_grad_batches=2\)"):
        trainer.fit(TinyClassifier(), loader(make_dataset(), 4))


class ManualModule(TinyClassifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = torch.nn.functional.cross_entropy(self(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_with_accumulation_says_what_to_do():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4), max_epochs=1)
    with pytest.raises(ValueError, match=r"automatic_optimization = False.*manual_backward"):
        trainer.fit(ManualModule(), loader(make_dataset(), 4))


def test_manual_optimization_with_sinks_says_what_to_do():
    # (a sink would otherwise be ignored without a word: the epochs whole passes, not sinks)
    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=8), max_epochs=1)
    with pytest.raises(
        ValueError, match=r"SinkStrategy\(sink_size=8\).*automatic_optimization = False.*remove sink_size"
    ):
        trainer.fit(ManualModule(), loader(make_dataset(), 4))


def test_manual_optimization_without_accumulation_runs_as_stock_lightning():
    model = ManualModule()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = quiet_trainer(strategy=SinkStrategy(), max_epochs=1)
    trainer.fit(model, loader(make_dataset(num_samples=16), 4))
    assert trainer.global_step == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device must exist (else refused at construction)")
def test_device_that_does_not_match_the_accelerator():
    # Lightning's accelerator connector sees the strategy's device and refuses at construction.
    with pytest.raises(
        MisconfigurationException, match=r"GPU parallel_devices set through SinkStrategy.*accelerator set to cpu"
    ):
        quiet_trainer(strategy=SinkStrategy(accumulation_steps=2, device="cuda:0"), max_epochs=1)


def test_single_device_strategy_refuses_several_devices():
    with pytest.raises(ValueError, match=r"SinkStrategy runs on one device but the Trainer asks for 2.*sink_ddp"):
        quiet_trainer(strategy="sink", devices=2)


def test_a_cuda_device_on_a_machine_without_one_is_refused_at_construction():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ValueError, match=r"device='cuda:0' is not valid: this machine has no 'cuda' device"):
        SinkStrategy(accumulation_steps=2, device="cuda:0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="without CUDA nccl is refused at construction")
def test_nccl_on_cpu_is_an_error():
    strategy = SinkDDPStrategy(accumulation_steps=2, process_group_backend="nccl")
    trainer = quiet_trainer(strategy=strategy, devices=1, max_epochs=1)
    with pytest.raises(ValueError, match=r"process_group_backend='nccl'\) needs CUDA devices.*gloo"):
        trainer.fit(TinyClassifier(), loader(make_dataset(), 4))


def test_drop_that_would_drop_everything():
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=8, partial_window="drop"), max_epochs=1)
    with pytest.raises(ValueError, match=r"partial_window='drop' with accumulation_steps=8 drops every batch.*only 5"):
        trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=20), 4))


class Returns(TinyClassifier):
    def __init__(self, output):
        super().__init__()
        self.output = output

    def training_step(self, batch, batch_idx):
        return self.output


def raised_by(strategy, output) -> BaseException:
    trainer = quiet_trainer(strategy=strategy, max_epochs=1)
    with pytest.raises(Exception) as info:
        trainer.fit(Returns(output), loader(make_dataset(), 4))
    return info.value


@pytest.mark.parametrize(
    ("output", "stock_type"),
    [
        (5.0, MisconfigurationException),
        ({"accuracy": torch.tensor(1.0)}, MisconfigurationException),
        ({"loss": None}, MisconfigurationException),
        ({"loss": 5.0}, AttributeError),  # Lightning's closure result calls .detach() on it
    ],
    ids=["float", "no-loss-key", "loss-none", "loss-float"],
)
def test_training_step_without_a_tensor_loss_raises_as_stock(output, stock_type):
    stock = raised_by("auto", output)
    assert type(stock) is stock_type
    for strategy in (
        SinkStrategy(),
        SinkStrategy(accumulation_steps=2),
        SinkStrategy(accumulation_steps=2, sink_size=4),
    ):
        sink = raised_by(strategy, output)
        assert (type(sink), str(sink)) == (type(stock), str(stock)), strategy


def test_resume_with_a_different_model_names_the_problem(tmp_path):
    from tests.strategies.test_sink_strategy import SaveAtBatch

    ckpt = tmp_path / "mid.ckpt"
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4), max_epochs=1, callbacks=[SaveAtBatch(ckpt, 1)])
    trainer.fit(TinyClassifier(), loader(make_dataset(), 4))
    checkpoint = torch.load(ckpt, weights_only=False)
    checkpoint["lightning_sink"]["version"] = 99
    torch.save(checkpoint, tmp_path / "future.ckpt")
    resumed = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4), max_epochs=1)
    with pytest.raises(ValueError, match=r"future.ckpt: 'lightning_sink' state has version 99"):
        resumed.fit(TinyClassifier(), loader(make_dataset(), 4), ckpt_path=tmp_path / "future.ckpt")
