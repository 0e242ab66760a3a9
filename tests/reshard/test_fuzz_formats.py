"""The in-suite fuzzer (issue 31, item 5): a fixed seed and a small budget of mutations of every format read from
untrusted hands (layout, manifest, rank file with a re-signed manifest, DCP ``.metadata`` and storage file, the
``SAVE_DIGESTS.json`` of a DCP folder this package saved). Each
mutated input gives a correct result or one clean line naming the file: never a traceback, a hang or a large
memory growth. ``benchmarks/fuzz_checkpoints.py`` runs the same with a larger budget."""

from __future__ import annotations

import pytest

from tests.fuzzing import FORMATS, fuzz

CASES_PER_FORMAT = 60  # about 15 s on the project's CPU machine for all six formats


@pytest.mark.parametrize("seed", [20261126])
def test_mutated_checkpoint_files_are_refused_cleanly_or_read_correctly(seed: int):
    findings = fuzz(seed, CASES_PER_FORMAT, FORMATS)
    assert findings == [], "\n".join(f"{f.format} case {f.case}: {f.problem}" for f in findings[:20])
