"""Issue 54, the names (session 30): what "plan" still named outside the planner, renamed with the old names working.

``quant/plan_*`` metric keys -> ``quant/layer_modes_*`` (both logged, the former deprecated), ``greedy_plan`` ->
``greedy_layer_modes``, the module ``precision.read_plan`` -> ``precision.read_layers``."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.quality import RENAMED_KEYS, _layer_mode_metrics


def test_the_sensitivity_choice_is_logged_under_layer_modes_keys_and_the_former_plan_keys() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", max_bytes_per_param=0.9, probe_batch=torch.randn(16, 64))
    plugin.convert_module(model)
    report = plugin.sensitivity_report
    assert report is not None
    metrics = _layer_mode_metrics(plugin)
    assert metrics["quant/layer_modes_cosine_similarity"] == report.cosine
    assert metrics["quant/layer_modes_bytes_per_param"] == report.bytes_per_param
    assert RENAMED_KEYS == {"quant/plan_cosine_similarity": "quant/layer_modes_cosine_similarity",
                            "quant/plan_bytes_per_param": "quant/layer_modes_bytes_per_param"}
    assert all(metrics[old] == metrics[new] for old, new in RENAMED_KEYS.items())  # dashboards reading the old keys


def test_greedy_plan_warns_and_is_greedy_layer_modes() -> None:
    from lightning_hbm.precision import sensitivity

    with pytest.warns(DeprecationWarning, match=r"sensitivity\.greedy_plan is deprecated: use greedy_layer_modes \(the same function\)"):
        assert sensitivity.greedy_plan is sensitivity.greedy_layer_modes  # type: ignore[attr-defined]
    cost = {"a": {"nf4": 4, "int8": 8}, "b": {"nf4": 4, "int8": 8}}
    assert sensitivity.greedy_layer_modes({"a": 0.1, "b": 0.3}, cost, "nf4", "int8", 12) == ({"a": "nf4", "b": "int8"}, 12)


def test_the_module_read_plan_is_read_layers_with_a_warning() -> None:
    from lightning_hbm.precision import read_layers

    old_module = importlib.import_module("lightning_hbm.precision.read_plan")  # importing it alone says nothing
    for name in ("read_local_errors", "read_variant", "swapped_copy", "is_read"):
        with pytest.warns(DeprecationWarning, match=rf"precision\.read_plan is deprecated: import {name} from lightning_hbm\.precision\.read_layers"):
            assert getattr(old_module, name) is getattr(read_layers, name)
    with pytest.raises(AttributeError, match="has no attribute 'read_varient'"):
        old_module.read_varient  # noqa: B018
