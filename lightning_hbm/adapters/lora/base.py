"""What the LoRA modules share: peft, imported on first use (module names match by :mod:`lightning_hbm.naming`)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lightning_hbm.quiet import quieted
from lightning_hbm.requirements import requirement

_PEFT_AVAILABLE = RequirementCache(requirement("peft"))

# One adapter per model: peft's default name. Parameter names are ``<layer>.lora_A.default.weight``;
# the FSDP and activation-checkpointing callbacks rely on these names staying stable.
ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"


def _import_peft() -> Any:
    if not _PEFT_AVAILABLE:
        raise ModuleNotFoundError(
            f"lightning_hbm.LoRA needs {requirement('peft')} ({_PEFT_AVAILABLE.message}). "
            f"Install it with `pip install -U '{requirement('peft')}'`."
        )
    with quieted():  # peft imports accelerate, whose import adds process-wide warnings filters (lightning_hbm.quiet)
        import peft

    return peft


def _lora_layer_cls() -> type:
    from peft.tuners.lora import LoraLayer

    return LoraLayer


def _width(layer: Optional[nn.Module], default: int) -> int:
    """A layer's smaller dimension (Linear-like ``in_features``/``out_features``; ``default`` when unknown)."""
    return min(getattr(layer, "in_features", default), getattr(layer, "out_features", default))
