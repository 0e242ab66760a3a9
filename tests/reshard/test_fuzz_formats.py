"""The in-suite fuzzer (issue 31, item 5; issue 40, item 2): a fixed seed and a small budget of mutations of every
format read from untrusted hands (layout, manifest, rank file with a re-signed manifest, DCP ``.metadata`` and
storage file, the ``SAVE_DIGESTS.json`` of a DCP folder this package saved, and the ``.metadata`` of a DCP folder
saved by three ranks). Each mutated input gives a correct result (a conversion's output then passes ``verify``) or
one clean line naming the file: never a traceback, a hang or a memory growth beyond a bound (the files are a few
KiB). ``benchmarks/fuzz_checkpoints.py`` runs the same with a larger budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fuzzing import FORMATS, fuzz

CASES_PER_FORMAT = 60  # about 15 s on the project's CPU machine for the six formats of one-rank fixtures
RANKS_CASES = 300  # most mutations are refused while parsing (a few ms each); a few convert and are verified


@pytest.mark.parametrize("seed", [20261126])
def test_mutated_checkpoint_files_are_refused_cleanly_or_read_correctly(seed: int):
    formats = tuple(kind for kind in FORMATS if kind != "dcp_ranks_metadata")
    findings = fuzz(seed, CASES_PER_FORMAT, formats)
    assert findings == [], "\n".join(f"{f.format} case {f.case}: {f.problem}" for f in findings[:20])


@pytest.mark.parametrize("seed", [20261128])
def test_mutated_metadata_of_a_save_by_several_ranks(source_3: Path, seed: int):
    """The 3-rank save's ``.metadata`` (a changed byte gave a KeyError traceback, a memo of gigabytes, an output
    that verify refused)."""
    findings = fuzz(seed, RANKS_CASES, ("dcp_ranks_metadata",), ranks_folder=source_3)
    assert findings == [], "\n".join(f"{f.format} case {f.case}: {f.problem}" for f in findings[:20])
