"""A quantized convolution keeps no dense copy of its weight for backward (session 23): it dequantized its weight in the
forward and convolved with it, so autograd saved the dequantized weight in the compute dtype until the backward (two
frozen 256->256 3x3 convolutions: 4,849,668 saved bytes quantized against 131,076 unquantized), the bytes its 4-bit
storage saved. The backward now dequantizes it again, as bitsandbytes' 4-bit matmul does."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hbm import LoRA
from lightning_hbm.layers import QuantizedConv2d
from lightning_hbm.memory import saved_activation_bytes
from lightning_hbm.precision import quantize_model

CONVS: list[Callable[[], nn.Module]] = [
    lambda: nn.Conv1d(16, 32, 5, stride=2, padding=2),
    lambda: nn.Conv2d(16, 32, 3, padding=1, dilation=2, bias=False),
    lambda: nn.Conv2d(32, 32, 3, padding=1, groups=32, padding_mode="reflect"),  # depthwise, reflect padding
    lambda: nn.Conv2d(16, 32, 4, padding="same"),  # uneven 'same': the input is padded first
    lambda: nn.Conv2d(16, 32, (3, 5), stride=(2, 1), padding=(1, 2), groups=4),
    lambda: nn.Conv3d(8, 16, 3, padding=1),
    lambda: nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1),
    lambda: nn.ConvTranspose2d(16, 32, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=2),
    lambda: nn.ConvTranspose3d(8, 4, 2, stride=2, bias=False),
]


def frozen_convs(quantized: bool, kind: type[nn.Module] = nn.Conv2d) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(kind(256, 256, 3, padding=1), nn.ReLU(), kind(256, 256, 3, padding=1))
    model.requires_grad_(False)
    if quantized:
        quantize_model(model, "nf4-dq", dtype="float32")
    return model


@pytest.mark.parametrize("kind", [nn.Conv2d, nn.ConvTranspose2d])
def test_quantized_convolutions_save_no_more_for_backward_than_unquantized_ones(kind: type[nn.Module]) -> None:
    x = torch.randn(1, 256, 8, 8, requires_grad=True)
    plain, quantized = frozen_convs(False, kind), frozen_convs(True, kind)
    saved = saved_activation_bytes(lambda: quantized(x).pow(2).mean(), quantized)
    # was 4,849,668: each convolution's 256 x 256 x 3 x 3 dequantized fp32 weight (2,359,296 bytes) besides
    assert saved <= saved_activation_bytes(lambda: plain(x).pow(2).mean(), plain) < 256 * 256 * 9 * 4


def one_quantized(conv: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    """The quantized layer, and the plain one holding its dequantized weight (what the forward computed with before)."""
    torch.manual_seed(0)
    module = nn.Sequential(conv())
    quantize_model(module, "nf4-dq", dtype="float32")
    layer = module[0]
    reference = copy.deepcopy(conv())
    reference.weight = nn.Parameter(layer.weight.clone(), requires_grad=False)
    if layer.bias is not None:
        layer.bias.requires_grad_(True)  # a trained bias (LoRA(bias="all"))
        reference.bias = nn.Parameter(layer.bias.detach().clone())
    return layer, reference


@pytest.mark.parametrize("conv", CONVS)
def test_gradients_are_those_of_the_convolution_with_the_dequantized_weight(conv: Callable[[], nn.Module]) -> None:
    layer, reference = one_quantized(conv)
    spatial = reference.weight.dim() - 2
    x = torch.randn(2, reference.in_channels, *([9] * spatial), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, want = layer(x), reference(x_ref)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    # the same aten convolution backward as the plain layer's: bit-exact
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    if reference.bias is not None:
        torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=0, atol=0)


def test_under_bf16_autocast_the_gradient_is_the_plain_layers() -> None:
    layer, reference = one_quantized(lambda: nn.Conv2d(16, 32, 3, padding=1))
    x = torch.randn(2, 16, 9, 9, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = layer(x), reference(x_ref)
    assert out.dtype == want.dtype == torch.bfloat16
    out.float().pow(2).sum().backward()
    want.float().pow(2).sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)


def lora_cnn(quantized: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 1))
    if quantized:
        quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4, target_modules="all-linear").transform_model(model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # peft starts B at zero: the gradient of A would be zero
    return model


def test_lora_adapter_gradients_match_the_plain_convolution_with_the_dequantized_weight_with_and_without_checkpointing() -> None:
    quantized, plain = lora_cnn(True), lora_cnn(False)
    with torch.no_grad():  # the plain model computes with the quantized model's dequantized weights
        plain_modules = dict(plain.named_modules())
        copied = [plain_modules[name].weight.copy_(m.weight) for name, m in quantized.named_modules() if isinstance(m, QuantizedConv2d)]
    assert len(copied) == 3
    x = torch.randn(2, 8, 10, 10, requires_grad=True)
    runs = {}
    for label, model, wrap in (("quantized", quantized, False), ("plain", plain, False), ("checkpointed", quantized, True)):
        model.zero_grad()
        x.grad = None
        out = checkpoint(model, x, use_reentrant=False) if wrap else model(x)
        out.pow(2).mean().backward()
        runs[label] = [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
    assert len(runs["plain"]) == len(runs["quantized"]) > 6  # x and three convolutions' lora_A, lora_B
    for got, want, again in zip(runs["quantized"], runs["plain"], runs["checkpointed"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(again, got, rtol=0, atol=0)
