"""Counting bytes from tensor storages: the ground truth every category is built on.

A tensor's memory is its *storage*; views share one. Counting ``untyped_storage().nbytes()`` once
per distinct storage gives exact bytes on any device, CPU included. Quantized layers carry their
quantization constants outside their parameters (bitsandbytes ``quant_state``: absmax, code book,
nested absmax; row scales for int8): :func:`quantization_tensors` asks the layer's quantized format for
them (each format of :mod:`lightning_hbm.precision` lists its own, registered here with
:func:`register_format_lookup`: this level cannot import precision) so that the **parameters** category counts
quantized storage at its real size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Union, cast

import torch
from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.record import checkpoint_setup

StorageKey = tuple[str, int]
_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def plain_tensors(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors that hold the bytes of ``tensor``.

    Wrapper subclasses (DTensor shards under FSDP2, torchao ``NF4Tensor`` and its 8-bit optimizer
    states) have no storage of their own: their bytes live in the inner tensors named by
    ``__tensor_flatten__`` (a DTensor's local shard, not the full tensor). Inner attributes that
    are not tensors (a DTensor's device mesh) hold no bytes.
    """
    if type(tensor) in _PLAIN_TYPES or not hasattr(type(tensor), "__tensor_flatten__"):
        yield tensor
        return
    inner_names, _ = cast(Any, tensor).__tensor_flatten__()  # a wrapper subclass's method, not on Tensor
    for name in inner_names:
        inner = getattr(tensor, name)
        if isinstance(inner, torch.Tensor):
            yield from plain_tensors(inner)


def storages(tensors: Iterable[torch.Tensor]) -> Iterator[tuple[StorageKey, int]]:
    """``((device, data pointer), bytes)`` of every non-empty storage behind ``tensors`` (repeats included)."""
    # Runs over every parameter, gradient and state tensor at each profiled step: kept lean.
    for tensor in tensors:
        for plain in (tensor,) if type(tensor) in _PLAIN_TYPES else plain_tensors(tensor):
            if plain.is_meta:
                continue
            storage = plain.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes:
                yield storage_key(storage), nbytes


def storage_key(storage: torch.UntypedStorage) -> StorageKey:
    """``(device, data pointer)`` of a storage; a FakeTensor's (planner) is ``("fake", id)``.

    A FakeTensor's storage lives on the meta device and has no address (``data_ptr`` is 0 for all of
    them); torch keeps one Python object per storage as long as the storage lives, so its ``id`` is
    its identity while it is alive.
    """
    if storage.device.type == "meta":
        return "fake", id(storage)
    return str(storage.device), storage.data_ptr()


def storage_key_at(storage: torch.UntypedStorage, data_ptr: int) -> StorageKey:
    """:func:`storage_key` of ``storage`` when it was at ``data_ptr`` (before a ``resize_`` moved it)."""
    if storage.device.type == "meta":
        return "fake", id(storage)
    return str(storage.device), data_ptr


def tensor_storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Identity (device, data pointer) of the storage behind a plain tensor; None if it holds no bytes."""
    return next((key for key, _ in storages([tensor])), None)


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``, each storage counted once."""
    return sum(dict(storages(tensors)).values())


def unique_bytes(tensors: Iterable[torch.Tensor], seen: set[StorageKey] | None = None) -> int:
    """Like :func:`tensor_bytes`, also deduplicating against (and adding to) ``seen`` across calls."""
    seen = set() if seen is None else seen
    total = 0
    for key, nbytes in storages(tensors):
        if key not in seen:
            seen.add(key)
            total += nbytes
    return total


def nested_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside ``obj``: dicts and lists (optimizer states; bitsandbytes' 8-bit ones hold plain tensors)."""
    if depth > 3 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from nested_tensors(item, depth + 1)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from nested_tensors(item, depth + 1)


FormatLookup = Callable[[nn.Module], Any]
#: who knows a module's quantized format: lightning_hbm.precision registers ``format_of`` here (this level
#: cannot import it); a format is duck-typed: ``constants(module)`` lists its quantization constants,
#: ``weight_shape(module)`` the shape its packed weight unpacks to
_FORMAT_LOOKUPS: list[FormatLookup] = []


def register_format_lookup(lookup: FormatLookup) -> None:
    """Make :func:`quantized_format` also ask ``lookup(module)`` (``None``: not one of its layers)."""
    if lookup not in _FORMAT_LOOKUPS:
        _FORMAT_LOOKUPS.append(lookup)


def quantized_format(module: nn.Module) -> Any:
    """The registered quantized format that owns ``module`` (``None`` for any other module)."""
    return next((fmt for lookup in _FORMAT_LOOKUPS if (fmt := lookup(module)) is not None), None)


def quantization_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors that belong to a quantized layer besides its parameters (scales, code books), as its format lists them."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"quantization_tensors takes the quantized layer (an nn.Module), got {type(module).__name__}: pass the "
            "module that holds the weight (e.g. quantization_tensors(layer), not quantization_tensors(layer.weight))."
        )
    fmt = quantized_format(module)
    return [] if fmt is None else list(fmt.constants(module))


