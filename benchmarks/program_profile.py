"""Where one compiled call of several micro-steps spends its time on a CPU, against the step's FLOP floor.

    python benchmarks/program_profile.py [--model tiny_mlp] [--optimizer adamw] [--calls 8] [--rounds 200]

Builds the step programs the default would build for the model (``micro_steps_per_call=8`` for the tiny MLP: 8
AdamW updates, windows of 1, in one call: a loop over its windows; Inductor, one intra-op thread) with Inductor's kernel
profiler on (each generated C++ kernel records itself), runs ``--rounds`` warm calls under ``torch.profiler``, and
sorts the self time of what ran into:

- ``gemm``: the matrix multiplies Inductor leaves to ATen/oneDNN (``aten::mm``, ``addmm``, ``bmm``, ``mkldnn``);
- ``generated``: Inductor's generated kernels: the forward's and backward's elementwise work and reductions, and
  the optimizer's update, which Inductor fuses into the same kernels (a kernel's name lists the operations it
  fuses: the backward's and AdamW's ``lerp``/``sqrt`` side by side), so the two cannot be told apart by kernel;
- ``copies``: ``aten::copy_`` and the like outside the generated kernels (state written back);
- ``other_ops``: any other ATen operator;
- ``outside_ops``: the rest of the call's wall time: TorchDynamo's entry and guards, AOTAutograd's wrappers, the
  generated wrapper's own code, the library's Python around the call.

Each is given per micro-step, twice: for the programs as the library builds them (Inductor's C++ wrapper calls
ATen's matrix multiplies directly, so the profiler does not see them: they are in ``outside_ops``), and for the same
programs built with Inductor's Python wrapper, where they are ATen calls (``gemm``). The floor is the micro-step's FLOPs (its matrix multiplies, counted by
``StepPrograms.micro_step_flops``) at this core's peak, measured here as the best of several 1024x1024 float32
matrix multiplies on one thread. The wall time per micro-step without the profiler is measured for both builds,
alternating in one process (``--repeats``; the profiler adds its own cost to every recorded operator): median,
min, max, and the Python wrapper's time over the library's per repeat. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_step import BATCH, build_with_inductor_options, make_data, spread

from lightning_sink.compiled import StepPrograms, program_compile

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
COPY_OPS = ("aten::copy_", "aten::clone", "aten::_to_copy")
CATEGORIES = ("gemm", "generated", "copies", "other_ops")


def peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of ``repeats`` float32 ``size`` x ``size`` matrix multiplies on this thread."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def category(name: str) -> str:
    if name.startswith(GEMM_OPS) or "mkldnn" in name or "onednn" in name:
        return "gemm"
    if "cpp_fused" in name or name.startswith("kernel_cpp"):
        return "generated"
    if name.startswith(COPY_OPS):
        return "copies"
    if name.startswith("aten::"):
        return "other_ops"
    return "ignored"  # record_function scopes that contain the rest (their self time is counted as outside_ops)


def build(model_name: str, optimizer_name: str, calls: int, example: Any, cpp_wrapper: bool) -> StepPrograms:
    """The programs as the library builds them (``cpp_wrapper=True``), or with Inductor's Python wrapper, where
    the matrix multiplies are ATen calls the profiler records."""
    library = program_compile.inductor_options

    def python_wrapper(device: torch.device) -> dict[str, Any]:
        return {**(library(device) or {}), "cpp_wrapper": False}

    return build_with_inductor_options(
        model_name, optimizer_name, example, calls, None if cpp_wrapper else python_wrapper
    )


def breakdown(programs: StepPrograms, batches: list[Any], rounds: int) -> dict[str, Any]:
    """Self time per micro-step by category (module docstring) over ``rounds`` profiled warm calls."""
    for _ in range(20):
        programs.run_several(batches)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(rounds):
            programs.run_several(batches)
        wall = time.perf_counter() - start
    micro_steps = rounds * len(batches)
    self_us: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = category(event.key)
        if kind != "ignored":
            self_us[kind] += event.self_cpu_time_total
            kernels[event.key] += event.self_cpu_time_total
    per_step = {kind: self_us[kind] / micro_steps for kind in CATEGORIES}
    per_step["outside_ops"] = wall * 1e6 / micro_steps - sum(per_step.values())
    top = sorted(kernels.items(), key=lambda item: -item[1])[:10]
    return {
        "profiled_micro_step_us": round(wall * 1e6 / micro_steps, 1),
        "breakdown_us": {kind: round(value, 1) for kind, value in per_step.items()},
        "top_us": {name[:90]: round(us / micro_steps, 2) for name, us in top},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_mlp", choices=("tiny_mlp", "lenet5"))
    parser.add_argument("--optimizer", default="adamw", choices=("sgd", "adamw"))
    parser.add_argument("--calls", type=int, default=8, help="micro-steps per call (windows of 1)")
    parser.add_argument("--rounds", type=int, default=200, help="warm calls profiled (and timed without profiler)")
    parser.add_argument("--repeats", type=int, default=9, help="alternating timed repeats of --rounds calls each")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config  # (a benchmark's own knob: each kernel records itself)

    inductor_config.cpp.enable_kernel_profile = True
    data = make_data(args.model, args.calls)
    inputs, targets = data.tensors
    batches = [(inputs[i * BATCH : (i + 1) * BATCH], targets[i * BATCH : (i + 1) * BATCH]) for i in range(args.calls)]
    start = time.perf_counter()
    programs = build(args.model, args.optimizer, args.calls, batches[0], cpp_wrapper=True)
    build_seconds = time.perf_counter() - start
    flops = programs.micro_step_flops(batches[0])
    wrapped = build(args.model, args.optimizer, args.calls, batches[0], cpp_wrapper=False)
    library, python_wrapper = breakdown(programs, batches, args.rounds), breakdown(wrapped, batches, args.rounds)
    times: dict[str, list[float]] = {"library": [], "python_wrapper": []}
    for repeat in range(args.repeats):  # alternating, the order swapped every repeat
        pairs = [("library", programs), ("python_wrapper", wrapped)]
        for name, timed_programs in pairs if repeat % 2 == 0 else pairs[::-1]:
            start = time.perf_counter()
            for _ in range(args.rounds):
                timed_programs.run_several(batches)
            times[name].append((time.perf_counter() - start) / (args.rounds * args.calls) * 1e6)
    ratios = [wrapper / own for own, wrapper in zip(times["library"], times["python_wrapper"])]
    peak = peak_flops()
    result = {
        "benchmark": "program_profile",
        "model": args.model,
        "optimizer": args.optimizer,
        "micro_steps_per_call": args.calls,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "build_seconds": round(build_seconds, 1),
        "micro_step_us": {name: spread(values) for name, values in times.items()},
        "python_wrapper_over_library": spread(ratios),
        "library_settings": library,
        "python_wrapper": python_wrapper,
        "micro_step_mflop": round(flops / 1e6, 3),
        "peak_gflops_one_thread": round(peak / 1e9, 1),
        "floor_us": round(flops / peak * 1e6, 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
