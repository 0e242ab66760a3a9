#!/usr/bin/env bash
# One command for a lent GPU machine: every CUDA-only test, the GPU benchmarks and a host-sync count, each step
# bounded by `timeout`, the whole in under 7 minutes. Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # on the GPU machine
#     bash benchmarks/gpu_check.sh --dry-run  # print the steps and their time limits, run nothing
#     bash benchmarks/gpu_check.sh --cpu      # run it here: CUDA tests skip, --device cuda steps fail fast
#
# Output: everything each step printed goes to $OUT/gpu_check.log (./gpu_check_out without $OUT), the JUnit
# report of the tests to $OUT/cuda_tests.xml, and one JSON line per figure to stdout and $OUT/figures.jsonl:
# per test {"step", "test", "outcome"}, per benchmark figure {"step", "figure", "value"}, per step a summary
# {"step", "rc", "seconds", "error"?}. A step that fails or runs out of time prints its summary with the error and
# the script goes on with the next; the exit status is the number of failed steps (at most 100).
#
# Environment: PYTHON (default python3), BUDGET_S (default 410: steps left when it is spent are reported as
# skipped), PYTHONPATH gets the repository root first.
set -u

DRY_RUN=0
CPU_MODE=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY_RUN=1 ;;
        --cpu) CPU_MODE=1 ;;
        -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (valid: --dry-run, --cpu, --help)" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 2
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT_DIR=${OUT:-$ROOT/gpu_check_out}
BUDGET_S=${BUDGET_S:-410}
((DRY_RUN)) || mkdir -p "$OUT_DIR" || exit 2
LOG="$OUT_DIR/gpu_check.log"
FIGURES="$OUT_DIR/figures.jsonl"
JUNIT="$OUT_DIR/cuda_tests.xml"
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
if ((!DRY_RUN)); then
    : >"$LOG"
    : >"$FIGURES"
fi
START=$(date +%s)
FAILED=0

# Turns one step's output into JSON lines: the summary, then its figures (a benchmark's last line, flattened) or
# its tests (the JUnit report).
cat >"$SCRATCH/report.py" <<'PY'
import json, sys
import xml.etree.ElementTree as ET

step, rc, seconds, limit, kind, output = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
junit = sys.argv[7] if len(sys.argv) > 7 else ""
try:
    lines = [line.strip() for line in open(output, errors="replace") if line.strip()]
except OSError:
    lines = []
summary = {"step": step, "rc": rc, "seconds": round(seconds, 1)}
if rc in (124, 137):
    summary["error"] = f"ran past its {limit} s limit"
elif rc != 0:
    summary["error"] = (lines[-1] if lines else "no output")[:300]
records = []
if kind == "benchmark" and lines:
    # the last line is the benchmark's JSON; a run stopped early may still have printed partial JSON lines
    results = []
    for line in lines:
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, dict):
            results.append(parsed)
    if rc == 0 and not results:
        summary["error"] = "it printed no JSON line"
    figures = {}
    def flatten(prefix, value):
        if isinstance(value, dict):
            for key, inner in value.items():
                flatten(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (int, float, str, bool)) or value is None:
            figures[prefix] = value
        else:
            figures[prefix] = json.dumps(value)
    for result in results:
        flatten("", result)
    records = [{"step": step, "figure": name, "value": value} for name, value in figures.items()]
if kind == "tests" and junit:
    counts = {}
    try:
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    detail = (child.get("message") or "").splitlines()[:1]
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            record = {"step": step, "test": name, "outcome": outcome}
            if outcome != "passed" and detail:
                record["detail"] = detail[0][:300]
            records.append(record)
            counts[outcome] = counts.get(outcome, 0) + 1
    except (OSError, ET.ParseError) as error:
        summary.setdefault("error", f"no JUnit report: {error}")
    summary["tests"] = counts
for record in records + [summary]:
    print(json.dumps(record))
PY

# Keeps only the CUDA-only tests: a node id naming cuda, gpu or nccl, or a skipif whose reason does.
cat >"$SCRATCH/cuda_only.py" <<'PY'
import re

PATTERN = re.compile(r"cuda|gpu|nccl", re.IGNORECASE)


def pytest_collection_modifyitems(config, items):
    def wanted(item):
        if PATTERN.search(item.nodeid):
            return True
        return any(PATTERN.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))

    kept = [item for item in items if wanted(item)]
    config.hook.pytest_deselected(items=[item for item in items if not wanted(item)])
    items[:] = kept
PY

# Counts torch's host-synchronization warnings inside each sink (one Lightning batch) of a small fit.
cat >"$SCRATCH/sync_count.py" <<'PY'
import json, sys, warnings
import lightning.pytorch as pl
import torch
sys.path.insert(0, "benchmarks")
from common import NetClassifier, make_loader, make_model, quiet_trainer
from lightning_sink import SinkStrategy

if not torch.cuda.is_available():
    sys.exit("host-sync count: torch sees no CUDA device here")


class CountSyncs(pl.Callback):
    def __init__(self):
        self.per_sink = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.catcher = warnings.catch_warnings(record=True)
        self.caught = self.catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        torch.cuda.set_sync_debug_mode("default")
        self.catcher.__exit__(None, None, None)
        self.per_sink.append(sum("synchroniz" in str(w.message) for w in self.caught))


