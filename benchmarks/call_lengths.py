"""One model's compiled step programs run one micro-step per call, as calls of 8, and as one call per staged sink,
against the eager hand-written loop: the evidence for the default's call length (``compiled/call_length.py``).

    python benchmarks/call_lengths.py [--model lenet5] [--sink 64] [--repeats 7]

The same seeded model, data and optimizer (AdamW, windows of 1, batch 32, one intra-op thread, CPU) four ways, each
over the same ``--sink`` micro-batches per repeat, in one process, alternating in rotated order:

- **hand loop** (the anchor): ``zero_grad``, forward, ``cross_entropy``, ``backward``, ``step`` over pre-built batches;
- **one per call**: ``build_step_programs(..., micro_steps_per_call=1)``, ``update(batch)`` per micro-step (the
  batches given as arguments, as the loader path gives them);
- **calls of 8**: ``micro_steps_per_call=8``, ``run_several(batches)`` per 8 micro-steps (one loop over 8 windows,
  the batches stacked from the loader path's);
- **one call per sink**: the dataset staged (``DeviceDataset``), ``micro_steps_per_call=--sink``, one
  ``run_several`` per sink gathering its batches from the sink's indices (the staged path's whole-sink call).

Programs only (no Lightning, no host effects per micro-batch): what the call's length changes. Every configuration
is compared with the hand loop's parameters at the end (``relative_diff``, the norm of the difference over the
hand loop's: the compiled kernels round differently, and AdamW over many steps of random data carries that on) and
the compiled ones with each other (``compiled_equal``: bit for bit). Per-step medians in microseconds, ratios to the hand loop per
repeat (median, min, max), build seconds (Inductor's caches as this machine has them). The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_step import BATCH, Classifier, make_data, make_optimizer, spread

from lightning_sink.compiled import ProgramSettings, StepPrograms, build_step_programs
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices

from common import MODELS, make_model, plain_torch_cuda_check

CPU = torch.device("cpu")


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().reshape(-1) for param in module.parameters()])


def seeded_classifier(model_name: str) -> Classifier:
    torch.manual_seed(0)
    return Classifier(make_model(model_name))


def built(model_name: str, example: object, **options: object) -> tuple[Classifier, StepPrograms, float]:
    module = seeded_classifier(model_name)
    start = time.perf_counter()
    programs = build_step_programs(
        module, make_optimizer("adamw", module.parameters()), example, ProgramSettings(**options)
    )
    if not isinstance(programs, StepPrograms):
        raise RuntimeError(f"the programs did not build: {programs}")
    return module, programs, time.perf_counter() - start


def configurations(model_name: str, sink: int) -> tuple[dict[str, Callable[[], None]], dict, dict]:
    """Each configuration's run over one sink, the modules they train, and the build seconds."""
    data = make_data(model_name, sink)
    rows = torch.arange(sink * BATCH).view(sink, BATCH)
    batches = [(data.tensors[0][row], data.tensors[1][row]) for row in rows]

    hand = seeded_classifier(model_name)
    hand_optimizer = make_optimizer("adamw", hand.parameters())

    @plain_torch_cuda_check()
    def hand_loop() -> None:
        for x, y in batches:
            hand_optimizer.zero_grad()
            F.cross_entropy(hand.net(x), y).backward()
            hand_optimizer.step()

    one_module, one, one_build = built(model_name, batches[0], micro_steps_per_call=1)
    eight_module, eight, eight_build = built(model_name, batches[0], micro_steps_per_call=8)
    sink_indices = SinkIndices(capacity=sink, batch_size=BATCH, device=CPU)
    staged = DeviceDataset.stage(data, CPU, budget_bytes=2**40)
    assert isinstance(staged, DeviceDataset)
    sink_module, whole, sink_build = built(model_name, None, data=(staged, sink_indices), micro_steps_per_call=sink)

    def one_per_call() -> None:
        for batch in batches:
            one.update(batch)

    def calls_of_8() -> None:
        for start in range(0, sink, 8):
            eight.run_several(batches[start : start + 8])

    def one_call_per_sink() -> None:
        sink_indices.load(rows)
        whole.run_several(None, None, count=sink)

    runs = {
        "hand_loop": hand_loop,
        "one_per_call": one_per_call,
        "calls_of_8": calls_of_8,
        "one_call_per_sink": one_call_per_sink,
    }
    modules = {
        "hand_loop": hand,
        "one_per_call": one_module,
        "calls_of_8": eight_module,
        "one_call_per_sink": sink_module,
    }
    builds = {"one_per_call": one_build, "calls_of_8": eight_build, "one_call_per_sink": sink_build}
    return runs, modules, builds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="lenet5")
    parser.add_argument("--sink", type=int, default=64, help="micro-batches per repeat (a multiple of 8)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    if args.sink % 8:
        parser.error(f"--sink={args.sink} is not a multiple of 8")
    torch.set_num_threads(1)
    runs, modules, builds = configurations(args.model, args.sink)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]  # rotated: no fixed position
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) / args.sink)
    reference = flat(modules["hand_loop"])
    result: dict[str, object] = {
        "benchmark": "call_lengths",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}",
        "model": args.model,
        "sink": args.sink,
        "repeats": args.repeats,
        "hand_loop_us_per_step": round(1e6 * statistics.median(times["hand_loop"]), 1),
    }
    for name in names[1:]:
        result[name] = {
            "us_per_step": round(1e6 * statistics.median(times[name]), 1),
            "vs_hand_loop": spread([hand / ours for hand, ours in zip(times["hand_loop"], times[name])]),
            "build_seconds": round(builds[name], 1),
            "relative_diff": float((flat(modules[name]) - reference).norm() / reference.norm()),
        }
    result["compiled_equal"] = all(
        torch.equal(flat(modules[name]), flat(modules["one_per_call"])) for name in names[2:]
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
