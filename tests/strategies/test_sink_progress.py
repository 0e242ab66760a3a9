"""The progress bar in sink mode counts micro-batches: its counters (n, total) read side by side with the same fit
without sinking, where Lightning's bar counts the same micro-batches as its batches."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar, RichProgressBar, TQDMProgressBar

from lightning_sink import SinkStrategy
from tests.helpers import TinyClassifier, loader, make_dataset

PASS = 10  # micro-batches per data pass (40 samples, batches of 4)


def counters(bar: ProgressBar) -> tuple[int, int | None]:
    """The training bar's (done, total), as the user sees them."""
    if isinstance(bar, RichProgressBar):
        task = bar.progress.tasks[bar.train_progress_bar_id]
        return int(task.completed), None if task.total is None else int(task.total)
    return bar.train_progress_bar.n, bar.train_progress_bar.total


class ReadsTheBar(TinyClassifier):
    """Records the bar's counters as each micro-batch starts (in sink mode, inside the sink)."""

    def __init__(self) -> None:
        super().__init__()
        self.at_steps: list[tuple[int, int | None]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.at_steps.append(counters(self.trainer.progress_bar_callback))
        return super().training_step(batch, batch_idx)


class AtEpochEnd(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, int | None]] = []
        self.drawn: list[str] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        bar = trainer.progress_bar_callback
        self.seen.append(counters(bar))
        if isinstance(bar, TQDMProgressBar):
            self.drawn.append(str(bar.train_progress_bar))


def fit(strategy: Any, bar: ProgressBar | None = None, ckpt_path: Any = None, saves: Any = None, **kwargs: Any):
    module, ends = ReadsTheBar(), AtEpochEnd()
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=saves is not None,
        enable_model_summary=False,
        callbacks=[bar or TQDMProgressBar(), ends, *([saves] if saves is not None else [])],
        strategy=strategy,
        **kwargs,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader(make_dataset(num_samples=4 * PASS), 4), ckpt_path=ckpt_path)
    return trainer, module, ends


def test_a_pass_long_sink_counts_micro_batches_as_stock_counts_batches():
    _, stock, stock_ends = fit("auto", max_epochs=2)
    _, sink, sink_ends = fit(SinkStrategy(accumulation_steps=2, sink_size=-1), max_epochs=2)
    assert stock_ends.seen == sink_ends.seen == [(PASS, PASS)] * 2
    assert sink.at_steps == stock.at_steps == [(i, PASS) for i in range(PASS)] * 2  # moves with each micro-batch
    for drawn in sink_ends.drawn:  # micro-batches done of the total, the time left, the rate
        assert re.search(rf"{PASS}/{PASS} \[\d\d:\d\d<\d\d:\d\d, +[0-9.]+it/s", drawn), drawn


def test_a_sink_of_k_counts_its_k_micro_batches():
    _, sink, ends = fit(SinkStrategy(sink_size=3), max_epochs=3)
    assert ends.seen == [(3, 3)] * 3
    assert sink.at_steps == [(i, 3) for i in range(3)] * 3


def test_limit_train_batches_leaves_the_total_what_the_epoch_trains():
    """A sink trains its own micro-batches whatever ``limit_train_batches`` (which counts Lightning batches)."""
    _, sink, ends = fit(SinkStrategy(sink_size=4), max_epochs=2, limit_train_batches=2)
    assert ends.seen == [(4, 4)] * 2
    assert len(sink.at_steps) == 8


