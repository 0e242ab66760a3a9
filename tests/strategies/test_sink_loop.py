"""Sink mode (sink_size=K) against a plain PyTorch loop that traverses the same data continuously."""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, make_dataset, quiet_trainer, reference_train, relative_error

MICRO, SAMPLES = 4, 40  # 10 micro-batches per data pass


def shuffled_loader(dataset):
    # One replica: a shuffling sampler whose order changes with set_epoch, i.e. per data pass.
    return DataLoader(dataset, batch_size=MICRO, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=3))


def continuous_micro_batches(num_micro: int) -> list[list[int]]:
    """Sample indices of the first ``num_micro`` micro-batches of an endless, per-pass reshuffled traversal."""
    micro, data_pass = [], 0
    while len(micro) < num_micro:
        sampler = DistributedSampler(range(SAMPLES), 1, 0, shuffle=True, seed=3)
        sampler.set_epoch(data_pass)
        order = list(sampler)
        micro += [order[i : i + MICRO] for i in range(0, SAMPLES, MICRO)]
        data_pass += 1
    return micro[:num_micro]


def windows_of(micro: list[list[int]], steps: int) -> list[list[int]]:
    return [sum(micro[i : i + steps], []) for i in range(0, len(micro) - steps + 1, steps)]


class PerSink(Callback):
    def __init__(self):
        self.outputs, self.steps = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.outputs.append(outputs)
        self.steps.append(trainer.global_step)


def fit_sinks(model, sink_size, steps, epochs, prefetch_depth=2, **kwargs):
    strategy = SinkStrategy(accumulation_steps=steps, sink_size=sink_size, prefetch_depth=prefetch_depth)
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, **kwargs)
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
    return trainer


@pytest.mark.parametrize("prefetch_depth", [2, 0])  # background thread, or read in the training thread
def test_sinks_traverse_the_data_continuously_and_match_the_plain_loop(prefetch_depth):
    model = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9)
    reference = copy.deepcopy(model)
    per_sink = PerSink()
    trainer = fit_sinks(
        model, sink_size=7, steps=3, epochs=5, prefetch_depth=prefetch_depth, callbacks=[per_sink]
    )  # 35 micro-batches
    windows = windows_of(continuous_micro_batches(35), 3)  # 11 updates; windows span sinks and passes
    lrs = reference_train(reference, make_dataset(num_samples=SAMPLES), windows)
    assert trainer.global_step == 11
    assert model.seen_lrs == pytest.approx(lrs, rel=1e-12)
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6
    # Callbacks fire once per sink and see every micro-step's loss on the device.
    assert len(per_sink.outputs) == 5
    assert [tuple(out["losses"].shape) for out in per_sink.outputs] == [(7,)] * 5
    assert all(torch.equal(out["loss"], out["losses"][-1]) for out in per_sink.outputs)
    assert per_sink.steps == [2, 4, 7, 9, 11]  # global_step counts updates inside sinks


def test_a_loader_shuffled_by_its_own_generator_keeps_lightnings_order():
    """Regression: checking the loader once with iter() drew from its generator and shifted every pass's order.
    The reference loop takes ``len(loader)`` batches per pass, as Lightning's loop does: one more ``next()`` would draw
    the next permutation from the generator (``RandomSampler``) before finding the pass done."""

    def generator_loader():
        return DataLoader(
            make_dataset(num_samples=SAMPLES),
            batch_size=MICRO,
            shuffle=True,
            generator=torch.Generator().manual_seed(5),
        )

    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    quiet_trainer(strategy=SinkStrategy(sink_size=7), max_epochs=3).fit(model, generator_loader())  # 21 batches
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    loader, trained = generator_loader(), 0
    while trained < 21:  # passes one after another, each of len(loader) batches, as Lightning iterates
        batches = iter(loader)
        for _ in range(len(loader)):
            x, y = next(batches)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(reference(x), y).backward()
            optimizer.step()
            trained += 1
            if trained == 21:
                break
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_sink_size_minus_one_is_one_data_pass_per_sink():
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    per_sink = PerSink()
    trainer = fit_sinks(model, sink_size=-1, steps=4, epochs=3, callbacks=[per_sink])
    reference_train(reference, make_dataset(num_samples=SAMPLES), windows_of(continuous_micro_batches(30), 4))
    assert [len(out["losses"]) for out in per_sink.outputs] == [10, 10, 10]
    assert trainer.global_step == 7
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


def test_max_steps_stops_inside_a_sink():
    model = TinyClassifier(optimizer="sgd", lr=0.05)
    reference = copy.deepcopy(model)
    per_sink = PerSink()
    trainer = fit_sinks(model, sink_size=10, steps=2, epochs=100, max_steps=7, callbacks=[per_sink])
    reference_train(reference, make_dataset(num_samples=SAMPLES), windows_of(continuous_micro_batches(14), 2))
    assert trainer.global_step == 7
    assert [len(out["losses"]) for out in per_sink.outputs] == [10, 4]
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


