"""The forward-compiled ``training_step`` (``graph_mode="compile"`` without sinking, and where the whole-step programs
do not apply): ``torch.compile`` of the module's own ``training_step``, graph breaks allowed.

Two things make it train as the eager step does:

- Random numbers. AOTAutograd and Inductor replace a dropout (and ``rand``-like operators) by Inductor's own random
  kernels: the same distribution, other numbers than eager's from the same seed. On a CPU it is built with
  Inductor's ``fallback_random``, so those operators call eager's and draw the same numbers from torch's default
  generator (``RANDOM_AS_EAGER``, shared with the whole-step programs' settings).
- torchmetrics Metrics run outside TorchDynamo (``metric_calls.metrics_run_eagerly``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_sink._torch_compat import inductor_option_names
from lightning_sink.compiled.metric_calls import metrics_run_eagerly

__all__ = ["FORWARD_BACKEND", "RANDOM_AS_EAGER", "compiled_training_step", "random_as_eager"]

RANDOM_AS_EAGER = {"fallback_random": True}  # Inductor's setting: its random operators call eager's
# torch.compile's backend for the forward-compiled step (the tests set "aot_eager": no code generated, no settings)
FORWARD_BACKEND = "inductor"


def random_as_eager(device: torch.device) -> dict[str, Any]:
    """Inductor's settings that make compiled code on ``device`` draw eager's random numbers: on a CPU
    ``RANDOM_AS_EAGER`` (a setting this torch no longer has is left out); elsewhere none (on CUDA, Inductor's own
    random kernels)."""
    if device.type != "cpu":
        return {}
    known = inductor_option_names()
    return {name: value for name, value in RANDOM_AS_EAGER.items() if name in known}


def compiled_training_step(training_step: Callable[..., Any], mode: str | None = None) -> Callable[..., Any]:
    """``torch.compile(training_step, mode=mode)`` for a LightningModule's bound ``training_step``: with eager's
    random numbers on a CPU, the module's Metrics run eagerly."""
    module = getattr(training_step, "__self__", None)
    if not isinstance(module, nn.Module):
        return torch.compile(training_step, backend=FORWARD_BACKEND, mode=mode)
    first = next(iter(module.parameters()), None)
    options = {}
    if first is not None and mode is None and FORWARD_BACKEND == "inductor":
        options = random_as_eager(first.device)
    if options:  # (torch.compile takes a mode or options, not both)
        compiled = torch.compile(training_step, backend=FORWARD_BACKEND, options=options)
    else:
        compiled = torch.compile(training_step, backend=FORWARD_BACKEND, mode=mode)
    return metrics_run_eagerly(compiled, module)
