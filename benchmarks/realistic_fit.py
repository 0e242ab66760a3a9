"""A realistic LightningModule's whole fit, eager sinks against compiled sinks, build included.

    python benchmarks/realistic_fit.py [--micro-batches 2000] [--sink 250] [--repeats 3] [--threads 1] [--devices 1]
        [--checkpoint-every N]

The module is what a Lightning user writes for a small image classifier: a CNN with BatchNorm and two dropouts on
1x28x28 inputs (10 classes, batch 32, random data in memory, a shuffled loader), a torchmetrics ``MulticlassAccuracy``
updated in ``training_step`` and logged on step and epoch, the loss logged to the progress bar, AdamW with
``OneCycleLR`` stepped every update and sized from ``trainer.estimated_stepping_batches``, a validation loop with its
own metric after every sink (and a sanity check), a checkpoint after every sink, the TensorBoard logger. With
``--checkpoint-every N`` a second ``ModelCheckpoint(every_n_train_steps=N)`` ends a segment inside the sinks, as
such a callback does in many recipes: the calls of compiled sinks then end there too.

With ``--devices 2`` every fit runs on two gloo processes (``SinkDDPStrategy``, the same options), the training
set split between them by Lightning's ``DistributedSampler`` (each process trains half the micro-batches, ``--sink``
a sink's micro-batches per process); rank 0 reports.

Three fits per round, each in a new process (nothing compiled or cached in memory carries over), alternating:

- **eager**: ``SinkStrategy(sink_size=K)``;
- **compile, cold**: ``SinkStrategy(sink_size=K, graph_mode="compile")`` with an empty Inductor cache
  (``TORCHINDUCTOR_CACHE_DIR`` a new folder): what a first fit pays;
- **compile, cached**: the same again over the cache the cold fit left: what every later fit of the same module
  pays (by default the build loads the loop over windows the cold fit saved there, ``compiled/saved_loop.py``;
  ``LIGHTNING_SINK_SAVED_LOOP=0`` in the environment measures Inductor's cache alone).

Per fit: the whole ``trainer.fit`` in seconds; the package's own build line (``build_seconds``); the steady sinks'
median time, from which ``run_seconds`` (the fit's micro-batches at that pace) is derived, so build and run are
stated apart; the compiled graphs counted after every sink (``recompiles_after_first_sink``: graphs added after
the first sink ended); any fallback line; and the trained parameters and BatchNorm statistics, compared with the
eager fit of the same round (``max_abs_diff``, same seeds: dropout masks included). Ratios are eager over compiled
(above 1.0: compiled is faster), per round, median with min-max over the rounds. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH = 32
CLASSES = 10


def build_module() -> Any:
    """The realistic module (``realistic_module.py``: imports Lightning and torchmetrics only in the fit's own
    process)."""
    from realistic_module import RealisticCNN

    return RealisticCNN()


def loaders(micro_batches: int) -> tuple[Any, Any]:
    """The training set (one data pass is the whole fit), shuffled, and 8 validation batches."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    samples = BATCH * micro_batches
    x = torch.randn(samples, 1, 28, 28, generator=generator)
    y = torch.randint(0, CLASSES, (samples,), generator=generator)  # (the module's classes: realistic_module.py)
    train = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(1))
    val = DataLoader(TensorDataset(x[: 8 * BATCH], y[: 8 * BATCH]), batch_size=BATCH)
    return train, val


