"""What Lightning promises, run side by side: stock Lightning's default strategy and the sink strategy in one test.

Hook-call lists, progress counters (as saved in the checkpoint's loop state), ``global_step`` and the final
parameters are compared with stock Lightning; where the sink strategy deliberately differs (the mean over the
micro-batches that returned a loss, sinks) the reference is a plain PyTorch loop written here.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, Callback, GradientAccumulationScheduler

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, flat_params, loader, make_dataset, quiet_trainer, relative_error

MICRO = 4


def fit(module, strategy: Any = "auto", samples: int = 32, epochs: int = 1, **kwargs):
    trainer = quiet_trainer(strategy=strategy, max_epochs=epochs, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=samples), MICRO))
    return trainer


def twins(cls=TinyClassifier, **kwargs):
    stock = cls(**kwargs)
    return stock, copy.deepcopy(stock)


def plain_loop(model: TinyClassifier, windows: list[list[list[int]]], samples: int) -> None:
    """One SGD-momentum (or AdamW) update per window, the mean loss over the window's micro-batches; an empty
    window leaves everything (optimizer state included) untouched."""
    from tests.helpers import make_optimizer

    optimizer = make_optimizer(model.optimizer_kind, model.parameters(), model.lr)
    x, y = make_dataset(num_samples=samples).tensors
    for window in windows:
        if not window:
            continue
        optimizer.zero_grad()
        loss = sum(F.cross_entropy(model(x[batch]), y[batch]) for batch in window) / len(window)
        loss.backward()
        optimizer.step()


def micro_batches(samples: int) -> list[list[int]]:
    return [list(range(i, i + MICRO)) for i in range(0, samples, MICRO)]


def loop_state(trainer) -> dict[str, Any]:
    """The optimizer progress (zero-grad and step counters) and the scheduler progress, as the checkpoint's
    ``loops["fit_loop"]`` holds them (``FitLoop.state_dict()`` is what Lightning saves there)."""
    state = trainer.fit_loop.state_dict()
    return {
        "optimizer": state["epoch_loop.automatic_optimization.optim_progress"],
        "schedulers": state["epoch_loop.scheduler_progress"],
    }


def update_totals(trainer) -> dict[str, Any]:
    """The run's total zero-grad and step counts (a sink run has other epochs, so only totals compare)."""
    progress = loop_state(trainer)["optimizer"]["optimizer"]
    return {name: counters["total"] for name, counters in progress.items()}


# ---------------------------------------------------------------------------------------------- 1. None skips
class SkipSome(TinyClassifier):
    def __init__(self, skip: set[int], **kwargs):
        super().__init__(**kwargs)
        self.skip = skip
        self.seen = 0

    def training_step(self, batch, batch_idx):
        index, self.seen = self.seen, self.seen + 1  # the micro-batch's index in the run (sinks included)
        return None if index in self.skip else super().training_step(batch, batch_idx)


def test_none_skips_the_batch_as_stock_with_one_micro_step():
    stock, sink = twins(SkipSome, skip={1, 2}, optimizer="adamw", lr=0.01)
    stock_trainer = fit(stock)
    sink_trainer = fit(sink, SinkStrategy())
    assert torch.equal(flat_params(sink), flat_params(stock))
    assert sink_trainer.global_step == stock_trainer.global_step == 8  # stock counts the skipped batches' steps
    assert loop_state(sink_trainer) == loop_state(stock_trainer)


@pytest.mark.parametrize("sink_size", [None, 4])
def test_a_window_updates_with_the_mean_of_the_micro_batches_that_returned_a_loss(sink_size):
    # windows of 2 over 8 micro-batches: [0 1] [2 3] [4 5] [6 7]; 2 is skipped, 4 and 5 are both skipped
    samples, skip = 32, {2, 4, 5}
    sink, reference = twins(SkipSome, skip=skip, optimizer="adamw", lr=0.01)
    stock = copy.deepcopy(sink)
    strategy = SinkStrategy(accumulation_steps=2, sink_size=sink_size)
    trainer = fit(sink, strategy, samples=samples, epochs=2 if sink_size else 1)
    stock_trainer = fit(stock, accumulate_grad_batches=2, samples=samples)
    batches = micro_batches(samples)
    windows = [[batches[i] for i in (w, w + 1) if i not in skip] for w in range(0, 8, 2)]
    plain_loop(reference, windows, samples)
    assert relative_error(flat_params(sink), flat_params(reference)) <= 1e-6
    assert trainer.global_step == stock_trainer.global_step == 4  # the empty window counts, as stock counts it
    assert len(sink.seen_lrs) == len(stock.seen_lrs) == 4  # on_before_optimizer_step too (its gradients: None)


