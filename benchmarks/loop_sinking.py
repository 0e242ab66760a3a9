"""Loop sinking side by side: what a user can run for the same training, per step, in one invocation.

    python benchmarks/loop_sinking.py [--sink 500] [--repeats 5] [--models tiny_mlp lenet5] [--device cpu|cuda]

Same model, data and optimizer everywhere: the tiny MLP 64-64-10 or LeNet-5 on 1x32x32 (the project's LeNet-5, as
``common.make_model`` builds it: MNIST at the 32x32 of its recipe), batch 32, AdamW (torch's defaults: ``lr=1e-3,
betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2``), ``--sink`` micro-batches of random data per sink, read in order.

- **hand loop** (the anchor): the eager hand-written PyTorch loop over the batches pre-built on the device;
- **stock Lightning**, quiet (no logger, progress bar, checkpoints), one epoch of ``--sink`` batches per timing;
- **stock Lightning + ``torch.compile(model)``** (the module compiled as Lightning takes it; on CUDA with
  ``mode="reduce-overhead"``, the CUDA graphs a Lightning user would turn on there);
- **sink eager**: ``SinkStrategy(sink_size=K)``, eager sinks;
- **sink compile**: ``SinkStrategy(sink_size=K, graph_mode="compile")`` and nothing else set (the package's
  defaults decide the rest), and the same with a **warm-up + cosine step scheduler** (``LambdaLR``,
  ``interval="step"``, linear warm-up over the first 5% of the steps, then cosine to zero, sized from
  ``trainer.estimated_stepping_batches``), and that scheduled fit with **``micro_steps_per_call=8``** (the
  scheduler's values for each update inside a call: not a default, the knob as a user sets it today);
- on ``--device cuda`` only, **sink CUDA graph**: ``SinkStrategy(sink_size=K, graph_mode="cuda_graph")`` (its
  defaults: one captured program per micro-batch), and **sink CUDA graph, whole sink**: the same with
  ``micro_steps_per_call=K`` (the staged sink's K micro-steps captured as one CUDA graph, one replay per sink);
- with the optional ``anchors`` extra (``pip install lightning-sink[anchors]``: ``jax``, ``optax``): the same
  network in JAX (its parameters copied from the torch model's, the first batch's loss checked against torch's), the
  same data shapes, ``optax.adamw`` with the torch optimizer's own ``lr``/``betas``/``eps``/``weight_decay``:
  **JAX jit per step** (one compiled call per step) and **JAX scan per sink** (``jax.lax.scan`` over the sink's K
  steps: one compiled call per sink). Without jax the two are skipped and the JSON says why. On ``--device cuda``
  they run on JAX's GPU when jaxlib has one (the CPU wheel has none: skipped, with the reason).

Each Lightning configuration is one fit of ``1 + repeats`` sinks (stock: epochs); every sink is timed from its
start to its end hook and a hand-loop run of ``--sink`` micro-batches follows it, outside the timing
(``compiled_fit.Paired``), so each figure has an anchor measured next to it. The JAX configurations alternate with a
hand-loop run in rotated order, ``repeats`` rounds. Per-step times are medians over the repeats; each ratio to the
hand loop (above 1.0: faster than it) is per pair, median with its min-max over the repeats. Build times are apart
from the per-step times: ``build_seconds`` is the first sink's time minus a steady sink's (compilation and first-call
costs), JAX's is its ``jit(...).lower(...).compile()``; ``reported_build_seconds`` is the package's own line. A
configuration that fails reports its error and the others go on. Each configuration's figures go to stderr as a
JSON line when it ends (a run stopped early keeps them); the last line of stdout is one JSON object.

Fairness on a CPU: every framework on one thread. torch: ``torch.set_num_threads(1)`` (``--threads``). JAX:
``XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"``, set before jax is imported;
``cpu_over_wall`` (process CPU time over wall time of a timed JAX sink) shows whether it held (at most about 1.0).
The flags do not hold JAX's runtime to one thread (its dispatch runs beside the Python thread: ``cpu_over_wall``
up to 1.9 on two cores), so with ``--threads 1`` the whole process is also kept on one core (``--cores``, every
thread's affinity; ``--cores 0``: not pinned): each framework then has one core, as torch's one thread has.
On CUDA, JAX allocates GPU memory as it needs it (``XLA_PYTHON_CLIENT_PREALLOCATE=false``), as torch does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compiled_fit import BATCH, Classifier, CompileReport, HandLoop, Paired, spread

from lightning_sink import SinkStrategy

from common import MODELS, make_model, quiet_trainer, synchronize

LAYOUT = ("NCHW", "OIHW", "NCHW")  # torch's: inputs, convolution weights, outputs
ONE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
LIGHTNING_CONFIGS = (
    "stock_lightning",
    "stock_lightning_compile",
    "sink_eager",
    "sink_compile",
    "sink_compile_sched",
    "sink_compile_m8_sched",
    "sink_cuda_graph",
    "sink_cuda_graph_sink",
)
CUDA_ONLY_CONFIGS = ("sink_cuda_graph", "sink_cuda_graph_sink")


class ScheduledClassifier(Classifier):
    """AdamW with a warm-up + cosine ``LambdaLR`` stepped every optimizer step, sized from the fit's length."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        total = int(self.trainer.estimated_stepping_batches)
        warmup = max(1, total // 20)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DeviceHandLoop(HandLoop):
    """``compiled_fit.HandLoop`` (AdamW, windows of 1) on ``device``, the clock read after the device is done."""

    def __init__(self, batches: list, model: str, device: torch.device) -> None:
        super().__init__("adamw", 1, [(x.to(device), y.to(device)) for x, y in batches], model)
        self.model.to(device)
        self.device, self.times = device, []

    def run(self) -> float:
        synchronize(self.device)
        start = time.perf_counter()
        super().run()
        synchronize(self.device)
        self.times.append((time.perf_counter() - start) / len(self.batches))
        return self.times[-1]


class DevicePaired(Paired):
    """``compiled_fit.Paired`` with the clock read after the device is done at each sink's start and end."""

    def __init__(self, per: str, micro_steps: int, hand: DeviceHandLoop) -> None:
        super().__init__(per, micro_steps, hand)
        self.device = hand.device

    def _begin(self) -> None:
        synchronize(self.device)
        super()._begin()

    def _end(self) -> None:
        synchronize(self.device)
        super()._end()


def make_data(model: str, sink: int) -> TensorDataset:
    """One sink of random inputs for ``make_model(model)`` and labels, seeded."""
    shape = (64,) if model == "tiny_mlp" else (1, 32, 32)
    generator = torch.Generator().manual_seed(0)
    samples = BATCH * sink
    return TensorDataset(
        torch.randn(samples, *shape, generator=generator), torch.randint(0, 10, (samples,), generator=generator)
    )


def lightning_fit(config: str, model: str, data: TensorDataset, hand: DeviceHandLoop, repeats: int) -> Paired:
    """One fit of ``1 + repeats`` sinks (stock: epochs) of ``config``, each timed and paired with a hand-loop run."""
    sink = len(data) // BATCH
    cuda = hand.device.type == "cuda"
    scheduled = config.endswith("_sched")
    module: Any = ScheduledClassifier("adamw", model) if scheduled else Classifier("adamw", model)
    if config == "stock_lightning_compile":
        module = torch.compile(module, mode="reduce-overhead" if cuda else None)
    strategy: Any = "auto"
    if config.startswith("sink"):
        options: dict[str, Any] = {} if config == "sink_eager" else {"graph_mode": "compile"}
        if config == "sink_compile_m8_sched":
            options["micro_steps_per_call"] = 8  # the step scheduler inside calls of 8 micro-steps
        if config in CUDA_ONLY_CONFIGS:
            options["graph_mode"] = "cuda_graph"
        if config == "sink_cuda_graph_sink":
            options["micro_steps_per_call"] = sink  # the whole staged sink captured as one CUDA graph
        strategy = SinkStrategy(sink_size=sink, **options)
    timing = DevicePaired("epoch" if config.startswith("stock") else "batch", sink, hand)
    trainer = quiet_trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, max_epochs=1 + repeats, callbacks=[timing]
    )
    trainer.fit(module, DataLoader(data, batch_size=BATCH, shuffle=False))
    return timing


