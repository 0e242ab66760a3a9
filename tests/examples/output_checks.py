"""What an example's stderr may contain: Lightning's own notices, nothing this package or its examples cause."""

from __future__ import annotations

import re

__all__ = ["unexpected_warnings"]

# ``path.py:123: message`` (Lightning's format) or ``path.py:123: UserWarning: message`` (Python's).
WARNING_LINE = re.compile(r"^(?P<file>\S+\.py):\d+: (?P<message>.*)$", re.MULTILINE)
# Printed by stock Lightning for the same runs, whatever the strategy or plugin.
LIGHTNING_NOTICES = (
    "`isinstance(treespec, LeafSpec)` is deprecated",  # Lightning 2.6's own pytree helper on torch 2.14
    "Using `DistributedSampler` with the dataloaders. During `trainer.test()`",  # a sharded model tests on its mesh
    # The summary sizes parameters by a table without the "-mixed" names; stock MixedPrecision("16-mixed") prints it.
    "Precision 16-mixed is not supported by the model summary",
    # Lightning's advice on a machine of more than 2 cores for a loader without workers (the examples' data is in
    # memory, where workers would only add start-up and copies); a 16-core machine printed it for the test loader.
    *(f"The '{stage}_dataloader' does not have many workers" for stage in ("train", "val", "test")),
)
# Lightning's informational line when a checkpoint is saved without saying whether it holds weights only.
WEIGHTS_ONLY_UNSET = "`weights_only` was not set"


def unexpected_warnings(output: str) -> list[str]:
    """Warning lines that are not one of Lightning's own notices, and any unset-``weights_only`` save."""
    found = [
        match.group(0)
        for match in WARNING_LINE.finditer(output)
        if not match.group("message").startswith(LIGHTNING_NOTICES)
    ]
    return found + [line for line in output.splitlines() if WEIGHTS_ONLY_UNSET in line]