def test_a_window_with_no_loss_leaves_parameters_and_optimizer_state_unchanged():
    sink = SkipSome(skip=set(range(8)), optimizer="adamw", lr=0.01)
    before = flat_params(sink)
    trainer = fit(sink, SinkStrategy(accumulation_steps=2))
    assert torch.equal(flat_params(sink), before)
    assert trainer.optimizers[0].state_dict()["state"] == {}


# ---------------------------------------------------------------------------------------------- 2. signatures
class BatchOnly(TinyClassifier):
    def training_step(self, batch):
        return F.cross_entropy(self(batch[0]), batch[1])


class DataloaderIter(TinyClassifier):
    def training_step(self, dataloader_iter):
        (x, y), _, _ = next(dataloader_iter)
        return F.cross_entropy(self(x), y)


@pytest.mark.parametrize("cls", [BatchOnly, DataloaderIter])
def test_every_signature_runs_as_stock_with_one_micro_step(cls):
    stock, sink = twins(cls)
    stock_trainer, sink_trainer = fit(stock), fit(sink, SinkStrategy())
    assert torch.equal(flat_params(sink), flat_params(stock))
    assert sink_trainer.global_step == stock_trainer.global_step == 8


def test_a_batch_only_signature_inside_sinks():
    sink, reference = twins(BatchOnly, lr=0.05)
    fit(sink, SinkStrategy(accumulation_steps=2, sink_size=4), epochs=2)
    batches = micro_batches(32)
    plain_loop(reference, [batches[i : i + 2] for i in range(0, 8, 2)], 32)
    assert relative_error(flat_params(sink), flat_params(reference)) <= 1e-6


@pytest.mark.parametrize("strategy", [lambda: SinkStrategy(accumulation_steps=2), lambda: SinkStrategy(sink_size=4)])
def test_dataloader_iter_with_windows_or_sinks_is_a_clear_error(strategy):
    with pytest.raises(ValueError, match=r"training_step\(dataloader_iter\) draws its own batches.*every micro-batch"):
        fit(DataloaderIter(), strategy())


# ---------------------------------------------------------------------------------------------- 3. zero-grad
class CountZeroGrad(Callback):
    def __init__(self):
        self.calls = []

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.calls.append(("callback.on_before_zero_grad", trainer.fit_loop.epoch_loop.batch_idx))


class ZeroGradHooks(TinyClassifier):
    def __init__(self, set_to_none: bool | None = True, **kwargs):
        super().__init__(**kwargs)
        self.set_to_none, self.calls = set_to_none, []

    def on_before_zero_grad(self, optimizer):
        self.calls.append("module.on_before_zero_grad")

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.calls.append(("optimizer_zero_grad", batch_idx))
        if self.set_to_none is not None:  # None: keep the gradients across windows
            optimizer.zero_grad(set_to_none=self.set_to_none)


@pytest.mark.parametrize("set_to_none", [True, False, None])
def test_zero_grad_hooks_counters_and_overrides_as_stock(set_to_none):
    stock, sink = twins(ZeroGradHooks, set_to_none=set_to_none, lr=0.05)
    stock_cb, sink_cb = CountZeroGrad(), CountZeroGrad()
    stock_trainer = fit(stock, accumulate_grad_batches=2, callbacks=[stock_cb])
    sink_trainer = fit(sink, SinkStrategy(accumulation_steps=2), callbacks=[sink_cb])
    assert sink.calls == stock.calls and len(stock.calls) == 8  # 4 windows: on_before_zero_grad, zero_grad
    assert sink_cb.calls == stock_cb.calls
    assert loop_state(sink_trainer) == loop_state(stock_trainer)
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6


