"""The one definition of the memory categories, shared by ``HBMProfiler`` and the planner.

Training memory is a sum of five terms (the ``category`` terms of the registry,
:data:`lightning_hbm.memory.terms.TERMS`, which says who holds each, when, over ranks, and what shrinks it),
and every byte belongs to exactly one of them:

``parameters``
    Storages of the module's parameters, counted at their real stored size: a 4-bit weight is its
    packed uint8 storage plus its quantization constants (absmax, code book, nested absmax, int8
    row scales; see :func:`lightning_hbm.memory.storage.quantization_tensors`).
``gradients``
    Storages of ``param.grad`` for every parameter of the module.
``optimizer_states``
    Every tensor held in ``optimizer.state`` (AdamW: ``exp_avg``, ``exp_avg_sq`` and the 0-dim
    ``step``; 8-bit optimizers: quantized states plus their absmax/qmap).
``activations``
    Storages created during the forward and still alive at its end that are none of the above:
    what autograd keeps for backward (and the forward's outputs). Measured by tracking live
    storages (:class:`lightning_hbm.memory.tracker.LiveStorageTracker`), not by
    ``saved_tensors_hooks``, which miscount under activation checkpointing.
``other``
    Everything else that is alive: module buffers, temporaries of the backward and optimizer step.

Classification is by what a tensor *is* (who owns its storage), never by the phase that
allocated it: Lightning runs forward and backward inside ``optimizer.step(closure)`` and zeroes
gradients after the forward, so phases lie. A storage is counted once, in the first category
that owns it, in the order of :data:`CATEGORIES` (a gradient that aliases a parameter counts as
a parameter). :func:`classify_records` is the one peak classifier: the profiler's detailed steps and the
planner's traced phases both classify the storages alive at a peak with it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Union, get_args

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.memory.storage import (
    StorageKey,
    module_parameter_tensors,
    nested_tensors,
    plain_tensors,
    storages,
    tensor_bytes,
    tensor_storage_key,
)
from lightning_hbm.memory.terms import CATEGORY_NAMES

# For type checkers only; the registry is the definition (checked below).
Category = Literal["parameters", "gradients", "optimizer_states", "activations", "other"]
CATEGORIES: tuple[Category, ...] = CATEGORY_NAMES  # type: ignore[assignment]

def parameter_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors of the **parameters** category: parameters plus their quantization constants."""
    return module_parameter_tensors(module)


def gradient_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors of the **gradients** category: every ``.grad`` that exists."""
    return [p.grad for p in module.parameters() if p.grad is not None]


def optimizer_state_tensors(optimizers: Union[Optimizer, Iterable[Optimizer]]) -> list[torch.Tensor]:
    """Tensors of the **optimizer_states** category: everything in ``optimizer.state``."""
    if isinstance(optimizers, Optimizer):
        optimizers = [optimizers]
    tensors: list[torch.Tensor] = []
    for optimizer in optimizers:
        # LightningOptimizer wraps the real one; .state is forwarded, but be explicit.
        optimizer = lightning_compat.unwrap_optimizer(optimizer)
        for state in optimizer.state.values():
            tensors.extend(nested_tensors(state))
    return tensors


def buffer_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Module buffers: counted in **other** (not trained, not parameters)."""
    return list(module.buffers())


def owned_tensors(
    module: nn.Module, optimizers: Union[Optimizer, Iterable[Optimizer]] = ()
) -> dict[Category, list[torch.Tensor]]:
    """The tensors ``module`` and its optimizers own, by category, in priority order (not deduplicated)."""
    return {
        "parameters": parameter_tensors(module),
        "gradients": gradient_tensors(module),
        "optimizer_states": optimizer_state_tensors(optimizers),
        "other": buffer_tensors(module),
    }


