"""Memory accounting shared by the profiler and the planner: one definition of each category."""

from lightning_hbm.memory.storage import (
    module_parameter_tensors,
    parameter_bytes,
    parameter_count,
    quantization_tensors,
    storage_bytes,
    storage_key,
    unique_bytes,
)

__all__ = [
    "module_parameter_tensors",
    "parameter_bytes",
    "parameter_count",
    "quantization_tensors",
    "storage_bytes",
    "storage_key",
    "unique_bytes",
]