def test_zero_grad_set_to_none_reattaches_the_window_buffer():
    """The fp32 parameters' gradients are views into the window buffer; ``set_to_none`` must not detach them."""
    seen = []

    class Probe(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            flat = trainer.strategy._accumulator.flat
            storage = flat.untyped_storage().data_ptr()
            seen.append(all(p.grad.untyped_storage().data_ptr() == storage for p in module.parameters()))

    fit(ZeroGradHooks(set_to_none=True), SinkStrategy(accumulation_steps=2), callbacks=[Probe()])
    assert seen == [True] * 4


# ---------------------------------------------------------------------------------------------- 4. optimizer_step
class WarmUp(TinyClassifier):
    """Lightning's documented learning-rate warm-up: edit param_groups, then step."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.step_batches = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.step_batches.append(batch_idx)
        scale = min(1.0, float(self.trainer.global_step + 1) / 3)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.lr
        optimizer.step(closure=optimizer_closure)


class EveryOtherUpdate(TinyClassifier):
    """Lightning's documented 'step on some batches only': the closure still runs on the others."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        if batch_idx % 4 == 3:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


@pytest.mark.parametrize("sink_size", [None, 8])
def test_optimizer_step_override_is_called_once_per_update_and_controls_it(sink_size):
    stock, sink = twins(WarmUp, lr=0.1)
    fit(stock, accumulate_grad_batches=2)
    fit(sink, SinkStrategy(accumulation_steps=2, sink_size=sink_size))
    assert sink.step_batches == stock.step_batches == [1, 3, 5, 7]
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6


def test_stepping_on_some_batches_only_as_stock():
    stock, sink = twins(EveryOtherUpdate, lr=0.1)
    fit(stock, accumulate_grad_batches=2)
    fit(sink, SinkStrategy(accumulation_steps=2))
    reference = TinyClassifier(lr=0.1)
    batches = micro_batches(32)
    plain_loop(reference, [batches[2:4], batches[6:8]], 32)  # only the windows ending at batch 3 and 7 step
    assert relative_error(flat_params(sink), flat_params(reference)) <= 1e-6
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6


# ---------------------------------------------------------------------------------------------- 5. closures
class WithLBFGS(TinyClassifier):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_an_optimizer_that_needs_a_closure_runs_as_stock_with_one_micro_step():
    stock, sink = twins(WithLBFGS)
    fit(stock)
    fit(sink, SinkStrategy())
    assert torch.equal(flat_params(sink), flat_params(stock))


@pytest.mark.parametrize("strategy", [lambda: SinkStrategy(accumulation_steps=2), lambda: SinkStrategy(sink_size=4)])
def test_an_optimizer_that_needs_a_closure_with_windows_is_a_clear_error(strategy):
    with pytest.raises(ValueError, match=r"LBFGS.step needs a closure"):
        fit(WithLBFGS(), strategy())


# ---------------------------------------------------------------------------------------------- 6. nothing to train
class NoOptimizer(TinyClassifier):
    def configure_optimizers(self):
        return None

    def on_before_optimizer_step(self, optimizer):
        pass  # Lightning's stand-in optimizer has no param_groups to read


def test_no_optimizer_runs_as_stock():
    stock, sink = twins(NoOptimizer)
    before = flat_params(stock)
    stock_trainer = fit(stock, accumulate_grad_batches=2)
    sink_trainer = fit(sink, SinkStrategy(accumulation_steps=2))
    assert torch.equal(flat_params(sink), before) and torch.equal(flat_params(stock), before)
    assert sink_trainer.global_step == stock_trainer.global_step


class Backbone(TinyClassifier):
    def __init__(self, head_frozen: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.backbone, self.head_frozen = self.net[0], head_frozen
        self.outside = torch.nn.Parameter(torch.zeros(()))  # not optimized: keeps a frozen model's loss differentiable
        if head_frozen:  # nothing the optimizer holds is trainable at train start; the test's callback unfreezes it
            self.net[2].requires_grad_(False)

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) + 0 * self.outside

    def configure_optimizers(self):
        params = self.net[2].parameters()  # the head; BackboneFinetuning adds the backbone's group later
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)