def owned_storages(
    module: nn.Module, optimizers: Union[Optimizer, Iterable[Optimizer]] = ()
) -> dict[StorageKey, tuple[Category, int]]:
    """Every storage owned by ``module`` or its optimizers: key -> (category, bytes).

    Deduplicated: a storage is given to the first owner in the order parameters, gradients,
    optimizer states, buffers (``other``).
    """
    owned: dict[StorageKey, tuple[Category, int]] = {}
    for category, tensors in owned_tensors(module, optimizers).items():
        for key, nbytes in storages(tensors):
            owned.setdefault(key, (category, nbytes))
    return owned


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per category (see :data:`CATEGORIES`). ``total`` is their sum."""

    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    activations: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return sum(self.as_dict().values())

    def as_dict(self) -> dict[str, int]:
        """``{category: bytes}`` in the order of :data:`CATEGORIES`."""
        return asdict(self)

    def dominant(self) -> Category:
        """The category holding the most bytes (ties: the first in :data:`CATEGORIES`)."""
        values = self.as_dict()
        return max(CATEGORIES, key=lambda c: values[c])


def classify(
    module: nn.Module,
    optimizers: Union[Optimizer, Iterable[Optimizer]] = (),
    activations: Mapping[StorageKey, int] | Iterable[torch.Tensor] = (),
    others: Mapping[StorageKey, int] | Iterable[torch.Tensor] = (),
    device: Union[str, torch.device, None] = None,
) -> MemoryBreakdown:
    """Measure the categories now: owned storages of ``module``/``optimizers`` plus candidate activations.

    Args:
        module: the model (the ``LightningModule`` or any ``nn.Module``).
        optimizers: its optimizers (plain or Lightning-wrapped).
        activations: storages created during the forward and alive at its end (``{key: bytes}``
            from :class:`~lightning_hbm.memory.tracker.LiveStorageTracker`, or tensors). Those
            owned by the module or optimizers are not activations and are skipped.
        others: further live storages to count as ``other`` (e.g. backward temporaries).
        device: count only storages on this device (e.g. ``"cuda:0"`` for HBM); None: all.
    """
    wanted = None if device is None else str(torch.device(device))
    totals: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    seen: set[StorageKey] = set()

    def add(key: StorageKey, category: str, nbytes: int) -> None:
        if key in seen or (wanted is not None and not _same_device(key[0], wanted)):
            return
        seen.add(key)
        totals[category] += nbytes

    for key, (category, nbytes) in owned_storages(module, optimizers).items():
        add(key, category, nbytes)
    for category, candidates in (("activations", activations), ("other", others)):
        items = candidates.items() if isinstance(candidates, Mapping) else storages(candidates)
        for key, nbytes in items:
            add(key, category, nbytes)
    return MemoryBreakdown(**totals)


def classify_records(
    records: Mapping[StorageKey, Any], owned: Mapping[StorageKey, tuple[str, int]], device: Union[str, torch.device, None] = None
) -> dict[str, int]:
    """The one peak classifier: bytes per category of the storages alive at a tracked peak.

    ``records``: ``{key: StorageRecord}`` (:attr:`LiveStorageTracker.peak_records
    <lightning_hbm.memory.tracker.LiveStorageTracker.peak_records>`); ``owned``: :func:`owned_storages` read
    after the peak. A storage still owned (and still the same storage: addresses get reused once one dies) is
    what its owner says (a backward output that became ``.grad`` is a gradient); one seeded with a category as
    its phase keeps it (the previous step's gradients, freed by ``zero_grad`` since); one the forward created
    is an activation; anything else (the batch, backward and optimizer temporaries) is ``other``. ``device``:
    only storages on it (None: all).
    """
    wanted = None if device is None else str(torch.device(device))
    values = dict.fromkeys(CATEGORIES, 0)
    for key, record in records.items():
        if wanted is not None and not _same_device(key[0], wanted):
            continue
        if key in owned and record.ref() is not None:
            category = owned[key][0]
        elif record.phase in values:
            category = record.phase
        else:
            category = "activations" if record.phase == "forward" else "other"
        values[category] += record.nbytes
    return values


def _same_device(device: str, wanted: str) -> bool:
    # "cuda" (no index) matches every CUDA device; "cuda:0" only itself.
    return device == wanted or device.split(":")[0] == wanted


if get_args(Category) != CATEGORIES or tuple(f.name for f in fields(MemoryBreakdown)) != CATEGORIES:
    raise ImportError(
        f"lightning_hbm.memory: the category terms of TERMS {CATEGORIES} differ from Category / MemoryBreakdown's fields; "
        "a category term needs its name in all three (docs/extending.md#a-memory-term)."
    )


__all__ = [
    "CATEGORIES",
    "Category",
    "MemoryBreakdown",
    "StorageKey",
    "buffer_tensors",
    "classify",
    "classify_records",
    "gradient_tensors",
    "optimizer_state_tensors",
    "owned_storages",
    "owned_tensors",
    "parameter_tensors",
    "plain_tensors",
    "tensor_bytes",
    "tensor_storage_key",
]
