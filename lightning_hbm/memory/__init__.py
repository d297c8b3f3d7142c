"""Memory accounting shared by the profiler and the planner: one definition of each category.

- :mod:`~lightning_hbm.memory.storage`: storage-byte counting, quantization constants.
- :mod:`~lightning_hbm.memory.terms`: :data:`TERMS`, the registry of memory terms (owner, phase, sharding, remedy, how
  each is measured and advised); :func:`register_term` adds one.
- :mod:`~lightning_hbm.memory.facts`: :class:`RunFacts`, what a run applied (the report's advice reads it).
- :mod:`~lightning_hbm.memory.categories`: :data:`CATEGORIES` and :func:`classify` (by owner), :func:`classify_records`
  (the one peak classifier of the profiler and the planner).
- :mod:`~lightning_hbm.memory.tracker`: :class:`LiveStorageTracker` (live storages, peaks), :func:`memory_scope`
  (terms such as the loss's bytes, reported next to the categories).
- :mod:`~lightning_hbm.memory.activations`: :func:`saved_activation_bytes`.
"""

from lightning_hbm.memory.activations import saved_activation_bytes
from lightning_hbm.memory.facts import RunFacts, quantized_base
from lightning_hbm.memory.categories import (
    CATEGORIES,
    Category,
    MemoryBreakdown,
    buffer_tensors,
    classify,
    classify_records,
    gradient_tensors,
    light_values,
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
from lightning_hbm.memory.terms import (
    TERMS,
    MemoryTerm,
    category_terms,
    host_terms,
    register_term,
    scope_terms,
    side_terms,
    term,
    terms_table,
    unregister_term,
)
from lightning_hbm.memory.tracker import LOSS_SCOPE, LiveStorageTracker, memory_scope, scope_term_bytes, scoped_bytes

__all__ = [
    "CATEGORIES",
    "Category",
    "LOSS_SCOPE",
    "LiveStorageTracker",
    "MemoryBreakdown",
    "MemoryTerm",
    "RunFacts",
    "TERMS",
    "buffer_tensors",
    "category_terms",
    "classify",
    "classify_records",
    "gradient_tensors",
    "host_terms",
    "light_values",
    "memory_scope",
    "module_parameter_tensors",
    "optimizer_state_tensors",
    "owned_storages",
    "owned_tensors",
    "parameter_bytes",
    "parameter_count",
    "parameter_tensors",
    "quantization_tensors",
    "quantized_base",
    "register_term",
    "saved_activation_bytes",
    "scope_term_bytes",
    "scope_terms",
    "scoped_bytes",
    "side_terms",
    "tensor_storage_key",
    "tensor_bytes",
    "term",
    "terms_table",
    "unique_bytes",
    "unregister_term",
]
