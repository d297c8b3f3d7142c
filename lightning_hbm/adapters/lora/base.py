"""What the LoRA modules share: peft, imported on first use (module names match by :mod:`lightning_hbm.naming`), the
trained weights and the model they are relative to in peft's format."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lightning_hbm.layers import hf_models
from lightning_hbm.layers.finding import lora_layer_classes
from lightning_hbm.naming import has_submodule, under
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


def adapted_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The adapted layers of ``module`` (peft's LoRA layers, :func:`lightning_hbm.layers.finding.lora_layer_classes`)
    by name, in module order."""
    lora: tuple[type[Any], ...] = lora_layer_classes()
    return {name: sub for name, sub in module.named_modules() if isinstance(sub, lora)}


def smaller_side(layer: Optional[nn.Module], default: int) -> int:
    """A layer's smaller dimension (Linear-like ``in_features``/``out_features``; ``default`` when unknown)."""
    return min(getattr(layer, "in_features", default), getattr(layer, "out_features", default))


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable weights of ``module`` (adapters + ``modules_to_save``), under their own names.

    Tied parameters appear under every name, as in ``module.state_dict()``.
    """
    return {n: p.detach() for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of ``tensor``: a sharded one (FSDP2's DTensor, ``QuantizedFSDPStrategy``) gathered from every rank, a
    collective each rank must call in the same order; any other as it is."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(tensor, DTensor):
            return tensor.full_tensor()
    return tensor


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds sharded parameters (FSDP2's DTensors): reading them whole takes every rank."""
    return torch.distributed.is_available() and any(type(p).__name__ == "DTensor" for p in module.parameters())


@contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s FSDP2 units unsharded (their parameters whole, plain tensors, on every rank: a collective each rank
    must enter) for the block, sharded again after; nothing for a model that is not sharded. The whole model at once
    on each rank: what it held before sharding (the quantized base fits one device, the strategy builds it there)."""
    if not is_sharded(module):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def hf_root(module: nn.Module, submodule: Optional[str]) -> str:
    """The name of the model peft's adapter format is relative to: ``submodule`` when given (checked), else the
    outermost Hugging Face model inside ``module`` (``""``: ``module`` itself, a Hugging Face model or none inside).

    Raises:
        ValueError: ``submodule`` is not a submodule of ``module``, or ``module`` holds several Hugging Face models side
            by side (which one is ambiguous: pass ``submodule``).
    """
    if submodule is not None:
        if not has_submodule(module, submodule):
            raise ValueError(f"submodule={submodule!r} is not a submodule of {type(module).__name__}.")
        return submodule
    # (was its own search, which counted a bare transformers model and its inner model as two: "holds several")
    outer = [name for name, _ in hf_models(module)]
    if len(outer) > 1:  # a frozen teacher beside the adapted student (distillation): the one holding the adapters
        adapted = list(adapted_layers(module))
        outer = [name for name in outer if any(under(layer, [name]) for layer in adapted)] or outer
    if len(outer) > 1:
        raise ValueError(f"{type(module).__name__} holds several Hugging Face models {outer} with adapters: pass submodule=NAME.")
    return outer[0] if outer else ""
