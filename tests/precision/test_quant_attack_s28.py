"""Outside-style attack on session 27's quantization-side code (session 28): the accuracy check's record of
data-dependent selections and ``QuantizationQuality``'s KL with masked tokens, on what users' models do. Each test
failed on the code before its fix."""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.probe import PREFIX, Call, compare_outputs, recording_selections

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
from conv_models import YoloDetector, calibrate, images  # noqa: E402


def _ops(forward: Callable[[], object]) -> list[str]:
    calls: list[Call] = []
    with recording_selections(calls) as seen:
        forward()
    return [s.op for s in seen]


def test_a_max_along_a_dimension_whose_indices_are_used_is_a_selection() -> None:
    # ``scores.max(-1)`` gives (values, labels) as argmax does: labels that gather per-class boxes select as argmax,
    # and were not recorded. A max whose indices go unused (PointNet's global max pool ``x.max(2)[0]``), a full
    # reduction and an elementwise maximum select nothing; ``where`` given a condition alone picks as nonzero does
    scores, boxes = torch.rand(5, 3), torch.rand(5, 3, 4)
    assert _ops(lambda: boxes.gather(1, scores.max(-1)[1][:, None, None].expand(-1, 1, 4))) == ["max"]
    assert _ops(lambda: scores.min(dim=0).indices + 1) == ["min"]
    assert _ops(lambda: (scores.max(1)[0], scores.max(), torch.max(scores, scores), torch.where(scores > 0.5, scores, 0.0))) == []
    assert _ops(lambda: torch.where(scores > 0.5)) == ["where"]
    with recording_selections([]) as seen:  # unused indices are not held for the rest of the forward
        labels = scores.max(1).indices
        held = weakref.ref(labels)
        del labels
        assert held() is None and seen == []


class PerClass(nn.Module):
    """A detector with a box per class (Faster R-CNN's regression): each cell's box is the one of its best class,
    picked by ``max``'s indices (8 classes, BatchNorm calibrated on image-like batches)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = YoloDetector(classes=8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.cat([level.float().flatten(2) for level in self.model(x)], 2).transpose(1, 2)  # B, cells, 64 + 8
        boxes = y[..., :64].reshape(*y.shape[:2], 8, 8)  # 8 numbers per class
        best, label = y[..., 64:].sigmoid().max(-1)
        return boxes.gather(2, label[..., None, None].expand(-1, -1, 1, 8))[:, :, 0], best


@pytest.mark.slow  # about 2 s: an int8 quantization of 54 convolutions and three forwards
def test_a_healthy_detector_picking_boxes_by_max_is_measured_before_the_pick() -> None:
    # was: the boxes picked by labels that flip between near-equal classes compared as they came, int8 in bfloat16
    # read 0.9296 and was warned (the same model with argmax: 0.9904 at the heads, quiet)
    torch.manual_seed(0)
    detector = PerClass()
    calibrate(detector.model, images(8, seed=10, batches=4))
    plugin = QuantizedPrecision("int8", dtype="bfloat16", probe_batch=images(4, seed=2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(copy.deepcopy(detector.eval()))
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.selected is not None and measured.selected.startswith("max picked other")
    assert measured.measured_at == "model" and 0.985 < measured.cosine < 1.0 and not measured.warned
    assert not [w for w in seen if "lightning_hbm" in str(w.message)]



@pytest.mark.parametrize("mask", [-1e9, torch.finfo(torch.float32).min])
def test_a_mask_that_rounds_to_minus_inf_in_half_precision_adds_no_kl(mask: float) -> None:
    # a vocabulary masked with -1e9 (or float32's lowest) as built: float16 (and bfloat16, for float32's lowest) round
    # it to -inf, a token of probability 0 either way. Was: KL inf, warned "the quantized model gives -inf (no
    # probability) to 200 token(s) the full-precision model gives probability to"
    torch.manual_seed(0)
    reference = torch.randn(4, 10, 32)
    reference[..., :5] = mask
    computed = (reference + 0.01 * torch.randn_like(reference)).half()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl = compare_outputs(computed, reference, lm=True)[PREFIX + "kl_divergence"]
    assert 0 < kl < 1e-3
    computed[0, 0, 7] = float("-inf")  # one token the model as built gives mass to, ruled out: still inf, warned
    with pytest.warns(UserWarning, match=r"KL divergence is inf: .* -inf \(no probability\) to 1 token\(s\)"):
        assert compare_outputs(computed, reference, lm=True)[PREFIX + "kl_divergence"] == float("inf")


def test_a_mask_of_the_lowest_float_both_models_give_is_agreement_not_nan() -> None:
    # logits masked with torch.finfo(dtype).min (float32's as built; bfloat16 rounds it to -inf): its square overflows,
    # the cosine and relative error of identical outputs were NaN (QuantizationQuality then reported a crossed
    # threshold on a model that agrees)
    torch.manual_seed(0)
    reference = torch.randn(4, 10, 32)
    reference[..., :5] = torch.finfo(torch.float32).min
    same = compare_outputs(reference.clone(), reference, lm=True)
    assert same[PREFIX + "cosine_similarity"] == pytest.approx(1.0) and same[PREFIX + "relative_error"] == 0.0
    rounded = compare_outputs((reference + 0.01 * torch.randn_like(reference)).bfloat16(), reference, lm=True)
    assert 0.999 < rounded[PREFIX + "cosine_similarity"] <= 1.0 and 0 < rounded[PREFIX + "relative_error"] < 0.05
