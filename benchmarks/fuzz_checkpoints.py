"""The checkpoint-format fuzzer with a large budget (the suite runs a small one: tests/reshard/test_fuzz_formats.py).

    python benchmarks/fuzz_checkpoints.py [--cases 2000] [--seed 0] [--formats layout manifest ...] [--ranks-folder F]

Mutates every format read from untrusted hands (tests/fuzzing.py says which and how) and checks the oracle: a
correct result or one clean line naming the file, never a traceback, a hang or a large memory growth. The format
``dcp_ranks_metadata`` first saves a DCP folder by three gloo processes (tests/dcp_runs.py). The last line printed
is one JSON object: inputs tried per format, seconds, and every finding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fuzzing import FORMATS, fuzz  # noqa: E402  (after the repository is on the path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="mutations per format")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument(
        "--ranks-folder",
        type=Path,
        help="for dcp_ranks_metadata: a DCP folder saved by several ranks (default: save one)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz_ranks_") as scratch:
        ranks_folder = args.ranks_folder
        if "dcp_ranks_metadata" in args.formats and ranks_folder is None:
            from tests.dcp_runs import save_dcp_checkpoint
            from tests.reshard.conftest import SPEC_3

            ranks_folder = save_dcp_checkpoint(Path(scratch) / "ckpt", SPEC_3, (3,), ("dp",), seed=1, thread_count=2)
        findings = fuzz(args.seed, args.cases, tuple(args.formats), ranks_folder=ranks_folder)
    for finding in findings:
        print(f"{finding.format} case {finding.case}: {finding.problem}")
    print(
        json.dumps(
            {
                "benchmark": "fuzz_checkpoints",
                "seed": args.seed,
                "cases_per_format": args.cases,
                "formats": args.formats,
                "seconds": round(time.perf_counter() - started, 1),
                "findings": [vars(f) for f in findings],
            }
        )
    )
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
