"""How weights are stored and computed: precision plugins and the name registry."""

from lightning_hbm.precision import bnb as _bnb  # noqa: F401  (registers the bitsandbytes modes)
from lightning_hbm.precision import int8_dynamic as _int8_dynamic  # noqa: F401  (registers int8-dynamic)
from lightning_hbm.precision.plugin import QuantizedPrecision, precision_plugin, quantize_model
from lightning_hbm.precision.registry import QuantMode, available_precisions, get_mode, register_mode, to_dtype

__all__ = [
    "QuantMode",
    "QuantizedPrecision",
    "available_precisions",
    "get_mode",
    "precision_plugin",
    "quantize_model",
    "register_mode",
    "to_dtype",
]
