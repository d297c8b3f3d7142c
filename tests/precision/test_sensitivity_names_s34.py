"""The convolutions' mode choice and ``predict_parameter_bytes``'s argument renamed (issue 54, session 34): "plan" names
the planner's alone. The former names still give the same object, with a DeprecationWarning naming the new one
(listed in docs/extending.md's "Renamed names" table, checked by tests/test_renamed_s33.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hbm.precision import sensitivity
from lightning_hbm.precision.sensitivity import (
    CONV_TARGET_COSINE,
    predict_parameter_bytes,
    unmeasured_convs_warning,
    widened_convs_warning,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def test_the_former_conv_names_give_the_renamed_objects() -> None:
    assert CONV_TARGET_COSINE == 0.985
    with pytest.warns(DeprecationWarning, match=r"CONV_PLAN_TARGET is deprecated: use CONV_TARGET_COSINE \(the same value\)"):
        assert sensitivity.CONV_PLAN_TARGET == CONV_TARGET_COSINE
    with pytest.warns(DeprecationWarning, match=r"unplanned_convs_warning is deprecated: use unmeasured_convs_warning \(the same function\)"):
        assert sensitivity.unplanned_convs_warning is unmeasured_convs_warning
    with pytest.warns(DeprecationWarning, match=r"planned_convs_warning is deprecated: use widened_convs_warning \(the same function\)"):
        from lightning_hbm.precision.sensitivity import planned_convs_warning  # the import form warns too
    assert planned_convs_warning is widened_convs_warning


def test_predict_parameter_bytes_takes_layer_modes_and_its_former_keyword_plan() -> None:
    model, modes = _model(), {"0": "nf4", "2": "int8"}
    expected = predict_parameter_bytes(model, modes, "float32")
    assert predict_parameter_bytes(model, layer_modes=modes, dtype="float32") == expected
    assert expected < predict_parameter_bytes(model, {}, "float32")  # quantized: fewer bytes than all in float32
    with pytest.warns(DeprecationWarning, match=r"predict_parameter_bytes\(plan=\.\.\.\) is deprecated: pass layer_modes=\.\.\. "
                      r"\(the same \{layer name: mode name\} dict\)"):
        assert predict_parameter_bytes(model, plan=modes, dtype="float32") == expected  # type: ignore[call-arg]


def test_predict_parameter_bytes_refuses_both_names_or_none() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"predict_parameter_bytes\(layer_modes=\.\.\., plan=\.\.\.\): plan is the former name of "
                       r"layer_modes; pass the \{layer name: mode name\} dict once, as layer_modes\."):
        predict_parameter_bytes(model, {"0": "nf4"}, plan={"0": "nf4"})
    with pytest.raises(TypeError, match=r"predict_parameter_bytes\(\) needs layer_modes, the \{layer name: mode name\} dict of the "
                       r"layers to quantize \(e\.g\. \{'fc1': 'nf4'\}; \{\} for none\)\."):
        predict_parameter_bytes(model)