result = {"benchmark": "host_syncs", "sink_size": 50, "sinks": 4, "device": torch.cuda.get_device_name(0)}
for graph_mode in ("eager", "compile", "cuda_graph"):
    counter = CountSyncs()
    try:
        trainer = quiet_trainer(
            accelerator="gpu", devices=1, max_steps=200, callbacks=[counter],
            strategy=SinkStrategy(sink_size=50, graph_mode=graph_mode),
        )
        trainer.fit(NetClassifier(make_model("tiny_mlp")), make_loader("tiny_mlp"))
        # the first sink compiles and captures; the later ones are the steady state
        result[graph_mode] = {"first_sink": counter.per_sink[0], "later_sinks_max": max(counter.per_sink[1:], default=None)}
    except Exception as error:  # one mode failing must not hide the others' counts
        result[graph_mode] = {"error": f"{type(error).__name__}: {error}"[:300]}
print(json.dumps(result))
PY

# step NAME LIMIT_S KIND(tests|benchmark) COMMAND...
step() {
    local name=$1 limit=$2 kind=$3
    shift 3
    local elapsed=$(($(date +%s) - START))
    local left=$((BUDGET_S - elapsed))
    if ((DRY_RUN)); then
        echo "{\"step\": \"$name\", \"limit_s\": $limit, \"command\": \"$*\"}"
        return
    fi
    if ((left < 15)); then
        echo "{\"step\": \"$name\", \"rc\": null, \"error\": \"skipped: the ${BUDGET_S} s budget is spent\"}" | tee -a "$FIGURES"
        FAILED=$((FAILED + 1))
        return
    fi
    ((limit > left)) && limit=$left
    echo "=== $name (limit ${limit} s): $*" >>"$LOG"
    local t0 rc output="$SCRATCH/$name.out"
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "$@" >"$output" 2>&1
    rc=$?
    local seconds
    seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { print b - a }')
    cat "$output" >>"$LOG"
    echo "=== $name: rc $rc after $seconds s" >>"$LOG"
    ((rc != 0)) && FAILED=$((FAILED + 1))
    "$PYTHON" "$SCRATCH/report.py" "$name" "$rc" "$seconds" "$limit" "$kind" "$output" \
        "$([ "$kind" = tests ] && echo "$JUNIT")" | tee -a "$FIGURES" ||
        echo "{\"step\": \"$name\", \"rc\": $rc, \"error\": \"its report could not be read\"}" | tee -a "$FIGURES"
}

if ((!DRY_RUN)); then
    "$PYTHON" - <<'PY' | tee -a "$FIGURES"
import json, platform, torch
info = {"step": "machine", "torch": torch.__version__, "python": platform.python_version(), "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
print(json.dumps(info))
PY
    if ((!CPU_MODE)) && ! "$PYTHON" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
        echo '{"step": "machine", "error": "torch sees no CUDA device: the CUDA tests will skip and the --device cuda steps fail (pass --cpu to say that is intended)"}' | tee -a "$FIGURES"
    fi
fi

# 1. Every CUDA-only test (collection of the whole suite; modules needing what the machine lacks, e.g.
#    jsonargparse, are reported and passed over).
step cuda_tests 180 tests env PYTHONPATH="$SCRATCH:$PYTHONPATH" "$PYTHON" -m pytest tests -q -p no:cacheprovider \
    -p cuda_only --continue-on-collection-errors --junitxml="$JUNIT" -o junit_family=xunit1
# 2. Loop sinking side by side: eager sinks, CUDA graphs one per micro-batch and one per whole staged sink, stock
#    Lightning with and without torch.compile(mode="reduce-overhead"), the compile mode, and JAX's jit and scan (its
#    JAX part needs a jaxlib with a GPU backend, else it is skipped with the reason); each configuration prints its
#    JSON line as it finishes. Then the host syncs inside a sink, and the older GPU benchmarks, small. Steps still
#    waiting when the budget is spent are reported as skipped.
#    Stock Lightning with torch.compile goes last: on the lent machine's torch it once ran far slower than the rest.
step loop_sinking 240 benchmark "$PYTHON" benchmarks/loop_sinking.py --device cuda --repeats 3 --sink 100 \
    --configs sink_eager sink_cuda_graph sink_cuda_graph_sink sink_compile stock_lightning stock_lightning_compile
step host_syncs 40 benchmark "$PYTHON" "$SCRATCH/sync_count.py"
step compiled_step 120 benchmark "$PYTHON" benchmarks/compiled_step.py --device cuda --repeats 3 --steps 200 \
    --models tiny_mlp lenet5 --optimizers sgd --accumulation 1 --unroll 8
step sink_throughput 90 benchmark "$PYTHON" benchmarks/sink_throughput.py --device cuda --repeats 1 --steps 200
step common_path 45 benchmark "$PYTHON" benchmarks/common_path.py --device cuda --repeats 2 --steps 300 \
    --warmup 50 --sink-size 100

if ((!DRY_RUN)); then
    echo "{\"step\": \"gpu_check\", \"seconds\": $(($(date +%s) - START)), \"failed_steps\": $FAILED, \"out\": \"$OUT_DIR\"}" |
        tee -a "$FIGURES"
fi
exit $((FAILED > 100 ? 100 : FAILED))
