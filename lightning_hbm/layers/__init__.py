"""The layer kinds lightning_hbm knows: one file per kind, each registering one :class:`LayerKind`.

:mod:`~lightning_hbm.layers.base` holds the protocol, the registry and what is generic over kinds (finding,
preparing, LoRA names, weight readers, the coverage table, the kind table of docs/adapters.md). Each other module is
one kind, complete: how its layers are found, prepared, quantized, adapted, counted by the planner and documented.
Adding a kind is adding one file and importing it below (docs/extending.md).
"""

from lightning_hbm.layers.base import (
    CONVERTED_ATTR,
    KIND_ATTR,
    LEFT_ALONE_ATTR,
    PLAN_ATTR,
    RAW_WEIGHTS,
    WARN_SHARE,
    CoverageRow,
    LayerKind,
    adaptable_names,
    base_layer,
    converted_keys,
    coverage,
    coverage_warnings,
    find_layers,
    format_coverage,
    kind_names,
    kind_of,
    kind_table,
    layer_kinds,
    output_heads,
    prepare_model,
    register_kind,
    report_coverage,
    weight_readers,
)

# The kinds, in matching order (the first that matches a module wins): Linear first, so that nn.MultiheadAttention's
# out_proj is a Linear; the experts test last (any module holding 3-D Parameters).
from lightning_hbm.layers.linear import LINEAR
from lightning_hbm.layers.conv1d import CONV1D
from lightning_hbm.layers.multihead_attention import MULTIHEAD_ATTENTION, ProjectedMultiheadAttention
from lightning_hbm.layers.conv import CONV
from lightning_hbm.layers.experts import EXPERTS, LinearExperts

__all__ = [
    "CONV",
    "CONV1D",
    "CONVERTED_ATTR",
    "EXPERTS",
    "KIND_ATTR",
    "LEFT_ALONE_ATTR",
    "LINEAR",
    "MULTIHEAD_ATTENTION",
    "PLAN_ATTR",
    "RAW_WEIGHTS",
    "WARN_SHARE",
    "CoverageRow",
    "LayerKind",
    "LinearExperts",
    "ProjectedMultiheadAttention",
    "adaptable_names",
    "base_layer",
    "converted_keys",
    "coverage",
    "coverage_warnings",
    "find_layers",
    "format_coverage",
    "kind_names",
    "kind_of",
    "kind_table",
    "layer_kinds",
    "output_heads",
    "prepare_model",
    "register_kind",
    "report_coverage",
    "weight_readers",
]
