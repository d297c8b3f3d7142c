"""Deprecated module path: :mod:`lightning_hbm.precision.read_layers` holds the sensitivity-aware choice's view of
layers whose weight the model's code reads ("plan" names the planner's, issue 54).

Importable as before: every name of the new module is read through here with a ``DeprecationWarning`` naming the new
path. Importing this module alone says nothing (the package imports every module of ``precision/``,
docs/extending.md): a name read from it does.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_hbm.precision import read_layers as _read_layers


def __getattr__(name: str) -> Any:
    if not name.startswith("__") and hasattr(_read_layers, name):
        warnings.warn(
            f"lightning_hbm.precision.read_plan is deprecated: import {name} from lightning_hbm.precision.read_layers (the same object).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_read_layers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
