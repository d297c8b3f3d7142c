"""Memory accounting shared by the profiler and the planner: one definition of each category.

- :mod:`~lightning_hbm.memory.storage`: storage-byte counting, quantization constants.
- :mod:`~lightning_hbm.memory.terms`: :data:`TERMS`, the registry of memory terms (owner, phase, sharding, remedy).
- :mod:`~lightning_hbm.memory.categories`: :data:`CATEGORIES` and :func:`classify` (by owner), :func:`classify_records`
  (the one peak classifier of the profiler and the planner).
- :mod:`~lightning_hbm.memory.tracker`: :class:`LiveStorageTracker` (live storages, peaks), :func:`memory_scope`
  (terms such as the loss's bytes, reported next to the categories).
- :mod:`~lightning_hbm.memory.activations`: :func:`saved_activation_bytes`.
"""

from lightning_hbm.memory.activations import saved_activation_bytes
from lightning_hbm.memory.categories import (
    CATEGORIES,
    Category,
    MemoryBreakdown,
    buffer_tensors,
    classify,
    classify_records,
    gradient_tensors,
    optimizer_state_tensors,
    owned_storages,
    owned_tensors,
    parameter_tensors,
    tensor_bytes,
)
from lightning_hbm.memory.storage import (
    module_parameter_tensors,
    parameter_bytes,
    parameter_count,
    quantization_tensors,
    tensor_storage_key,
    unique_bytes,
)
from lightning_hbm.memory.terms import TERMS, MemoryTerm, term, terms_table
from lightning_hbm.memory.tracker import LOSS_SCOPE, LiveStorageTracker, memory_scope, scoped_bytes

__all__ = [
    "CATEGORIES",
    "Category",
    "LOSS_SCOPE",
    "LiveStorageTracker",
    "MemoryBreakdown",
    "MemoryTerm",
    "TERMS",
    "buffer_tensors",
    "classify",
    "classify_records",
    "gradient_tensors",
    "memory_scope",
    "module_parameter_tensors",
    "optimizer_state_tensors",
    "owned_storages",
    "owned_tensors",
    "parameter_bytes",
    "parameter_count",
    "parameter_tensors",
    "quantization_tensors",
    "saved_activation_bytes",
    "scoped_bytes",
    "tensor_storage_key",
    "tensor_bytes",
    "term",
    "terms_table",
    "unique_bytes",
]