def measure_lightning(config: str, model: str, data: TensorDataset, hand: DeviceHandLoop, repeats: int) -> dict:
    """Per-step time, ratio to the paired hand-loop runs, build seconds, and the package's lines about the fit."""
    report = CompileReport()
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(report)
    rank_zero_logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            timing = lightning_fit(config, model, data, hand, repeats)
    finally:
        rank_zero_logger.removeHandler(report)
    steady, paired = timing.lightning[1:], timing.paired_hand[1:]
    figures: dict[str, Any] = {
        "us_per_step": round(1e6 * statistics.median(steady), 1),
        "vs_hand_loop": spread([h / t for h, t in zip(paired, steady)]),
        "build_seconds": round(max(0.0, len(data) // BATCH * (timing.lightning[0] - statistics.median(steady))), 2),
    }
    package_lines = [line for line in report.lines if "graph_mode=" in line]
    package_lines += [str(w.message) for w in caught if "graph_mode" in str(w.message)]
    if package_lines:
        figures["package_says"] = [line[:400] for line in package_lines]
        seconds = re.findall(r" in ([0-9.]+) s\b", package_lines[0])
        if seconds:
            figures["reported_build_seconds"] = float(seconds[0])
    return figures


def jax_or_reason(device: torch.device) -> tuple[Any, str | None]:
    """``(jax device, None)``, or ``(None, why the JAX configurations are skipped)``."""
    if device.type == "cpu" and "jax" not in sys.modules:  # the flags are read once, when jax starts
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONE_THREAD_XLA_FLAGS}".strip()
    if device.type == "cuda":  # JAX would take 75% of the GPU's memory at its start, leaving torch the rest
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import optax  # noqa: F401
    except ImportError as error:
        return None, f"the optional 'anchors' extra (jax, optax) is not installed: {error}"
    platform_name = "gpu" if device.type == "cuda" else "cpu"
    try:
        return jax.devices(platform_name)[0], None
    except RuntimeError as error:
        return None, f"jax has no {platform_name} backend here: {str(error).splitlines()[0]}"


def jax_network(net: nn.Module) -> tuple[Any, list]:
    """The torch network as a JAX forward over its leaf layers, in order, and a copy of its parameters."""
    import jax
    import jax.numpy as jnp

    kinds, params = [], []
    for layer in (m for m in net.modules() if not list(m.children())):
        if not isinstance(layer, (nn.Linear, nn.Conv2d, nn.ReLU, nn.MaxPool2d, nn.Flatten)):
            raise TypeError(f"no JAX counterpart for {type(layer).__name__}")
        kinds.append(type(layer).__name__)
        params.append(tuple(jnp.asarray(p.detach().cpu().numpy()) for p in layer.parameters()))

    def forward(params: list, x: Any) -> Any:
        for kind, weights in zip(kinds, params):
            if kind == "Linear":
                x = x @ weights[0].T + weights[1]
            elif kind == "Conv2d":
                x = jax.lax.conv_general_dilated(x, weights[0], (1, 1), "VALID", dimension_numbers=LAYOUT)
                x = x + weights[1][None, :, None, None]
            elif kind == "ReLU":
                x = jax.nn.relu(x)
            elif kind == "MaxPool2d":
                x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
            else:
                x = x.reshape(x.shape[0], -1)
        return x

    return forward, params


def jax_programs(model: str, example: tuple, device: Any) -> tuple[dict, Any, float]:
    """The per-step and per-sink programs, built ahead of time: ``({name: (program, seconds)}, state, loss gap)``."""
    import jax
    import optax

    net = make_model(model)
    group = torch.optim.AdamW(net.parameters()).param_groups[0]  # the hand loop's hyperparameters, read not copied
    b1, b2 = group["betas"]
    forward, params = jax_network(net)
    tx = optax.adamw(group["lr"], b1=b1, b2=b2, eps=group["eps"], weight_decay=group["weight_decay"])

    def loss_fn(params: list, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, x), y).mean()

    def step(params: list, opt_state: Any, x: Any, y: Any) -> tuple:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def sink(params: list, opt_state: Any, xs: Any, ys: Any) -> tuple:
        def body(carry: tuple, batch: tuple) -> tuple:
            new_params, new_state, loss = step(*carry, *batch)
            return (new_params, new_state), loss

        (params, opt_state), losses = jax.lax.scan(body, (params, opt_state), (xs, ys))
        return params, opt_state, losses

    params = jax.device_put(params, device)
    state = (params, jax.device_put(tx.init(params), device))
    (xs, ys), built = example, {}
    x0, y0 = jax.device_put((xs[0], ys[0]), device)
    with torch.no_grad():
        torch_loss = F.cross_entropy(net(torch.as_tensor(xs[0])), torch.as_tensor(ys[0]).long()).item()
    loss_gap = abs(float(loss_fn(state[0], x0, y0)) - torch_loss)
    for name, function, args in (("jax_jit_per_step", step, (x0, y0)), ("jax_scan_per_sink", sink, (xs, ys))):
        start = time.perf_counter()
        program = jax.jit(function, donate_argnums=(0, 1)).lower(*state, *args).compile()
        built[name] = (program, time.perf_counter() - start)
    return built, state, loss_gap


