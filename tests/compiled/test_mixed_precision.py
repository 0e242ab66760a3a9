"""Mixed precision inside the whole-step programs: the precision plugin's autocast built into the compiled forward.

Held to a plain PyTorch autocast loop written here, to the same fit with ``graph_mode="eager"``, and, per program
call, to eager autocast forward and backward bit for bit. CPU autocast runs both bf16 and fp16 in this torch, so the
fp16 loss-scale path (overflow skips, scale halving) is checked on the CPU with real fp16 overflows.

Tolerances: the compiled forward and backward under autocast are eager's bit for bit (the program-level test), so a
fit differs from the eager one only by the fp32 arithmetic of the compiled update (the order of the window sum and
of the optimizer's formula): about 1e-8 relative after these fits, as the fp32 programs. ``TOLERANCE`` = 1e-6 leaves
room for that and is 100x below what one missing autocast region moves the parameters (a bf16 forward against an
fp32 one: 6e-4 to 1e-3 after these fits; fp16: 0.1), which each test checks against an fp32 run of the same loop.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch.utils.data import TensorDataset

from lightning_sink.compiled import AutocastRegion, ProgramSettings, Unavailable, build_step_programs
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale
from lightning_sink.precision import LossScalePrecision
from lightning_sink.strategies.step_autocast import step_autocast
from tests.compiled.models import Classifier, make_batches
from tests.compiled.test_lightning_fit import (
    MICRO,
    OPTIMIZERS,
    SAMPLES,
    Net,
    dataset,
    fit,
    flat,
    quick_backend,  # noqa: F401  (the fixture: aot_eager, a fresh TorchDynamo per test)
    relative_error,
    trainer_for,
)

TOLERANCE = 1e-6
SINK, EPOCHS = 7, 4  # 28 micro-batches


def plain_autocast_loop(
    net: nn.Module, micro_batches: int, steps: int, data: TensorDataset, dtype: torch.dtype | None, scale: float = 1.0
) -> dict[str, Any]:
    """The loop a user writes for mixed precision (AdamW): each micro-batch's forward under
    ``torch.autocast("cpu", dtype)`` (``None``: fp32), its loss times the scale backpropagated outside it, the window's
    gradients summed in the fp32 parameters' ``.grad`` and divided by scale x window; a window whose gradient is not
    finite is skipped and the scale halves. Micro-batches read in order over endless passes; the open last window
    gets no update."""
    optimizer = OPTIMIZERS["adamw"](net.parameters())
    x, y = data.tensors
    updates = skipped = 0
    for first in range(0, micro_batches, steps):
        optimizer.zero_grad()
        for micro in range(first, min(first + steps, micro_batches)):
            start = (micro % (SAMPLES // MICRO)) * MICRO
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = F.cross_entropy(net(x[start : start + MICRO]), y[start : start + MICRO])
            (loss * scale).backward()
        if first + steps > micro_batches:
            break
        for param in net.parameters():
            param.grad.div_(scale * steps)
        if not all(torch.isfinite(param.grad).all() for param in net.parameters()):
            skipped += 1
            scale /= 2
            continue
        optimizer.step()
        updates += 1
    return {"updates": updates, "skipped": skipped, "scale": scale}


def fit_both(steps: int, data: TensorDataset, caplog: Any, plugins: Any = None, **kwargs: Any) -> dict[str, Any]:
    """The same fit with ``graph_mode="eager"`` and ``"compile"`` (which must report its programs, with autocast)."""
    runs = {}
    for graph_mode in ("eager", "compile"):
        torch._dynamo.reset()
        model = Net("adamw")
        trainer = trainer_for(graph_mode, steps, SINK, EPOCHS, plugins=plugins() if plugins else None, **kwargs)
        fit(trainer, model, data, caplog)
        if graph_mode == "compile":
            reports = [r.getMessage() for r in caplog.records if "programs are compiled whole" in r.getMessage()]
            assert "the forward under autocast('cpu', torch." in reports[0], reports
        runs[graph_mode] = (flat(model.net), trainer)
    return runs


@pytest.mark.parametrize("steps", [1, 4])
def test_bf16_mixed_fit_matches_the_eager_sink_fit_and_a_plain_autocast_loop(steps, caplog):
    runs = fit_both(steps, dataset(), caplog, precision="bf16-mixed")
    (compiled, trainer), (eager, eager_trainer) = runs["compile"], runs["eager"]
    reference, fp32_reference = Net("adamw").net, Net("adamw").net
    expected = plain_autocast_loop(reference, SINK * EPOCHS, steps, dataset(), torch.bfloat16)
    plain_autocast_loop(fp32_reference, SINK * EPOCHS, steps, dataset(), None)
    assert trainer.global_step == eager_trainer.global_step == expected["updates"]
    assert relative_error(compiled, eager) <= TOLERANCE
    assert relative_error(compiled, flat(reference)) <= TOLERANCE
    assert relative_error(compiled, flat(fp32_reference)) > 100 * TOLERANCE  # the tolerance would see no autocast


@pytest.mark.parametrize("steps", [1, 4])
def test_fp16_loss_scaled_fit_skips_the_windows_the_eager_fit_and_the_plain_loop_skip(steps, caplog):
    """LossScalePrecision("16-mixed") on the CPU: sample 5 holds an inf (its micro-batch overflows each pass), and
    the first scale, 2**20, overflows fp16's range in the backward (not fp32's) until it has halved enough."""
    poisoned = dataset(poison_at=(5,))
    scales = []

    def plugins() -> list[LossScalePrecision]:
        scales.append(LossScalePrecision("16-mixed", DynamicLossScale(init_scale=2.0**20), device="cpu"))
        return [scales[-1]]

    runs = fit_both(steps, poisoned, caplog, plugins)
    (compiled, trainer), (eager, eager_trainer) = runs["compile"], runs["eager"]
    reference = Net("adamw").net
    expected = plain_autocast_loop(reference, SINK * EPOCHS, steps, poisoned, torch.float16, scale=2.0**20)
    in_fp32 = plain_autocast_loop(Net("adamw").net, SINK * EPOCHS, steps, poisoned, None, scale=2.0**20)
    assert expected["skipped"] > in_fp32["skipped"] >= 3 and expected["updates"] >= 3  # fp16 overflows, injected too
    eager_scaler, scaler = scales[0], scales[1]
    assert scaler.skipped_updates == eager_scaler.skipped_updates == expected["skipped"]
    assert scaler.scale == eager_scaler.scale == expected["scale"]
    assert trainer.global_step == eager_trainer.global_step  # skipped windows count as Lightning counts them
    assert relative_error(compiled, eager) <= TOLERANCE
    assert relative_error(compiled, flat(reference)) <= TOLERANCE


@pytest.mark.slow
def test_lightning_16_mixed_plugin_runs_as_the_device_loss_scale_in_the_programs(caplog):
    """Lightning's MixedPrecision("16-mixed") checks torch's GradScaler on the host each step; the sink strategies
    run it as LossScalePrecision("16-mixed", DynamicLossScale()) (the same rule, on the device), which the programs
    build."""
    runs = fit_both(4, dataset(), caplog, lambda: [MixedPrecision("16-mixed", "cpu")])
    (compiled, trainer), (eager, _) = runs["compile"], runs["eager"]
    assert isinstance(trainer.strategy.precision_plugin, LossScalePrecision)
    reference = Net("adamw").net
    expected = plain_autocast_loop(reference, SINK * EPOCHS, 4, dataset(), torch.float16, scale=2.0**16)
    assert trainer.global_step == expected["updates"]
    assert relative_error(compiled, eager) <= TOLERANCE
    assert relative_error(compiled, flat(reference)) <= TOLERANCE


@pytest.mark.parametrize("dtype, loss_scale", [(torch.bfloat16, None), (torch.float16, FixedLossScale(2.0**10))])
def test_a_program_forward_and_backward_under_autocast_are_eager_autocast_bit_for_bit(dtype, loss_scale):
    """The window's sum after accumulate calls, and each loss and logged value, against eager autocast forwards
    and backwards (``aot_eager``: the compiled graph run by eager kernels)."""
    module, batches = Classifier(), make_batches(3)
    reference = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    programs = build_step_programs(
        module,
        optimizer,
        batches[0],
        ProgramSettings(
            loss_scale=loss_scale, backend="aot_eager", autocast=AutocastRegion("cpu", dtype, cache_enabled=False)
        ),
    )
    assert not isinstance(programs, Unavailable), programs
    scale = 1.0 if loss_scale is None else loss_scale.loss_scale
    for batch in batches:
        out = programs.accumulate(batch)
        with torch.autocast("cpu", dtype=dtype, cache_enabled=False):
            loss, mean = reference.loss(batch)
        (loss * scale).backward()
        assert torch.equal(out.loss, loss.detach())
        assert torch.equal(out.logs["logits_mean"], mean.detach())
    for buffer, param in zip(programs.window.buffers, reference.parameters()):
        assert torch.equal(buffer, param.grad)
    without = Classifier()
    (F.cross_entropy(without.net(batches[0][0]), batches[0][1]) * scale).backward()
    assert not torch.equal(without.net[0].weight.grad, reference.net[0].weight.grad)  # autocast did change them


def test_which_plugins_the_programs_build_an_autocast_region_for():
    no_cache = {"cache_enabled": False}  # Lightning's MixedPrecision enters autocast without its weight cache
    assert step_autocast(Precision()) is None
    assert step_autocast(LossScalePrecision("32-true")) is None
    assert step_autocast(MixedPrecision("bf16-mixed", "cpu")) == AutocastRegion("cpu", torch.bfloat16, **no_cache)
    region = step_autocast(LossScalePrecision("16-mixed", device="cpu"))
    assert region == AutocastRegion("cpu", torch.float16, **no_cache)
    region = step_autocast(LossScalePrecision("bf16-mixed", device="cpu"))
    assert region == AutocastRegion("cpu", torch.bfloat16, **no_cache)

    class OwnContext(MixedPrecision):
        def forward_context(self) -> Any:
            return super().forward_context()

    for plugin in (HalfPrecision("bf16-true"), LossScalePrecision("16-true"), OwnContext("bf16-mixed", "cpu")):
        reason = step_autocast(plugin)
        assert isinstance(reason, str) and "context other than autocast" in reason and "graph_mode='eager'" in reason


def test_bad_autocast_settings_are_refused_naming_the_argument():
    with pytest.raises(ValueError, match="dtype=torch.float32 is not valid"):
        AutocastRegion("cpu", torch.float32)
    with pytest.raises(ValueError, match="device_type='tpu' is not valid"):
        AutocastRegion("tpu", torch.bfloat16)
    with pytest.raises(ValueError, match="autocast='bf16' is not valid"):
        build_step_programs(
            Classifier(), torch.optim.SGD(Classifier().parameters(), lr=0.1), None, ProgramSettings(autocast="bf16")
        )


class NormedNet(pl.LightningModule):
    """LayerNorm and GELU: operations Inductor fuses, whose bf16 results eager rounds between its kernels."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.slow
def test_inductor_programs_round_bf16_as_eager_autocast_does():
    """With Inductor (not ``aot_eager``): its fused kernels kept fp32 between a bf16 autocast's operations, which
    trained about 2e-4 (relative 5e-4) away from eager's bf16 in these 56 micro-batches; it rounds as eager now
    (``emulate_precision_casts``)."""
    params = {}
    for graph_mode in ("eager", "compile"):
        torch.manual_seed(1)
        model = NormedNet()
        trainer = trainer_for(graph_mode, 2, 14, 4, precision="bf16-mixed")
        trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=MICRO))
        params[graph_mode] = flat(model.net)
    assert relative_error(params["compile"], params["eager"]) <= TOLERANCE
