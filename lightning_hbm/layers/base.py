"""The former home of the layer-kind protocol and everything generic over kinds, split by job (issue 54):

- :mod:`~lightning_hbm.layers.kinds`: :class:`LayerKind`, the registry (:func:`register_kind`) and its lookups;
- :mod:`~lightning_hbm.layers.finding`: :func:`find_layers`, :func:`prepare_model`, the names generic over kinds;
- :mod:`~lightning_hbm.layers.source_scan`: what the code of a model's classes does with its layers' weights;
- :mod:`~lightning_hbm.layers.heads`: output heads and task heads;
- :mod:`~lightning_hbm.layers.outside`: the coverage rows of weights outside any layer kind;
- :mod:`~lightning_hbm.layers.coverage_table`: the coverage table and its warnings.

Kept as a face: docs/extending.md told kind authors ``from lightning_hbm.layers.base import LayerKind, register_kind``
before the split, and code written that way keeps working. The package imports the new homes; nothing in it imports
this module.
"""

from lightning_hbm.layers.coverage_table import WARN_SHARE, CoverageRow, coverage, coverage_warnings, format_coverage, report_coverage
from lightning_hbm.layers.finding import (
    adaptable_names,
    base_layer,
    converted_keys,
    expert_counts,
    find_layers,
    is_adapted,
    prepare_model,
)
from lightning_hbm.layers.heads import output_heads
from lightning_hbm.layers.kinds import (
    LayerKind,
    itself,
    kind_names,
    kind_of,
    kind_table,
    layer_kinds,
    linear_features,
    no_names,
    register_kind,
    stored_in,
)
from lightning_hbm.layers.outside import (
    GROUPED_WEIGHTS,
    OUTSIDE_ROWS,
    PARAMETRIZED_WEIGHTS,
    POSITION_TABLES,
    RAW_WEIGHTS,
    RAW_WEIGHTS_REASON,
    ROUTER_WEIGHTS,
)
from lightning_hbm.layers.source_scan import source_readers, weight_readers

__all__ = [
    "GROUPED_WEIGHTS",
    "OUTSIDE_ROWS",
    "PARAMETRIZED_WEIGHTS",
    "POSITION_TABLES",
    "RAW_WEIGHTS",
    "RAW_WEIGHTS_REASON",
    "ROUTER_WEIGHTS",
    "WARN_SHARE",
    "CoverageRow",
    "LayerKind",
    "adaptable_names",
    "base_layer",
    "converted_keys",
    "coverage",
    "coverage_warnings",
    "expert_counts",
    "find_layers",
    "format_coverage",
    "is_adapted",
    "itself",
    "kind_names",
    "kind_of",
    "kind_table",
    "layer_kinds",
    "linear_features",
    "no_names",
    "output_heads",
    "prepare_model",
    "register_kind",
    "report_coverage",
    "source_readers",
    "stored_in",
    "weight_readers",
]