def measure_jax(model: str, data: TensorDataset, hand: DeviceHandLoop, repeats: int, device: Any) -> dict:
    """Alternating rounds of the hand loop, JAX jit per step and JAX scan per sink; medians and per-round ratios."""
    import jax

    xs = data.tensors[0].numpy().reshape(-1, BATCH, *data.tensors[0].shape[1:])
    ys = data.tensors[1].numpy().astype("int32").reshape(-1, BATCH)
    built, state, loss_gap = jax_programs(model, (xs, ys), device)
    batches = [jax.device_put((x, y), device) for x, y in zip(xs, ys)]
    staged = jax.device_put((xs, ys), device)

    def per_step(state: tuple) -> tuple:
        program = built["jax_jit_per_step"][0]
        for x, y in batches:
            state = program(*state, x, y)[:2]
        return jax.block_until_ready(state)

    def per_sink(state: tuple) -> tuple:
        return jax.block_until_ready(built["jax_scan_per_sink"][0](*state, *staged)[:2])

    runs = {"jax_jit_per_step": per_step, "jax_scan_per_sink": per_sink}
    times: dict[str, list[float]] = {name: [] for name in ("hand_loop", *runs)}
    cpu_over_wall: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():  # one untimed sink each: first-call costs
        state = run(state)
    order = ["hand_loop", *runs]
    for repeat in range(repeats):
        for name in order[repeat % 3 :] + order[: repeat % 3]:
            if name == "hand_loop":
                times[name].append(hand.run())
                continue
            start, cpu_start = time.perf_counter(), time.process_time()
            state = runs[name](state)
            wall = time.perf_counter() - start
            times[name].append(wall / len(batches))
            cpu_over_wall[name].append((time.process_time() - cpu_start) / wall)
    return {
        name: {
            "us_per_step": round(1e6 * statistics.median(times[name]), 1),
            "vs_hand_loop": spread([h / t for h, t in zip(times["hand_loop"], times[name])]),
            "build_seconds": round(built[name][1], 2),
            "cpu_over_wall": round(statistics.median(cpu_over_wall[name]), 2),
            "first_loss_minus_torch": float(f"{loss_gap:.2e}"),
        }
        for name in runs
    }


