"""Adam's bias corrections as the compiled update rule computes them (``optimizer_rules._bias_corrections``, written
as ``exp(count * log(beta))``), against torch.optim's own arithmetic: ``1 - beta ** count`` on Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_sink.compiled.optimizer_rules import _bias_corrections

# the optimizer state's step count before an update (a float32 tensor, as torch.optim keeps it on a CPU)
STEPS = [0, 1, 2, 9, 99, 999, 9_999, 99_999, 999_999, 9_999_999]


@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.999), (0.5, 0.9999), (0.0, 0.95), (0.99, 0.99999), (0.95, 0.98)])
def test_the_corrections_are_torch_optims_within_float64_rounding_and_equal_in_float32(beta1, beta2):
    hyper = {"beta1": torch.tensor(beta1, dtype=torch.float64), "beta2": torch.tensor(beta2, dtype=torch.float64)}
    corrections = _bias_corrections([torch.tensor(float(step)) for step in STEPS], hyper)
    assert corrections.shape == (2, len(STEPS)) and corrections.dtype == torch.float64
    lr = 1e-3
    for column, step in enumerate(STEPS):
        count = step + 1
        for row, beta in enumerate((beta1, beta2)):
            expected = 1 - beta**count  # torch.optim's bias correction for this update
            assert math.isclose(corrections[row, column].item(), expected, rel_tol=1e-12), (beta, count)
        # what the update multiplies by, in the parameters' float32: the same values as torch.optim's
        step_size = torch.tensor(lr / (1 - beta1**count), dtype=torch.float32)
        assert (lr / corrections[0, column]).to(torch.float32) == step_size, count
        root = torch.tensor(math.sqrt(1 - beta2**count), dtype=torch.float32)
        assert torch.sqrt(corrections[1, column]).to(torch.float32) == root, count
