"""How weights are stored and computed: precision plugins and the quantized-format registry.

Every module of this package is imported here, so a module that registers a format (``register_format``) is
found by dropping it in this folder: no import to add anywhere (docs/extending.md).
"""

import importlib
import pkgutil

from lightning_hbm.precision import bnb as _bnb  # noqa: F401  (registers the bitsandbytes modes first)
from lightning_hbm.precision import int8_dynamic as _int8_dynamic  # noqa: F401  (registers int8-dynamic)
from lightning_hbm.precision.plugin import QuantizedPrecision, precision_plugin
from lightning_hbm.precision.quantize import quantize_model
from lightning_hbm.precision.registry import (
    QuantFormat,
    QuantMode,
    available_precisions,
    format_of,
    get_mode,
    register_format,
    register_mode,
    to_dtype,
)

for _module in pkgutil.iter_modules(__path__):  # the other formats, each in its own file
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "QuantFormat",
    "QuantMode",
    "QuantizedPrecision",
    "available_precisions",
    "format_of",
    "get_mode",
    "precision_plugin",
    "quantize_model",
    "register_format",
    "register_mode",
    "to_dtype",
]