def measure_model(model: str, args: argparse.Namespace, device: torch.device, jax_device: Any) -> dict:
    data = make_data(model, args.sink)
    batches = list(zip(data.tensors[0].split(BATCH), data.tensors[1].split(BATCH)))
    hand = DeviceHandLoop(batches, model, device)
    hand.run()  # warm: allocator and caches
    figures: dict[str, Any] = {}
    for config in args.configs:
        try:
            figures[config] = measure_lightning(config, model, data, hand, args.repeats)
        except Exception as error:  # one configuration failing must not hide the others' figures
            figures[config] = {"error": f"{type(error).__name__}: {error}"[:400]}
        print(json.dumps({model: {config: figures[config]}}), file=sys.stderr, flush=True)  # a run cut short keeps it
    if jax_device is not None:
        try:
            figures.update(measure_jax(model, data, hand, args.repeats, jax_device))
        except Exception as error:
            figures["jax"] = {"error": f"{type(error).__name__}: {error}"[:400]}
        jax_figures = {name: row for name, row in figures.items() if name.startswith("jax")}
        print(json.dumps({model: jax_figures}), file=sys.stderr, flush=True)
    return {"hand_loop_us_per_step": round(1e6 * statistics.median(hand.times[1:] or hand.times), 1), **figures}