class UnfreezeHead(Callback):
    def on_train_epoch_start(self, trainer, module):
        if module.head_frozen and trainer.current_epoch == 1:
            module.net[2].requires_grad_(True)


@pytest.mark.parametrize(
    ("steps", "make_sink"),
    [(2, lambda: SinkStrategy(accumulation_steps=2)), (1, lambda: SinkStrategy(sink_size=-1))],
    ids=["accumulating", "sinks_of_one_data_pass"],
)
@pytest.mark.parametrize("freeze_all", [False, True])
def test_backbone_finetuning_trains_as_stock(freeze_all, steps, make_sink):
    def finetuning():
        return BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=0.5, verbose=False)

    stock, sink = twins(Backbone, head_frozen=freeze_all, lr=0.05)
    stock_trainer = fit(stock, accumulate_grad_batches=steps, epochs=3, callbacks=[finetuning(), UnfreezeHead()])
    sink_trainer = fit(sink, make_sink(), epochs=3, callbacks=[finetuning(), UnfreezeHead()])
    assert not torch.equal(flat_params(sink), flat_params(Backbone(lr=0.05)))  # it trained
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6
    assert sink_trainer.global_step == stock_trainer.global_step


# ---------------------------------------------------------------------------------------------- 8. scheduler
def test_gradient_accumulation_scheduler_is_honoured():
    stock, sink = twins(lr=0.05)
    schedule = {0: 1, 1: 4}
    stock_trainer = fit(stock, epochs=2, callbacks=[GradientAccumulationScheduler(schedule)])
    sink_trainer = fit(sink, SinkStrategy(), epochs=2, callbacks=[GradientAccumulationScheduler(schedule)])
    assert sink_trainer.global_step == stock_trainer.global_step == 8 + 2
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6
    assert loop_state(sink_trainer) == loop_state(stock_trainer)


def test_explicit_accumulation_steps_and_a_scheduler_is_a_clear_error():
    with pytest.raises(ValueError, match=r"accumulation_steps=2\) and a GradientAccumulationScheduler"):
        fit(TinyClassifier(), SinkStrategy(accumulation_steps=2), callbacks=[GradientAccumulationScheduler({0: 2})])


# ---------------------------------------------------------------------------------------------- 9. hook order
_MODULE_HOOKS = sorted(
    name
    for name, value in {**vars(pl.core.hooks.ModelHooks), **vars(pl.LightningModule)}.items()
    if inspect.isfunction(value)
    and (
        name.startswith("on_")
        or name
        in (
            "training_step",
            "validation_step",
            "optimizer_step",
            "optimizer_zero_grad",
            "backward",
            "configure_gradient_clipping",
            "lr_scheduler_step",
            "setup",
            "teardown",
            "configure_model",
            "transfer_batch_to_device",
        )
    )
)
_CALLBACK_HOOKS = sorted(
    name
    for name, value in vars(Callback).items()
    if inspect.isfunction(value) and (name.startswith("on_") or name in ("setup", "teardown"))
)


def recording(cls: type, calls: list[str]) -> type:
    """A subclass of the LightningModule ``cls`` that appends ``m.<hook>`` to ``calls`` for every hook."""

    def wrap(name: str):
        def hook(self, *args, **kwargs):
            calls.append(f"m.{name}")
            return getattr(super(recorded, self), name)(*args, **kwargs)

        return hook

    recorded = type(f"Recording{cls.__name__}", (cls,), {name: wrap(name) for name in _MODULE_HOOKS})
    return recorded


class RecordingCallback(Callback):
    def __init__(self, calls: list[str]):
        self.calls = calls

    def __getattribute__(self, name):
        if name in _CALLBACK_HOOKS:
            calls = object.__getattribute__(self, "calls")
            return lambda *args, **kwargs: calls.append(f"cb.{name}")
        return object.__getattribute__(self, name)


class WithValidation(TinyClassifier):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))


