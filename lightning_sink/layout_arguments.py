"""The arguments of ``lightning-sink layout``, apart from the inference itself: building the command line's parser
must not import Lightning, which the ``reshard`` and ``verify`` commands do not need."""

from __future__ import annotations

import argparse

__all__ = ["configure_parser"]


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``lightning-sink layout``."""
    parser.add_argument("--model", required=True, help="LightningModule class path, e.g. my_pkg.models.MyModel")
    parser.add_argument("--init-args", default="{}", help="JSON object of keyword arguments for the model")
    parser.add_argument("--data-parallel-size", type=int, required=True)
    parser.add_argument("--tensor-parallel-size", type=int, required=True)
    parser.add_argument("--no-optimizer", action="store_true", help="parameters only, no optimizer state")
    parser.add_argument("--output", required=True, help="the layout file to write (atomically)")