def test_a_resumed_pass_counts_from_where_it_stopped_as_stock(tmp_path):
    seen = {}
    for name, strategy in [("stock", lambda: "auto"), ("sink", lambda: SinkStrategy(sink_size=-1))]:
        saves = ModelCheckpoint(tmp_path / name, "{step}", every_n_train_steps=PASS + 4, save_top_k=-1)
        fit(strategy(), saves=saves, max_epochs=2)  # a checkpoint 4 micro-batches into the second pass
        _, resumed, ends = fit(strategy(), ckpt_path=tmp_path / name / f"step={PASS + 4}.ckpt", max_epochs=3)
        seen[name] = (resumed.at_steps, ends.seen)
    (sink_steps, sink_ends), (stock_steps, stock_ends) = seen["sink"], seen["stock"]
    assert [n for n, _ in sink_steps] == [n for n, _ in stock_steps]  # 0, then 5..9 (the pass's first 4 were done)
    assert [n for n, _ in sink_ends] == [n for n, _ in stock_ends] == [PASS, PASS]
    assert sink_steps[: PASS - 4] == [(0, PASS)] + [(i, PASS) for i in range(5, PASS)]
    # the total is the pass's from the resumed epoch's start on; stock Lightning's bar has none for the epoch a
    # resume continues (it does not start that epoch), only from the next one
    assert {total for _, total in sink_steps + sink_ends} == {PASS}
    assert stock_ends == [(PASS, None), (PASS, PASS)]


def test_pytorch_lightnings_bar_counts_micro_batches_as_its_stock_run():
    """The standalone package's TQDMProgressBar, driven by ``lightning_sink.pytorch_lightning``'s strategy."""
    pl_ = pytest.importorskip("pytorch_lightning")
    from lightning_sink.pytorch_lightning import SinkStrategy as PLSinkStrategy

    def run(strategy: Any) -> list[tuple[int, int | None]]:
        seen: list[tuple[int, int | None]] = []

        class Module(pl_.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = TinyClassifier().net

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                bar = self.trainer.progress_bar_callback.train_progress_bar
                seen.append((bar.n, bar.total))
                return self.net(batch[0]).logsumexp(-1).mean()

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        trainer = pl_.Trainer(  # (the bar named: with rich installed, Lightning's default bar is Rich's)
            accelerator="cpu",
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            strategy=strategy,
            callbacks=[pl_.callbacks.TQDMProgressBar()],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Module(), loader(make_dataset(num_samples=4 * PASS), 4))
        return seen

    assert run(PLSinkStrategy(sink_size=-1)) == run("auto") == [(i, PASS) for i in range(PASS)] * 2


def test_the_rich_bar_counts_micro_batches_as_stock():
    pytest.importorskip("rich", reason="rich is not installed (Lightning's RichProgressBar needs it; not a dependency)")
    _, stock, stock_ends = fit("auto", bar=RichProgressBar(), max_epochs=2)
    _, sink, sink_ends = fit(SinkStrategy(sink_size=-1), bar=RichProgressBar(), max_epochs=2)
    assert stock_ends.seen == sink_ends.seen == [(PASS, PASS)] * 2
    assert sink.at_steps == stock.at_steps


@pytest.mark.slow  # builds the compiled programs (aot_eager)
def test_compiled_calls_of_several_micro_batches_move_the_bar_once_per_call(monkeypatch, caplog):
    from lightning_sink.sink.programs import compiled_choice
    from lightning_sink.sink.progress import SinkProgress
    from tests.compiled.test_lightning_fit import Net, dataset
    from tests.compiled.test_lightning_fit import fit as compiled_fit

    monkeypatch.setattr(compiled_choice, "COMPILE_BACKEND", "aot_eager")
    counts: list[int] = []
    advance = SinkProgress.advance

    def recorded(self: SinkProgress) -> None:
        advance(self)
        counts.append(self._callback.train_progress_bar.n)

    monkeypatch.setattr(SinkProgress, "advance", recorded)
    ends = AtEpochEnd()
    strategy = SinkStrategy(accumulation_steps=2, sink_size=8, graph_mode="compile", micro_steps_per_call=4)
    trainer = pl.Trainer(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        max_epochs=2,
        strategy=strategy,
        callbacks=[ends, TQDMProgressBar()],  # (named: with rich installed, Lightning's default bar is Rich's)
    )
    compiled_fit(trainer, Net(), dataset(), caplog)
    # the first sink: two calls of four; the second crosses the data pass's end (10 micro-batches) after its second,
    # so it runs one micro-batch per call there, then a call of four, then one per call for the sink's last two
    assert counts == [4, 8, 1, 2, 6, 7, 8]
    assert ends.seen == [(8, 8)] * 2
