"""Graph sinking: how the step programs' forward and backward run (MindSpore's whole-step graphs).

In sink mode, ``"compile"`` and ``"cuda_graph"`` first try the whole-step compiled programs
(``sink/programs/compiled_choice.py``); what follows is the path they fall back to, and the one without sinking.

``"eager"`` runs the LightningModule's ``training_step`` as written. ``"compile"`` compiles it with ``torch.compile``:
TorchDynamo captures the forward, AOTAutograd derives the backward, and Inductor generates one forward and one
backward graph (``self.log`` calls and other Python side effects become graph breaks and run eagerly). Both step
programs run the same forward and backward, so they share those two graphs; what differs between them (the fp32
accumulation, and the update's single reduction, unscale and optimizer step) is already a handful of flat-tensor
or fused/foreach kernels and stays eager: compiling ``optimizer.step`` would recompile whenever an LR scheduler
changes a float learning rate. ``"cuda_graph"`` compiles with ``mode="reduce-overhead"``, so that Inductor
captures both graphs as CUDA graphs and replays them from static input buffers (it copies each batch into them);
the loss scale and overflow flags are device tensors already, so nothing in a window needs the host. A replay
overwrites the previous replay's outputs, so the step's outputs are copied out of the graph's buffers each
micro-step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import Tensor

from lightning_sink.compiled.forward_compile import compiled_training_step

__all__ = ["GRAPH_MODES", "validate_graph_mode", "check_graph_mode_device", "step_function"]

GRAPH_MODES = ("eager", "compile", "cuda_graph")


def validate_graph_mode(graph_mode: object) -> None:
    if graph_mode not in GRAPH_MODES:
        raise ValueError(f"graph_mode={graph_mode!r} is not valid: choose one of {', '.join(map(repr, GRAPH_MODES))}.")
    if graph_mode == "cuda_graph" and not torch.cuda.is_available():
        raise ValueError(
            "graph_mode='cuda_graph' captures the step programs as CUDA graphs and needs a CUDA device, but CUDA is"
            " not available here: use graph_mode='compile' (torch.compile, CPU or GPU) or 'eager'."
        )


def check_graph_mode_device(graph_mode: str, device: torch.device) -> None:
    """A CUDA machine can still train on the CPU; CUDA graphs cannot."""
    if graph_mode == "cuda_graph" and device.type != "cuda":
        raise ValueError(
            f"graph_mode='cuda_graph' needs the model on a CUDA device, but this run trains on {device}: use"
            " Trainer(accelerator='gpu'), or graph_mode='compile' or 'eager' on this device."
        )


def step_function(training_step: Callable[..., Any], graph_mode: str) -> Callable[..., Any]:
    """What the step programs call for the forward (and, through autograd, the backward) of one micro-batch."""
    if graph_mode == "eager":
        return training_step
    if graph_mode == "compile":
        return compiled_training_step(training_step)  # (eager's random numbers on a CPU; Metrics run eagerly)
    return _outputs_outlive_the_next_replay(compiled_training_step(training_step, mode="reduce-overhead"))


def _outputs_outlive_the_next_replay(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """A CUDA graph replays into the same output buffers, but a sink keeps every micro-step's loss (and whatever
    else ``training_step`` returns) until its end: each output is copied out of the graph's buffers (one small copy
    a micro-step; the copy keeps the autograd link, so the backward is unchanged) before the next replay starts."""

    def step(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return apply_to_collection(compiled(*args, **kwargs), Tensor, Tensor.clone)

    return step