def module_parameter_tensors(
    module: nn.Module, trainable: bool | None = None, recurse: bool = True
) -> list[torch.Tensor]:
    """Every tensor that stores a parameter of ``module``, quantization constants included.

    ``trainable=True`` keeps only parameters that require grad, ``False`` only frozen ones;
    ``recurse=False``: the module's own parameters only, not its submodules'.
    """
    tensors: list[torch.Tensor] = []
    for sub in module.modules() if recurse else [module]:
        for param in sub.parameters(recurse=False):
            if trainable is not None and param.requires_grad != trainable:
                continue
            tensors.append(param)
        if trainable is not True:  # quantization constants belong to frozen quantized weights
            tensors.extend(quantization_tensors(sub))
    return tensors


def parameter_bytes(module: nn.Module, trainable: bool | None = None) -> int:
    """Bytes of the parameters of ``module`` (deduplicated storages, quantization constants included).

    ``trainable=True`` counts only parameters that require grad, ``False`` only frozen ones.
    """
    return tensor_bytes(module_parameter_tensors(module, trainable))


def parameter_count(module: nn.Module, trainable: bool | None = None) -> int:
    """Number of real (logical) parameters: a packed 4-bit weight counts its unpacked elements.

    peft's ``print_trainable_parameters`` counts the packed uint8 elements and is wrong for 4-bit.
    """
    total, seen = 0, set()
    for sub in module.modules():
        fmt = quantized_format(sub)  # a quantized layer's format knows the shape its packed weight unpacks to
        for name, param in sub.named_parameters(recurse=False):
            if id(param) in seen or (trainable is not None and param.requires_grad != trainable):
                continue
            seen.add(id(param))
            total += int(fmt.weight_shape(sub).numel()) if fmt is not None and name == "weight" else param.numel()
    return total


def host_offload_bytes(optimizers: Union[torch.optim.Optimizer, Iterable[torch.optim.Optimizer]]) -> int:
    """Bytes ``CPUOffloadStrategy``'s optimizers hold on the offload device (host memory), each storage once.

    Master copies of the trainable parameters, their gradient buffers and the optimizer states
    (``OffloadedOptimizer.host_tensors()`` in :mod:`lightning_hbm.strategies.cpu_offload`). None of it is in
    ``optimizer.state`` (kept empty so that Lightning's resume does not pull states back to the device), so ``HBMProfiler``'s five terms show 0
    optimizer states for an offloaded run: it logs this figure beside them as ``hbm/host_offload``. With
    fp32 AdamW on the own engine it is 16 B per trainable parameter, twice the 8 B of state a plain run
    keeps on the device. 0 for optimizers that do not offload.
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    tensors: list[torch.Tensor] = []
    for optimizer in optimizers:
        optimizer = lightning_compat.unwrap_optimizer(optimizer)
        # duck typing (OffloadedOptimizer has it): memory sits below strategies (tests/test_layering.py)
        host_tensors = getattr(optimizer, "host_tensors", None)
        if callable(host_tensors):
            tensors += host_tensors()
    return unique_bytes(tensors)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` (each storage once: bitsandbytes shares its code books)."""
    tensors: list[torch.Tensor] = []
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return unique_bytes(tensors)


def offloaded_activation_bytes(module: nn.Module) -> int:
    """Host bytes ``ActivationCheckpointing(offload=True)`` moved off the device in the last step (pinned, as the host
    allocator rounds them), each offload hook once; 0 when nothing is offloaded or the target is the same memory.

    Read by duck typing (memory sits below the activations package, tests/test_layering.py): a checkpointed block's
    setup (:func:`~lightning_hbm.record.checkpoint_setup`) holds an ``offload`` that counts ``host_bytes``.
    """
    hooks: dict[int, int] = {}
    for sub in module.modules():
        offload = getattr(checkpoint_setup(sub), "offload", None)
        host = getattr(offload, "host_bytes", None)
        if isinstance(host, int):
            hooks[id(offload)] = host
    return sum(hooks.values())