def print_table(result: dict, models: list[str]) -> None:
    """A readable table of each model's configurations before the JSON line."""
    for model in models:
        figures = result[model]
        print(f"\n{model}: hand loop {figures['hand_loop_us_per_step']} us/step")
        print(f"{'configuration':<26} {'us/step':>9} {'vs hand loop (min-max)':>24} {'build s':>8}")
        for name, row in figures.items():
            if isinstance(row, dict) and "error" in row:
                print(f"{name:<26} {row['error'][:90]}")
            elif isinstance(row, dict):
                ratio = row["vs_hand_loop"]
                text = f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
                print(f"{name:<26} {row['us_per_step']:>9.1f} {text:>24} {row['build_seconds']:>8.1f}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sink", type=int, default=500, help="micro-batches per sink (and per stock epoch)")
    parser.add_argument("--repeats", type=int, default=5, help="timed sinks per configuration")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on a CPU")
    parser.add_argument(
        "--cores", type=int, help="CPU cores the process may run on (default: --threads on a CPU; 0: not pinned)"
    )
    parser.add_argument(
        "--configs", nargs="*", choices=LIGHTNING_CONFIGS, help="default: all (on a CPU all but the CUDA-graph ones)"
    )
    parser.add_argument("--no-jax", action="store_true", help="leave out the JAX configurations")
    args = parser.parse_args(argv)
    for name in ("sink", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.cores is None:
        args.cores = args.threads if args.device == "cpu" else 0
    if not 0 <= args.cores <= len(os.sched_getaffinity(0)):
        parser.error(f"--cores must be 0 (not pinned) to {len(os.sched_getaffinity(0))}; got {args.cores}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.configs is None:
        args.configs = [c for c in LIGHTNING_CONFIGS if args.device == "cuda" or c not in CUDA_ONLY_CONFIGS]
    on_cpu = sorted(set(args.configs) & set(CUDA_ONLY_CONFIGS)) if args.device == "cpu" else []
    if on_cpu:
        parser.error(f"--configs {' '.join(on_cpu)}: CUDA graphs need --device cuda")
    return args


def pin_to_cores(count: int) -> list[int]:
    """Keep every thread of this process (those started later inherit it) on the first ``count`` allowed cores."""
    cores = sorted(os.sched_getaffinity(0))[:count]
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(thread), cores)
    return cores


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cores = pin_to_cores(args.cores) if args.cores else None
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    jax_device, skipped = (None, "--no-jax") if args.no_jax else jax_or_reason(device)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    machine = torch.cuda.get_device_name(0) if device.type == "cuda" else f"CPU, {args.threads} torch thread(s)"
    machine += f", pinned to core(s) {cores}" if cores else ", not pinned"
    result: dict[str, Any] = {
        "benchmark": "loop_sinking",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {machine}",
        "batch": BATCH,
        "sink_size": args.sink,
        "repeats": args.repeats,
        "optimizer": "AdamW(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)",
        "jax": {"device": str(jax_device)} if skipped is None else {"skipped": skipped},
    }
    if skipped is None:
        result["jax"].update(version=sys.modules["jax"].__version__, xla_flags=os.environ.get("XLA_FLAGS", ""))
    for model in args.models:
        result[model] = measure_model(model, args, device, jax_device)
    print_table(result, args.models)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