def recorded_fit(strategy: Any, **kwargs) -> tuple[list[str], Any, Any]:
    calls: list[str] = []
    module = recording(WithValidation, calls)(lr=0.05, step_lr_gamma=0.9)
    kwargs.setdefault("limit_val_batches", 2)
    trainer = quiet_trainer(strategy=strategy, callbacks=[RecordingCallback(calls)], **kwargs)
    data = loader(make_dataset(num_samples=32), MICRO)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, loader(make_dataset(num_samples=8, seed=1), MICRO))
    return calls, module, trainer


def test_hook_sequence_of_a_fit_is_stocks():
    stock_calls, stock, stock_trainer = recorded_fit("auto", accumulate_grad_batches=2, max_epochs=2)
    sink_calls, sink, sink_trainer = recorded_fit(SinkStrategy(accumulation_steps=2), max_epochs=2)
    assert "m.optimizer_zero_grad" in stock_calls and "m.on_validation_model_zero_grad" in stock_calls
    assert sink_calls == stock_calls
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6
    assert loop_state(sink_trainer) == loop_state(stock_trainer)


_STEP_HOOKS = {
    "training_step",
    "on_before_zero_grad",
    "optimizer_zero_grad",
    "on_before_backward",
    "backward",
    "on_after_backward",
    "optimizer_step",
    "on_before_optimizer_step",
    "configure_gradient_clipping",
    "lr_scheduler_step",
}


def _per_batch(calls: list[str]) -> list[list[str]]:
    """The step hooks each training batch ran, between its on_train_batch_start and on_train_batch_end."""
    batches, inside = [], None
    for call in calls:
        if call == "m.on_train_batch_start":
            inside = []
        elif call == "cb.on_train_batch_end":
            batches.append(inside)
            inside = None
        elif inside is not None and call.split(".", 1)[1] in _STEP_HOOKS:
            inside.append(call)
    return batches


def test_sink_hook_rule_batch_hooks_per_sink_step_hooks_per_micro_batch_and_update():
    """A sink of K micro-batches is one Lightning batch (its batch hooks run once), and inside it the step hooks
    run exactly as stock Lightning runs them for those K batches: zero-grad hooks at each window's first
    micro-batch, backward hooks per micro-batch, optimizer_step (around the window's last micro-batch),
    on_before_optimizer_step and the step LR schedulers per update."""
    stock_calls, stock, stock_trainer = recorded_fit(
        "auto", accumulate_grad_batches=2, max_epochs=1, limit_val_batches=0
    )
    sink_calls, sink, sink_trainer = recorded_fit(
        SinkStrategy(accumulation_steps=2, sink_size=4), max_epochs=2, limit_val_batches=0
    )
    stock_batches, sink_batches = _per_batch(stock_calls), _per_batch(sink_calls)
    assert len(stock_batches) == 8 and len(sink_batches) == 2
    assert sink_batches == [sum(stock_batches[:4], []), sum(stock_batches[4:], [])]
    assert sink_calls.count("m.on_train_batch_start") == sink_calls.count("cb.on_train_batch_end") == 2
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6
    assert sink_trainer.global_step == stock_trainer.global_step == 4
    assert update_totals(sink_trainer) == update_totals(stock_trainer)


def test_sink_without_hook_overrides_counts_zero_grads_and_steps_as_stock():
    stock, sink = twins(lr=0.05)
    stock_trainer = fit(stock, accumulate_grad_batches=2)
    sink_trainer = fit(sink, SinkStrategy(accumulation_steps=2, sink_size=4), epochs=2)
    assert sink_trainer.strategy._hooks.direct_sink_step  # the fast path, no hook dispatch
    assert update_totals(sink_trainer) == update_totals(stock_trainer)
    assert relative_error(flat_params(sink), flat_params(stock)) <= 1e-6


# ---------------------------------------------------------------------------------------------- graph_mode everywhere
def test_graph_mode_is_an_argument_of_every_sink_strategy():
    from lightning_sink import SinkDDPStrategy, SinkModelParallelStrategy

    for strategy in (SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy):
        assert strategy(graph_mode="compile").graph_mode == "compile"
        with pytest.raises(ValueError, match=r"graph_mode='fast' is not valid: choose one of 'eager', 'compile'"):
            strategy(graph_mode="fast")
