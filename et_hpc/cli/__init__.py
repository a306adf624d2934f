"""The ``et-hpc`` command line: every argparse parser lives in this package, one module per area.

``app`` wires the areas up and holds ``main`` (the ``et-hpc`` entry point); the library below
never parses arguments or prints.
"""

from et_hpc.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
