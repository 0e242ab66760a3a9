"""What an example's test may assume about the machine: where MNIST is, if anywhere, and how long a run may take.

The examples' subprocesses run in a temporary working directory, so the only MNIST they find without ``--data-dir`` is
the one ``$LIGHTNING_SINK_DATA`` names; a test that needs MNIST passes that folder explicitly and skips without it, and a
test that runs an example with whatever data it finds expects what that data implies.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

from digits import DATA_VARIABLE, find_mnist_quietly  # noqa: E402

__all__ = ["MNIST_SKIP_REASON", "SUBPROCESS_TIMEOUT_S", "mnist_root"]

# A hung run must still end, but a loaded 2-core machine (the examples' tests run there beside other jobs) runs the
# longest example's test several times slower than an idle one: a generous bound, not a speed goal.
SUBPROCESS_TIMEOUT_S = 1800
MNIST_SKIP_REASON = f"MNIST not found: set {DATA_VARIABLE} to a folder holding MNIST/raw (torchvision's layout)"


def mnist_root() -> Path | None:
    """The folder ``$LIGHTNING_SINK_DATA`` names when it holds MNIST, else None."""
    folder = os.environ.get(DATA_VARIABLE)
    return find_mnist_quietly(folder) if folder else None
