"""The HBM planner: predict every configuration's peak memory before training, and pick one that fits.

One job per module: :mod:`~lightning_hbm.planner.candidates` (the configurations and their step-time
costs), :mod:`~lightning_hbm.planner.tracing` (one training step traced on fake tensors; its parts
:mod:`~lightning_hbm.planner.trace_result`, :mod:`~lightning_hbm.planner.peaks`, :mod:`~lightning_hbm.planner.block_cuts`,
:mod:`~lightning_hbm.planner.fallbacks`, :mod:`~lightning_hbm.planner.host_offload`) with
:mod:`~lightning_hbm.planner.realvalues` (data-dependent Python), :mod:`~lightning_hbm.planner.api`
(:func:`predict`, :func:`plan`), :mod:`~lightning_hbm.planner.context` (:func:`max_context`), :mod:`~lightning_hbm.planner.accurate` (the accurate 4-bit base's rank per model), :mod:`~lightning_hbm.planner.config` (planning a LightningCLI config:
``lightning-hbm plan``, alias ``python -m lightning_hbm.planner``) and :mod:`~lightning_hbm.planner.autofit`.
"""

from lightning_hbm.planner.candidates import (
    PLANNED_LIGHTNING_PRECISIONS,
    Candidate,
    available_axes,
    default_candidates,
    format_bytes,
    parse_bytes,
)
from lightning_hbm.planner.api import (
    CUDA_CONTEXT_BYTES,
    Plan,
    Prediction,
    example_batch,
    plan,
    predict,
    quantization_constant_bytes,
    quantized_parameter_bytes,
    shard_categories,
)
from lightning_hbm.planner.autofit import AutoFit
from lightning_hbm.planner.context import ContextResult, max_context

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "PLANNED_LIGHTNING_PRECISIONS",
    "AutoFit",
    "Candidate",
    "ContextResult",
    "Plan",
    "Prediction",
    "available_axes",
    "default_candidates",
    "example_batch",
    "format_bytes",
    "max_context",
    "parse_bytes",
    "plan",
    "predict",
    "quantization_constant_bytes",
    "quantized_parameter_bytes",
    "shard_categories",
]
