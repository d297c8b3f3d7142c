"""How weights are stored and computed: precision plugins and the quantized-format registry.

Every module of this package is imported here, so a module that registers a format (``register_format``) is
found by dropping it in this folder: no import to add anywhere (docs/extending.md).
"""

import importlib
import pkgutil
import warnings
from typing import Any

from lightning_hbm.precision import bnb as _bnb  # noqa: F401  (registers the bitsandbytes modes first)
from lightning_hbm.precision import int8_dynamic as _int8_dynamic  # noqa: F401  (registers int8-dynamic)
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.plugin import QuantizedPrecision
from lightning_hbm.precision.targets import quantize_model
from lightning_hbm.precision.registry import (
    QuantFormat,
    available_precisions,
    format_of,
    get_format,
    register_format,
    to_dtype,
)

for _module in pkgutil.iter_modules(__path__):  # the other formats, each in its own file
    importlib.import_module(f"{__name__}.{_module.name}")


def precision_plugin(name: str, **kwargs: Any) -> QuantizedPrecision:
    """Deprecated: ``QuantizedPrecision(name, **kwargs)`` does the same (its first argument is the mode name).

    Kept working because docs of earlier releases wrote ``plugins=[precision_plugin("nf4-dq")]``.

    Raises:
        ValueError: as ``QuantizedPrecision`` (an unknown name, an unsupported dtype, ...).
    """
    warnings.warn(
        f"lightning_hbm.precision_plugin({name!r}) is deprecated: write QuantizedPrecision({name!r}) (the same plugin).",
        DeprecationWarning,
        stacklevel=2,
    )
    return QuantizedPrecision(name, **kwargs)


__all__ = [
    "QuantFormat",
    "QuantizationConfig",
    "QuantizedPrecision",
    "available_precisions",
    "format_of",
    "get_format",
    "precision_plugin",
    "quantize_model",
    "register_format",
    "to_dtype",
]
