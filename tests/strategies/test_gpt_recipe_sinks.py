"""The recipe people switch sinking on in, at a small size: a GPT-style language model (causal self-attention with
dropout), bf16-mixed, AdamW with decay groups, linear warm-up then cosine decay stepped per update and sized from
``trainer.estimated_stepping_batches``, clipping at 1.0, a validation loop every 12 micro-batches, step
checkpoints, and a loader shuffled by its own generator over three data passes. With ``sink_size`` on (sinks that
divide the pass and sinks that do not) it must be the same run as without sinking: every logged loss, learning rate
and validation value at the same step, the same checkpoint steps, bit-identical parameters."""

from __future__ import annotations

import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sink import SinkStrategy
from tests.helpers import RecordingLogger

VOCAB, CONTEXT, WIDTH = 32, 8, 16
MICRO_BATCH, PASS_BATCHES, STEPS = 4, 12, 4  # a pass of 12 micro-batches is 3 updates
UPDATES = 9  # three passes


class TinyGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(0.02 * torch.randn(CONTEXT, WIDTH))
        self.block = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.1, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def _loss(self, batch) -> torch.Tensor:
        (tokens,) = batch
        hidden = self.block(self.embed(tokens[:, :-1]) + self.position, src_mask=self.causal, is_causal=True)
        logits = self.head(self.norm(hidden))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        self.log("lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))  # on_epoch: the mean over the validation loader

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3
        )
        total, warm_up = self.trainer.estimated_stepping_batches, 2

        def schedule(step: int) -> float:
            if step < warm_up:
                return (step + 1) / warm_up
            return 0.5 * (1 + math.cos(math.pi * (step - warm_up) / max(1, total - warm_up)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def tokens(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    steps = torch.randint(1, 4, (samples, 1), generator=generator)
    return TensorDataset((start + steps * torch.arange(CONTEXT + 1)) % VOCAB)  # learnable sequences


def fit(sink_size: int | None, checkpoints: Path) -> tuple[TinyGPT, RecordingLogger, pl.Trainer, list[int]]:
    module, points = TinyGPT(), RecordingLogger()
    train = DataLoader(
        tokens(MICRO_BATCH * PASS_BATCHES, 1),
        batch_size=MICRO_BATCH,
        shuffle=True,
        generator=torch.Generator().manual_seed(7),
    )
    val = DataLoader(tokens(16, 2), batch_size=8)
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=SinkStrategy(accumulation_steps=STEPS, sink_size=sink_size),
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        max_steps=UPDATES,
        max_epochs=-1,
        val_check_interval=12,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        logger=points,
        callbacks=[saver],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(123)  # the dropout's generator starts the same in every run
    trainer.fit(module, train, val)
    saved = sorted(int(path.stem.split("=")[1]) for path in checkpoints.glob("*.ckpt"))
    return module, points, trainer, saved


@pytest.mark.parametrize("sink_size", [6, 8, 20], ids=["sink divides the pass", "sink does not", "sink > pass"])
def test_sinks_give_the_run_without_sinking(tmp_path, sink_size):
    reference, reference_points, reference_trainer, reference_saved = fit(None, tmp_path / "without")
    sunk, sunk_points, sunk_trainer, sunk_saved = fit(sink_size, tmp_path / "with")

    assert reference_trainer.global_step == sunk_trainer.global_step == UPDATES
    assert reference_trainer.estimated_stepping_batches == sunk_trainer.estimated_stepping_batches == UPDATES
    reference_points, sunk_points = (
        sorted(reference_points.values(skip=("epoch",))),
        sorted(sunk_points.values(skip=("epoch",))),
    )
    assert sunk_points == reference_points
    names = {name for _, name, _ in reference_points}
    assert {"train_loss", "lr", "val_loss"} <= names
    assert len([point for point in reference_points if point[1] == "val_loss"]) == 3  # micro-batches 12, 24, 36
    lrs = [value for _, name, value in reference_points if name == "lr"]
    assert lrs[-1] < lrs[1]  # the cosine decays over the fit the scheduler was sized for
    assert sunk_saved == reference_saved == [2, 4, 6, 8]
    for (name, expected), actual in zip(reference.state_dict().items(), sunk.state_dict().values(), strict=True):
        assert torch.equal(actual, expected), name
