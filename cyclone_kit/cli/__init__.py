"""The command line (argparse only): :mod:`~cyclone_kit.cli.app` parses and dispatches, one module per command.

``cyclone_kit.cli:main`` stays the console script's entry point.
"""

from cyclone_kit.cli.app import main

__all__ = ["main"]