class SaveAtEpochEnd(Callback):
    def __init__(self, path, epoch):
        self.path, self.epoch = path, epoch

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def test_resume_at_a_sink_boundary_inside_a_window_is_bit_identical(tmp_path):
    ckpt = tmp_path / "sink.ckpt"
    uninterrupted = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9)
    fit_sinks(uninterrupted, sink_size=7, steps=3, epochs=5, callbacks=[SaveAtEpochEnd(ckpt, 1)])  # after 14: pos 2
    resumed = TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9, seed=9)
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=3, sink_size=7), max_epochs=5)
    trainer.fit(resumed, shuffled_loader(make_dataset(num_samples=SAMPLES)), ckpt_path=ckpt)
    assert trainer.global_step == 11
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))


def test_resume_after_a_max_steps_stop_mid_sink_is_bit_identical(tmp_path):
    uninterrupted = TinyClassifier(optimizer="sgd", lr=0.05)
    fit_sinks(uninterrupted, sink_size=6, steps=4, epochs=100, max_steps=9)
    first = TinyClassifier(optimizer="sgd", lr=0.05)
    trainer = fit_sinks(first, sink_size=6, steps=4, epochs=100, max_steps=4)  # stops after 16 of 18 in sink 3
    trainer.save_checkpoint(tmp_path / "stop.ckpt")
    resumed = TinyClassifier(optimizer="sgd", lr=0.05, seed=4)
    again = quiet_trainer(strategy=SinkStrategy(accumulation_steps=4, sink_size=6), max_epochs=100, max_steps=9)
    again.fit(resumed, shuffled_loader(make_dataset(num_samples=SAMPLES)), ckpt_path=tmp_path / "stop.ckpt")
    assert again.global_step == 9
    assert torch.equal(flat_params(resumed), flat_params(uninterrupted))


class Stream(IterableDataset):
    """No length: 10 micro-batches per pass."""

    def __iter__(self):
        x, y = make_dataset(num_samples=SAMPLES).tensors
        for start in range(0, SAMPLES, MICRO):
            yield x[start : start + MICRO], y[start : start + MICRO]


@pytest.mark.parametrize("sink_size, expected_lengths", [(4, [4, 4, 4]), (-1, [10, 10, 10])])
def test_iterable_dataset_without_length(sink_size, expected_lengths):
    per_sink = PerSink()
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=2, sink_size=sink_size), max_epochs=3, callbacks=[per_sink]
    )
    trainer.fit(TinyClassifier(), DataLoader(Stream(), batch_size=None))
    assert [len(out["losses"]) for out in per_sink.outputs] == expected_lengths
    assert trainer.global_step == sum(expected_lengths) // 2


def count_syncs_per_sink(trainer, counter) -> list[int]:
    """Has ``counter`` (tests.test_precision.SyncCounter) count host syncs inside each sink; one entry per sink."""
    sink_syncs, original = [], trainer.strategy._run_sink

    def counted_sink():
        before, counter._phase = counter._count, "sink"
        try:
            return original()
        finally:
            counter._phase = None
            sink_syncs.append(counter._count - before)

    trainer.strategy._run_sink = counted_sink
    return sink_syncs


def test_no_host_sync_inside_a_sink():
    from tests.test_precision import SyncCounter, Unlogged

    counter = SyncCounter()
    model = Unlogged(optimizer="adamw_fused", lr=0.01)
    # prefetch_depth=2: the loader's own CPU work (a sampler's tolist()) then runs in its thread, not counted
    trainer = quiet_trainer(
        strategy=SinkStrategy(accumulation_steps=2, sink_size=8, prefetch_depth=2), max_epochs=2, callbacks=[counter]
    )
    sink_syncs = count_syncs_per_sink(trainer, counter)
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))
    assert sink_syncs == [0, 0] and trainer.global_step == 8


