"""``lightning-hbm``: Lightning's CLI, with lightning_hbm's names understood everywhere.

This module is the console script's entry point and stays light: the CLI itself (``HBMCLI``, ``PlanCLI``,
``resolve_precision``, ... in ``lightning_hbm/cli/_impl.py``, documented there and in docs/cli.md) imports
torch, Lightning and, through Lightning, transformers: seconds of CPU on an idle machine, a minute on a
loaded one. Its names are imported on first use (``from lightning_hbm.cli import HBMCLI`` works as before).
The top-level ``lightning-hbm --help`` (and a bare ``lightning-hbm``) is answered here, from the same
parser jsonargparse builds for the full CLI, without importing torch; ``lightning-hbm fit --help`` needs
the classes (its options come from their signatures) and takes the full path.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Optional

from jsonargparse import ActionConfigFile, ArgumentParser

from lightning_hbm.quiet import quieted

_DESCRIPTION = (
    "lightning_hbm: Lightning's CLI with quantized precisions (--trainer.precision nf4-dq) and short class names "
    "for lightning_hbm's callbacks. Subcommands: fit, validate, test, predict; also `lightning-hbm plan` (same "
    "options plus --budget 24GiB: predict the memory of each configuration) and `lightning-hbm report RUN_DIR` "
    "(re-render a finished run's HBMProfiler report)."
)

_EXTRA_SUBCOMMANDS = {
    "plan": "Predict each configuration's memory for this model and batch, without training (--budget 24GiB).",
    "report": "Re-render a finished run's HBMProfiler report (summary, CSV, JSON, PNG): `report RUN_DIR`.",
}

# The first docstring line of Trainer.fit/validate/test/predict, which LightningCLI shows for each subcommand
# (lightning 2.6.6); tests/test_first_hour.py checks that this help equals the full CLI's, so a Lightning
# release that rewords them fails there instead of drifting.
_LIGHTNING_SUBCOMMANDS = {
    "fit": "Runs the full optimization routine.",
    "validate": "Perform one evaluation epoch over the validation set.",
    "test": "Perform one evaluation epoch over the test set. It's separated from fit to make sure you never run on your",
    "predict": "Run inference on your data. This will call the model forward function to compute predictions. Useful to",
}

#: the arguments answered without importing the full CLI
FAST_ARGS: tuple[list[str], ...] = ([], ["-h"], ["--help"])


def top_level_parser() -> ArgumentParser:
    """The top level of the full CLI's parser (description, ``-c``, ``--print_config``, subcommands), built
    as LightningCLI builds it but without the classes behind each subcommand."""
    parser = ArgumentParser(description=_DESCRIPTION, env_prefix="PL", default_env=False, exit_on_error=False)
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format.")
    subcommands = parser.add_subcommands()
    for name, description in {**_LIGHTNING_SUBCOMMANDS, **_EXTRA_SUBCOMMANDS}.items():
        subcommands.add_subcommand(name, ArgumentParser(description=description), help=description)
    return parser


def main(args: Optional[list[str]] = None) -> int:
    """Console script ``lightning-hbm``; returns the exit status (the full CLI's :func:`lightning_hbm.cli._impl.main`).

    ``lightning-hbm``, ``-h`` and ``--help`` alone print what the full CLI prints, in a fraction of a second.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv not in FAST_ARGS:
        with quieted():  # the library noise is filtered for our own command's run, and removed after it
            return importlib.import_module("lightning_hbm.cli._impl").main(argv)
    try:
        top_level_parser().parse_args(argv)  # --help prints and exits 0, as the full CLI does
    except argparse.ArgumentError as err:  # no subcommand given: the full CLI's one line and status
        print(f"lightning-hbm: error: {err}", file=sys.stderr)
        return 2
    raise AssertionError(f"the top-level parser accepted {argv}: a subcommand is required")  # unreachable


def __getattr__(name: str) -> Any:
    """Every other name (``HBMCLI``, ``PlanCLI``, ``resolve_precision``, ...) from the full CLI, imported on first use."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("lightning_hbm.cli._impl"), name)
