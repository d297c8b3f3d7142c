"""Memory accounting shared by the profiler and the planner: one definition of each category.

- :mod:`~lightning_hbm.memory.storage`: storage-byte counting, quantization constants.
- :mod:`~lightning_hbm.memory.categories`: :data:`CATEGORIES` and :func:`classify` (by owner).
- :mod:`~lightning_hbm.memory.tracker`: :class:`LiveStorageTracker` (live storages, peaks).
- :mod:`~lightning_hbm.memory.activations`: :func:`saved_activation_bytes`.
"""

from lightning_hbm.memory.activations import saved_activation_bytes
from lightning_hbm.memory.categories import (
    CATEGORIES,
    Category,
    MemoryBreakdown,
    buffer_tensors,
    classify,
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
from lightning_hbm.memory.tracker import LiveStorageTracker

__all__ = [
    "CATEGORIES",
    "Category",
    "LiveStorageTracker",
    "MemoryBreakdown",
    "buffer_tensors",
    "classify",
    "gradient_tensors",
    "module_parameter_tensors",
    "optimizer_state_tensors",
    "owned_storages",
    "owned_tensors",
    "parameter_bytes",
    "parameter_count",
    "parameter_tensors",
    "quantization_tensors",
    "saved_activation_bytes",
    "tensor_storage_key",
    "tensor_bytes",
    "unique_bytes",
]
