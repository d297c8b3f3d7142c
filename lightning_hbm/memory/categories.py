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

from lightning_hbm.memory.owners import (
    Optimizers,
    buffer_tensors,
    gradient_tensors,
    optimizer_state_tensors,
    parameter_tensors,
)
from lightning_hbm.memory.storage import (
    StorageKey,
    plain_tensors,
    storages,
    tensor_bytes,
    tensor_storage_key,
)
from lightning_hbm.memory.terms import CATEGORY_NAMES, category_terms, created_term, rest_term

# For type checkers only; the registry is the definition (checked below).
Category = Literal["parameters", "gradients", "optimizer_states", "activations", "other"]
CATEGORIES: tuple[Category, ...] = CATEGORY_NAMES  # type: ignore[assignment]


def owned_tensors(module: nn.Module, optimizers: Optimizers = ()) -> dict[Category, list[torch.Tensor]]:
    """The tensors ``module`` and its optimizers own, by category, in priority order (not deduplicated).

    Each category term's ``owns`` in :data:`~lightning_hbm.memory.terms.TERMS` (those classified by owner: not
    ``activations``, which nothing owns).
    """
    optimizers = [optimizers] if isinstance(optimizers, Optimizer) else list(optimizers)
    return {t.name: t.owns(module, optimizers) for t in category_terms() if t.owns is not None}  # type: ignore[misc]


def owned_storages(module: nn.Module, optimizers: Optimizers = ()) -> dict[StorageKey, tuple[Category, int]]:
    """Every storage owned by ``module`` or its optimizers: key -> (category, bytes).

    Deduplicated: a storage is given to the first owner in registry order (parameters, gradients,
    optimizer states, buffers in ``other``).
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


def light_values(forward_end: MemoryBreakdown, end: MemoryBreakdown) -> dict[str, int]:
    """A light step's categories from its forward end and its end (the profiler's light rows).

    A category the forward creates (``created_in``: activations) is read at the forward's end, where its graph is
    alive; an owned one is the larger of the two readings (the previous gradients die at ``zero_grad``, the first
    optimizer states appear at the step).
    """
    before, after = forward_end.as_dict(), end.as_dict()
    return {t.name: before[t.name] if t.created_in is not None else max(before[t.name], after[t.name]) for t in category_terms()}


def classify(
    module: nn.Module,
    optimizers: Optimizers = (),
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

    category: str  # a Category from owned_storages, then the registry's terms (str)
    for key, (category, nbytes) in owned_storages(module, optimizers).items():
        add(key, category, nbytes)
    # what the forward created and nothing owns, then the rest (the registry's created_in / rest terms)
    for category, candidates in ((created_term("forward"), activations), (rest_term(), others)):
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
    values: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
    for key, record in records.items():
        if wanted is not None and not _same_device(key[0], wanted):
            continue
        if key in owned and record.ref() is not None:
            category = owned[key][0]
        elif record.phase in values:
            category = record.phase
        else:  # unowned: the category created in its phase (forward: activations), else the rest (other)
            category = created_term(record.phase)
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
    "light_values",
    "optimizer_state_tensors",
    "owned_storages",
    "owned_tensors",
    "parameter_tensors",
    "plain_tensors",
    "tensor_bytes",
    "tensor_storage_key",
]
