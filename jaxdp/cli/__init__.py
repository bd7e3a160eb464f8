"""The ``jaxdp`` command line: one module per subcommand (epsilon, calibrate, grid, pnsgd, train).

Run ``jaxdp --help``. The library never imports this package.
"""

from .main import build_parser as build_parser
from .main import main as main

__all__ = ["build_parser", "main"]
