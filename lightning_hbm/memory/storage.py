"""Counting bytes from tensor storages: the ground truth every category is built on.

A tensor's memory is its *storage*; views share one. Counting ``untyped_storage().nbytes()`` once
per distinct storage gives exact bytes on any device, CPU included. Quantized weights carry their
quantization constants outside the tensor (bitsandbytes ``quant_state``: absmax, code book,
nested absmax; ``SCB`` row scales for int8): :func:`quantization_tensors` finds them so that the
**parameters** category counts quantized storage at its real size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The storage-backed tensor on this rank: a DTensor (FSDP2 shard) holds only its local shard.

    A DTensor is a wrapper subclass without storage of its own (``data_ptr`` raises).
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and type(tensor).__name__ == "DTensor" else tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``tensor`` (device, data pointer)."""
    tensor = _local(tensor)
    storage = tensor.untyped_storage()
    return (str(tensor.device), storage.data_ptr())


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``tensor`` (0 for meta tensors)."""
    tensor = _local(tensor)
    if tensor.is_meta:
        return 0
    return tensor.untyped_storage().nbytes()


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set[tuple[str, int]] | None = None) -> int:
    """Sum of storage bytes of ``tensors``, each storage counted once (also across calls sharing ``seen``)."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        tensor = _local(tensor)
        if tensor.is_meta or tensor.untyped_storage().nbytes() == 0:
            continue
        key = storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += storage_bytes(tensor)
    return total


def _tensors_in(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if depth > 3 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item, depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("bitsandbytes"):
        for item in vars(obj).values():
            yield from _tensors_in(item, depth + 1)


def quantization_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """Tensors that belong to a quantized parameter besides its own data (scales, code books)."""
    extra: list[torch.Tensor] = []
    quant_state = getattr(param, "quant_state", None)
    if quant_state is not None:
        extra.extend(_tensors_in(quant_state))
    for attr in ("SCB", "scales", "weight_scale"):
        value = getattr(param, attr, None)
        if isinstance(value, torch.Tensor):
            extra.append(value)
    return extra


def module_parameter_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor that stores a parameter of ``module``, quantization constants included."""
    tensors: list[torch.Tensor] = []
    for param in module.parameters():
        tensors.append(param)
        tensors.extend(quantization_tensors(param))
    return tensors


def parameter_bytes(module: nn.Module, trainable: bool | None = None) -> int:
    """Bytes of the parameters of ``module`` (deduplicated storages, quantization constants included).

    ``trainable=True`` counts only parameters that require grad, ``False`` only frozen ones.
    """
    tensors: list[torch.Tensor] = []
    for param in module.parameters():
        if trainable is not None and param.requires_grad != trainable:
            continue
        tensors.append(param)
        tensors.extend(quantization_tensors(param))
    return unique_bytes(tensors)


def parameter_count(module: nn.Module, trainable: bool | None = None) -> int:
    """Number of real (logical) parameters: a packed 4-bit weight counts its unpacked elements.

    peft's ``print_trainable_parameters`` counts the packed uint8 elements and is wrong for 4-bit.
    """
    total = 0
    for param in module.parameters():
        if trainable is not None and param.requires_grad != trainable:
            continue
        quant_state = getattr(param, "quant_state", None)
        shape = getattr(quant_state, "shape", None)
        total += int(torch.Size(shape).numel()) if shape is not None else param.numel()
    return total
