"""Deprecated module path: :mod:`lightning_hbm.precision.quantization` holds the ``Quantization`` object ("plan" names
the planner's, issue 54).

Importable as before: every name of the new module is read through here with a ``DeprecationWarning`` naming the new
path (``QuantizationPlan``, the former name of ``Quantization``, too). Importing this module alone says nothing (the
package imports every module of ``precision/``, docs/extending.md): a name read from it does.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_hbm.precision import quantization as _quantization


def __getattr__(name: str) -> Any:
    if name == "QuantizationPlan":
        warnings.warn(
            "lightning_hbm.precision.plan.QuantizationPlan is deprecated: use lightning_hbm.precision.quantization.Quantization "
            "(the same class).",
            DeprecationWarning,
            stacklevel=2,
        )
        return _quantization.Quantization
    if not name.startswith("__") and hasattr(_quantization, name):
        warnings.warn(
            f"lightning_hbm.precision.plan is deprecated: import {name} from lightning_hbm.precision.quantization (the same object).",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_quantization, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
