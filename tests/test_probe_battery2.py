"""Which output tensor the probe forwards measure (``probe.probe_output``), attacked from outside (session 26).

Was: an output whose first tensor is an integer one (a prediction's ``argmax`` beside the logits) was measured, and
the 4-bit conv plan widened every convolution to int8 to keep class indices equal (planned 0.9547 -> 0.9985 on the
indices; the features measure 0.9904 uniform); a forward returning ``(x, features)`` was measured on its own input
(cosine 1.0 whatever the quantization: no convolution could be widened); a forward returning only an integer tensor
was planned on it; an output holding -inf where the model as built masks (a head masking classes) measured NaN: the
conv plan was chosen on NaN ("planned to a probe output cosine of nan") and the accuracy check went unmeasured, silently.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import centred_cosine
from lightning_hbm.probe import compare_outputs, probe_output

X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


class ConvNet(nn.Module):
    """Two convolutions around a BatchNorm with a trained network's statistics; ``kind`` picks what forward returns."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)
        with torch.no_grad():
            self.bn.running_mean.normal_(0, 0.5)
            self.bn.running_var.uniform_(0.05, 0.2)

    def forward(self, x: torch.Tensor) -> Any:
        features = self.c2(torch.relu(self.bn(self.c1(x))))
        return {
            "features": features,
            "argmax-first": (features.argmax(1), features),
            "input-first": (x, features),
            "dict": {"index": features.argmax(1), "out": {"features": features}},
            "argmax-only": features.argmax(1),
            "masked": torch.cat([features.flatten(1), torch.full((x.shape[0], 4), float("-inf"))], 1),
        }[self.kind]


def _plan(kind: str) -> tuple[Any, list[str]]:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(ConvNet(kind))
    return plugin.quantization.conv_report, [str(w.message) for w in seen]


@pytest.mark.parametrize("kind", ["argmax-first", "input-first", "dict"])
def test_the_plan_measures_the_floating_output_not_indices_or_the_input(kind: str) -> None:
    want, _ = _plan("features")
    got, _ = _plan(kind)
    assert want is not None and got is not None
    assert (got.uniform_cosine, got.cosine, got.modes) == (want.uniform_cosine, want.cosine, want.modes)
    assert want.uniform_cosine < 0.999  # the features do move under nf4: measuring the input read 1.0


def test_an_integer_output_is_not_measured_and_the_plan_says_so() -> None:
    report, said = _plan("argmax-only")
    assert report is None
    assert any("without a measured plan" in s and "a torch.int64 tensor" in s for s in said), said
    with pytest.raises(TypeError, match="return a floating tensor .* got a torch.int64 tensor"):
        probe_output(ConvNet("argmax-only"), X)


def test_an_inf_both_outputs_give_is_left_out_of_the_figures() -> None:
    want, _ = _plan("features")
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(ConvNet("masked"))
    got, measured = plugin.quantization.conv_report, plugin.quantization.conv_accuracy
    assert got is not None and measured is not None
    assert 0.9 < got.uniform_cosine <= got.cosine and got.modes == want.modes  # rows of other widths: another figure
    assert measured.cosine == measured.cosine and measured.cosine > 0.9  # a figure, not NaN
    assert not any("nan" in str(w.message) for w in seen)
    reference = torch.tensor([[1.0, 2.0, float("-inf")], [3.0, -1.0, float("-inf")]])
    assert compare_outputs(reference.clone(), reference, lm=False)["quant/cosine_similarity"] == pytest.approx(1.0)
    assert centred_cosine(reference.flatten(), reference.flatten()) == pytest.approx(1.0)
    worse = reference.clone()
    worse[0, 2] = 0.0  # finite where the reference is -inf: not agreeing, no figure (NaN), as before
    assert centred_cosine(worse.flatten(), reference.flatten()) != centred_cosine(worse.flatten(), reference.flatten())