def one_fit(args: argparse.Namespace) -> dict | None:
    """One fit in this process (``args.child`` its graph mode); its figures, on rank 0 (the trained state is
    written to ``args.state``). With ``--devices 2`` Lightning's launcher runs this process again for rank 1."""
    graph_mode, micro_batches, sink, folder = args.child, args.micro_batches, args.sink, args.folder
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_sink import SinkDDPStrategy, SinkStrategy
    from lightning_sink._torch_compat import compiled_graph_count

    torch.set_num_threads(args.threads)

    from common import SinkClock

    class SinkClockAndGraphs(SinkClock):
        """Each sink's seconds and the compiled graphs counted at its end."""

        def __init__(self) -> None:
            super().__init__()
            self.graphs: list[int] = []

        def on_train_batch_end(self, *args: Any) -> None:
            super().on_train_batch_end(*args)
            self.graphs.append(compiled_graph_count())

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.addHandler(Lines())
    rank_zero.setLevel(logging.INFO)
    clock = SinkClockAndGraphs()
    options = {"graph_mode": "compile"} if graph_mode == "compile" else {}
    strategy = SinkDDPStrategy if args.devices > 1 else SinkStrategy
    step_checkpoints = []
    if args.checkpoint_every:
        every = args.checkpoint_every
        folder_of_steps = os.path.join(folder, "step_checkpoints")
        step_checkpoints.append(ModelCheckpoint(dirpath=folder_of_steps, every_n_train_steps=every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy(sink_size=sink, **options),
        max_epochs=micro_batches // sink,
        default_root_dir=folder,
        logger=TensorBoardLogger(folder, name="tb"),
        callbacks=[
            clock,
            ModelCheckpoint(dirpath=os.path.join(folder, "checkpoints"), every_n_epochs=1),
            *step_checkpoints,
        ],
        log_every_n_steps=50,
        num_sanity_val_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = build_module()
    train, val = loaders(micro_batches)
    torch.manual_seed(3)  # the dropouts' numbers: the same generator state for every fit
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        trainer.fit(module, train, val)
        fit_seconds = time.perf_counter() - start
    if trainer.global_rank != 0:
        return None
    torch.save(module.state_dict(), args.state)
    built = [line for line in lines if "compiled whole" in line]
    fallbacks = [str(w.message) for w in caught if "whole-step programs" in str(w.message)]
    steady = statistics.median(clock.seconds[1:]) if len(clock.seconds) > 1 else clock.seconds[0]
    seconds = re.findall(r"in ([0-9.]+) s\b", built[0]) if built else []
    return {
        "graph_mode": graph_mode,
        "fit_seconds": round(fit_seconds, 2),
        "build_seconds": float(seconds[0]) if seconds else None,
        "first_sink_seconds": round(clock.seconds[0], 2),
        "steady_sink_seconds": round(steady, 3),
        "run_seconds": round(steady * len(clock.seconds), 2),
        "sinks": len(clock.seconds),
        "recompiles_after_first_sink": clock.graphs[-1] - clock.graphs[0],
        "fallbacks": fallbacks,
        "build_line": built[0] if built else None,
    }


def run_child(graph_mode: str, args: argparse.Namespace, cache: str | None, state_file: str) -> dict:
    """``one_fit`` in a new process (with ``cache`` as Inductor's cache folder); its JSON line."""
    env = dict(os.environ)
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    with tempfile.TemporaryDirectory() as folder:
        command = [
            sys.executable,
            __file__,
            "--child",
            graph_mode,
            "--micro-batches",
            str(args.micro_batches),
            "--sink",
            str(args.sink),
            "--threads",
            str(args.threads),
            "--devices",
            str(args.devices),
            "--checkpoint-every",
            str(args.checkpoint_every),
            "--folder",
            folder,
            "--state",
            state_file,
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"graph_mode": graph_mode, "error": done.stderr.strip().splitlines()[-1:]}
    # (the last JSON line: with --devices 2 rank 1's process writes to the same output)
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def max_abs_diff(state_file: str, reference_file: str) -> float:
    import torch

    state, reference = torch.load(state_file), torch.load(reference_file)
    return max(float((state[name].double() - reference[name].double()).abs().max()) for name in reference)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=2000, help="micro-batches in the fit (one data pass)")
    parser.add_argument("--sink", type=int, default=250, help="sink_size (micro-batches per sink)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three fits")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every fit (per process)")
    parser.add_argument(
        "--devices", type=int, default=1, help="processes (2: SinkDDPStrategy on gloo, the data split between them)"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also a checkpoint every N updates (0: none), inside the sinks"
    )
    parser.add_argument("--child", choices=("eager", "compile"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.micro_batches % args.sink:
        parser.error(f"--micro-batches={args.micro_batches} must be a multiple of --sink={args.sink}")
    if args.child is not None:
        figures = one_fit(args)
        if figures is not None:
            print(json.dumps(figures))
        return
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        for index in range(args.repeats):
            cache = os.path.join(work, f"inductor_cache_{index}")  # empty: the cold fit fills it, the next reads it
            states = {name: os.path.join(work, f"{name}_{index}.pt") for name in ("eager", "cold", "cached")}
            fits = {
                "eager": run_child("eager", args, None, states["eager"]),
                "cold": run_child("compile", args, cache, states["cold"]),
                "cached": run_child("compile", args, cache, states["cached"]),
            }
            for name in ("cold", "cached"):
                if "error" not in fits[name] and "error" not in fits["eager"]:
                    fits[name]["max_abs_diff"] = max_abs_diff(states[name], states["eager"])
            print(json.dumps({"round": index, **fits}), file=sys.stderr)
            rounds.append(fits)
    complete = [fits for fits in rounds if all("error" not in fit for fit in fits.values())]
    summary: dict[str, Any] = {}
    for name in ("eager", "cold", "cached"):
        if complete:
            summary[name] = {
                key: spread([fits[name][key] for fits in complete])
                for key in ("fit_seconds", "run_seconds", "steady_sink_seconds")
            }
            if name != "eager":
                summary[name]["build_seconds"] = spread([fits[name]["build_seconds"] or 0.0 for fits in complete])
                summary[name]["eager_over_compiled_fit"] = spread(
                    [fits["eager"]["fit_seconds"] / fits[name]["fit_seconds"] for fits in complete]
                )
                summary[name]["eager_over_compiled_run"] = spread(
                    [fits["eager"]["run_seconds"] / fits[name]["run_seconds"] for fits in complete]
                )
    print(
        json.dumps(
            {
                "benchmark": "realistic_fit",
                "micro_batches": args.micro_batches,
                "sink_size": args.sink,
                "threads": args.threads,
                "devices": args.devices,
                "checkpoint_every": args.checkpoint_every,
                "rounds": rounds,
                "summary": summary,
            }
        )
    )


if __name__ == "__main__":
    main()
