"""GPTQ rounding of convolutions (issue 53 item 2): a convolution as a Linear over its input's patches (im2col), its
Hessian from the probe's patches, grouped and depthwise ones per group; the same bytes as nearest rounding."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from conv_models import calibrate, images
from torch import nn

from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.gptq import input_hessians, input_statistics, patches
from lightning_hbm.precision.quantization import Quantization

CONVS: dict[str, Callable[[], nn.Module]] = {
    "2d, strided, padded": lambda: nn.Conv2d(8, 12, 3, stride=2, padding=1),
    "2d grouped, dilated, reflect": lambda: nn.Conv2d(8, 12, 3, padding=2, dilation=2, groups=4, padding_mode="reflect"),
    "2d depthwise": lambda: nn.Conv2d(8, 8, 5, padding=2, groups=8),
    "1d same": lambda: nn.Conv1d(8, 12, 5, padding="same", groups=2),
    "3d": lambda: nn.Conv3d(8, 4, (2, 3, 3), stride=(1, 2, 1), padding=1),
}


@pytest.mark.parametrize("build", CONVS.values(), ids=CONVS.keys())
def test_the_patches_times_the_weight_matrix_are_the_convolution(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    conv = build()
    x = torch.randn(2, 8, *[7, 9, 6][: len(conv.kernel_size)])
    cols = patches(conv, x)  # [groups, rows, in / groups * kernel]
    weight = conv.weight.detach().reshape(conv.groups, conv.out_channels // conv.groups, -1)
    out = (conv(x) - conv.bias.detach().reshape(1, -1, *[1] * len(conv.kernel_size))).detach()
    # [B, out, *positions] -> [groups, rows, out / groups], as the patches' rows run
    want = out.movedim(1, -1).reshape(-1, conv.groups, conv.out_channels // conv.groups).transpose(0, 1)
    torch.testing.assert_close(cols @ weight.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def _errors(conv: nn.Module, x: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
    """Each rounding's output error on ``x`` (what it was fitted to), and the conv's Hessian."""
    model = nn.Sequential(conv)
    hessians, _ = input_statistics(model, ["0"], x)
    with torch.no_grad():
        want = conv(x)
    errors, sizes = {}, {}
    for rounding in ("nearest", "gptq"):
        quantized = copy.deepcopy(model)
        quantize_model(quantized, "nf4-dq", "float32", hessians=hessians if rounding == "gptq" else None)
        with torch.no_grad():
            errors[rounding] = float((quantized(x) - want).norm() / want.norm())
        sizes[rounding] = parameter_bytes(quantized)
    assert sizes["gptq"] == sizes["nearest"]  # the same storage, other indices
    return errors, hessians["0"]


def test_a_gptq_rounded_convolution_reconstructs_its_probe_output_better_than_nearest() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3, padding=1)
    errors, hessian = _errors(conv, images(4, seed=1, size=16).repeat(1, 6, 1, 1)[:, :16])
    assert hessian.shape == (16 * 9, 16 * 9)
    assert errors["gptq"] < 0.8 * errors["nearest"], errors


@pytest.mark.parametrize("groups", [4, 32])
def test_grouped_and_depthwise_convolutions_are_rounded_per_group(groups: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=groups, bias=False)
    x = F.interpolate(torch.randn(4, 32, 4, 4), size=(16, 16), mode="bilinear") + 0.1 * torch.randn(4, 32, 16, 16)
    errors, hessian = _errors(conv, x)
    assert hessian.shape == (groups, 32 // groups * 9, 32 // groups * 9)  # each group sees its own channels
    assert errors["gptq"] < 0.9 * errors["nearest"], errors


class ConvBNNet(nn.Module):
    """Conv-BN-SiLU stages (a detector's backbone in miniature)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for cin, cout, stride, groups in ((3, 16, 1, 1), (16, 32, 2, 1), (32, 32, 1, 32), (32, 64, 1, 1), (64, 64, 1, 4)):
            layers += [nn.Conv2d(cin, cout, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(cout), nn.SiLU()]
        self.body, self.head = nn.Sequential(*layers), nn.Conv2d(64, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_calibrated_batchnorm_conv_net_keeps_more_of_its_output_with_gptq_rounding() -> None:
    torch.manual_seed(0)
    reference = calibrate(ConvBNNet(), images(8, seed=10, batches=2, size=32))
    probe, held_out = images(8, seed=2, size=32), images(8, seed=1, size=32)
    names = [name for name, layer in reference.named_modules() if isinstance(layer, nn.Conv2d)]
    with torch.no_grad():
        want = reference(held_out).flatten()
    cosines, sizes = {}, {}
    for rounding in ("nearest", "gptq"):
        model = copy.deepcopy(reference)
        quantize_model(model, "nf4-dq", "float32", hessians=input_hessians(reference, names, probe) if rounding == "gptq" else None)
        with torch.no_grad():
            cosines[rounding] = F.cosine_similarity(model(held_out).flatten(), want, dim=0).item()  # images the probe never saw
        sizes[rounding] = parameter_bytes(model)
    assert sizes["gptq"] == sizes["nearest"]
    assert cosines["nearest"] < 0.96 and cosines["gptq"] > 0.98, cosines  # measured: 0.954 -> 0.984


def test_rounding_gptq_plans_the_convolutions_rounded_to_nearest_and_stores_them_rounded() -> None:
    torch.manual_seed(0)
    reference = calibrate(ConvBNNet(), images(8, seed=10, batches=2, size=32))
    probe, held_out = images(8, seed=2, size=32), images(8, seed=1, size=32)
    with torch.no_grad():
        want = reference(held_out).flatten()
    plans, cosines = {}, {}
    for rounding in ("nearest", "gptq"):
        model = copy.deepcopy(reference)
        # as QuantizedPrecision("nf4-dq", rounding=...) at fit start: the convolutions' plan on the probe batch
        plan = Quantization(QuantizationConfig("nf4-dq", "float32", probe_batch=probe, rounding=rounding), "QuantizedPrecision")
        plan.check(model, None)
        if rounding == "gptq":
            assert plan.gptq is not None and plan.gptq.hessians is not None
            assert plan.gptq.hessians["body.6"].shape == (32, 9, 9)  # the depthwise convolution: one matrix per channel
        plan.convert(model, None)
        assert plan.conv_report is not None
        plans[rounding] = (plan.conv_report.modes, plan.conv_report.cosine)
        with torch.no_grad():
            cosines[rounding] = F.cosine_similarity(model(held_out).flatten(), want, dim=0).item()
    # measured GPTQ-rounded, the plan would trust a probe GPTQ fitted (fewer int8 layers; held out 0.9887 < 0.9913)
    assert plans["gptq"] == plans["nearest"]
    assert cosines["gptq"] >= cosines["nearest"], cosines