class OverflowAtMicroStep(TinyClassifier):
    """Multiplies the loss by inf at chosen micro-steps, counted across sinks (a sink is one Lightning batch)."""

    def __init__(self, inf_at, **kwargs):
        super().__init__(**kwargs)
        self.inf_at, self.micro_steps = set(inf_at), 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.micro_steps += 1
        return loss * float("inf") if self.micro_steps - 1 in self.inf_at else loss


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])  # skip read on the host, or on the device
def test_accumulation_and_loss_scaling_inside_sinks(optimizer):
    from lightning_sink import DynamicLossScale, LossScalePrecision

    model = OverflowAtMicroStep(inf_at=(4,), optimizer=optimizer, lr=0.02, step_lr_gamma=0.9)  # window 1 of 6
    reference = copy.deepcopy(model)
    plugin = LossScalePrecision("32-true", DynamicLossScale(init_scale=2.0**10))
    trainer = quiet_trainer(strategy=SinkStrategy(accumulation_steps=3, sink_size=5), plugins=[plugin], max_epochs=4)
    trainer.fit(model, shuffled_loader(make_dataset(num_samples=SAMPLES)))  # 20 micro-batches: 6 windows
    lrs = reference_train(
        reference, make_dataset(num_samples=SAMPLES), windows_of(continuous_micro_batches(20), 3), skip={1}
    )
    assert trainer.global_step == 6 and plugin.skipped_updates == 1 and plugin.scale == 2.0**9
    # on_before_optimizer_step sees every window; the schedule holds on the skipped one (window 1).
    assert model.seen_lrs[1] == model.seen_lrs[2]
    assert model.seen_lrs[:1] + model.seen_lrs[2:] == pytest.approx(lrs, rel=1e-12)
    assert relative_error(flat_params(model), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize("bad", [0, -2, 1.5, "3", True])
def test_sink_size_must_be_valid(bad):
    with pytest.raises(
        ValueError, match=rf"sink_size={bad!r} is not valid: pass an int >= 1 \(micro-batches per sink\), -1"
    ):
        SinkStrategy(sink_size=bad)


def test_prefetch_depth_must_be_valid():
    with pytest.raises(ValueError, match=r"prefetch_depth=-1 is not valid: pass an int >= 1 .*, 0 .* or None"):
        SinkStrategy(sink_size=4, prefetch_depth=-1)


def test_a_loader_that_cannot_be_iterated_again_is_an_error():
    class OneShot:
        def __init__(self):
            self.items = iter([(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))] * 3)

        def __iter__(self):
            return self

        def __next__(self):
            return next(self.items)

    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=2), max_epochs=1)
    with pytest.raises(ValueError, match=r"OneShot is an iterator and cannot be iterated again"):
        trainer.fit(TinyClassifier(), OneShot())


def test_a_failing_run_stops_the_prefetch_thread():
    import threading

    class Failing(TinyClassifier):
        def training_step(self, batch, batch_idx):
            if self.trainer.global_step == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    trainer = quiet_trainer(strategy=SinkStrategy(sink_size=5, prefetch_depth=2), max_epochs=3)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Failing(), shuffled_loader(make_dataset(num_samples=SAMPLES)))
    assert not any(thread.name == "lightning-sink-prefetch" for thread in threading.enumerate())


@pytest.mark.parametrize("prefetch_depth, thread_expected", [(None, False), (2, True), (0, False)])
def test_the_default_reads_in_the_training_thread_on_cpu(prefetch_depth, thread_expected):
    """None: no prefetch thread on CPU (benchmarks/sink_throughput.py measured the thread slower there)."""
    import threading

    class SeesThreads(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.names = [thread.name for thread in threading.enumerate()]

    seen = SeesThreads()
    fit_sinks(TinyClassifier(), sink_size=4, steps=1, epochs=1, prefetch_depth=prefetch_depth, callbacks=[seen])
    assert ("lightning-sink-prefetch" in seen.names) is thread_expected


class SkipsOddBatches(TinyClassifier):
    """Returns no loss on odd batches: Lightning still steps the optimizer (on no gradient) and the schedulers."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx % 2 else super().training_step(batch, batch_idx)


class WithoutHooks(TinyClassifier):
    """No hook overridden: clipping is the only work between the backward and the step."""

    on_before_optimizer_step = pl.LightningModule.on_before_optimizer_step


@pytest.mark.parametrize(
    ("make_module", "trainer_kwargs"),
    [
        (lambda: TinyClassifier(optimizer="adamw", lr=0.01, step_lr_gamma=0.9), {"gradient_clip_val": 0.05}),
        (lambda: SkipsOddBatches(optimizer="sgd", lr=0.05, step_lr_gamma=0.8), {}),
        (
            lambda: WithoutHooks(optimizer="sgd", lr=0.05),
            {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        ),
    ],
    ids=["hooks_scheduler_norm_clipping", "none_steps_scheduler", "no_hooks_value_clipping"],
)
def test_one_micro_step_windows_in_sinks_update_as_stock_lightning(make_module, trainer_kwargs):
    """accumulation_steps=1: each micro-batch is an update, with the step's hooks, clipping and step schedulers as
    stock Lightning runs them (one data pass per sink, so sinks and stock's epochs see the same batches)."""
    stock, ours = make_module(), make_module()
    data = make_dataset(num_samples=SAMPLES)
    stock_trainer = quiet_trainer(max_epochs=3, **trainer_kwargs)
    stock_trainer.fit(stock, DataLoader(data, batch_size=MICRO))
    ours_trainer = quiet_trainer(strategy=SinkStrategy(sink_size=-1), max_epochs=3, **trainer_kwargs)
    ours_trainer.fit(ours, DataLoader(data, batch_size=MICRO))
    assert ours_trainer.global_step == stock_trainer.global_step == 30
    assert ours.seen_lrs == stock.seen_lrs
    assert torch.equal(flat_params(ours), flat_params(stock))
    assert [config.scheduler.last_epoch for config in ours_trainer.lr_scheduler_configs] == [
        config.scheduler.last_epoch for config in stock_trainer.lr_scheduler_configs
    ]
