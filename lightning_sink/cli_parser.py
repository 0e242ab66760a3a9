"""An ``argparse`` parser whose refusals are one ``error: ...`` line on stderr (exit status 2), with no usage block.

A refusal is read by people and by scripts alike; argparse's default prints the whole usage text above the error,
so the one line that matters is buried and a caller parsing stderr sees several. ``--help`` still prints usage.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """Subcommand parsers made by ``add_subparsers`` are of this class too (argparse uses the parent's class)."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split())
        print(f"error: {one_line} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)
