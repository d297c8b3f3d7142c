"""The layer kinds lightning_hbm knows: one file per kind, each registering one :class:`LayerKind`.

What is generic over kinds, one module per job: :mod:`~lightning_hbm.layers.kinds` (the protocol, the registry, the
kind table of docs/adapters.md), :mod:`~lightning_hbm.layers.finding` (finding and preparing a model's layers, LoRA
names), :mod:`~lightning_hbm.layers.source_scan` (what a model's code does with its layers' weights, read from its
source), :mod:`~lightning_hbm.layers.heads` (output heads and task heads), :mod:`~lightning_hbm.layers.outside` (the
rows of weights outside any kind) and :mod:`~lightning_hbm.layers.coverage_table` (the coverage table and its
warnings). Each other module is one kind, complete: how its layers are found, prepared, quantized, adapted, counted by
the planner and documented. :mod:`~lightning_hbm.layers.blocks` finds a model's repeated blocks (what activation
checkpointing wraps). Adding a kind is adding one file and importing it below (docs/extending.md).
"""

from lightning_hbm.layers.kinds import LayerKind, kind_names, kind_of, kind_table, layer_kinds, register_kind, stored_in
from lightning_hbm.layers.finding import adaptable_names, base_layer, converted_keys, find_layers, is_adapted, prepare_model
from lightning_hbm.layers.source_scan import embedding_readers, own_forward, source_readers, weight_readers
from lightning_hbm.layers.outside import OUTSIDE_ROWS, RAW_WEIGHTS
from lightning_hbm.layers.coverage_table import WARN_SHARE, CoverageRow, coverage, coverage_warnings, format_coverage, report_coverage
from lightning_hbm.layers import readers

# The kinds, in matching order (the first that matches a module wins): Linear first, so that nn.MultiheadAttention's
# out_proj is a Linear; the experts test last (any module holding 3-D Parameters).
from lightning_hbm.layers.linear import LINEAR, Fp32ComputeLinear
from lightning_hbm.layers.conv1d import CONV1D
from lightning_hbm.layers.multihead_attention import MULTIHEAD_ATTENTION, ProjectedMultiheadAttention
from lightning_hbm.layers.conv import CONV, QuantizedConv1d, QuantizedConv2d, QuantizedConv3d, repeated_reads_dequantize_once
from lightning_hbm.layers.conv_transpose import CONV_TRANSPOSE, QuantizedConvTranspose1d, QuantizedConvTranspose2d, QuantizedConvTranspose3d
from lightning_hbm.layers.embedding import EMBEDDING, QuantizedEmbedding
from lightning_hbm.layers.experts import EXPERTS, LinearExperts
from lightning_hbm.layers.heads import hf_models, output_heads, task_heads, task_type

__all__ = [
    "embedding_readers",
    "CONV",
    "CONV1D",
    "CONV_TRANSPOSE",
    "EMBEDDING",
    "EXPERTS",
    "LINEAR",
    "OUTSIDE_ROWS",
    "MULTIHEAD_ATTENTION",
    "RAW_WEIGHTS",
    "WARN_SHARE",
    "CoverageRow",
    "Fp32ComputeLinear",
    "LayerKind",
    "LinearExperts",
    "ProjectedMultiheadAttention",
    "QuantizedConv1d",
    "QuantizedConv2d",
    "QuantizedConv3d",
    "QuantizedConvTranspose1d",
    "QuantizedConvTranspose2d",
    "QuantizedConvTranspose3d",
    "QuantizedEmbedding",
    "adaptable_names",
    "base_layer",
    "converted_keys",
    "coverage",
    "coverage_warnings",
    "find_layers",
    "format_coverage",
    "hf_models",
    "kind_names",
    "kind_of",
    "kind_table",
    "layer_kinds",
    "output_heads",
    "own_forward",
    "prepare_model",
    "register_kind",
    "repeated_reads_dequantize_once",
    "report_coverage",
    "task_heads",
    "task_type",
    "weight_readers",
]
