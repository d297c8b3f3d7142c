"""A quantized layer computed in fp32 (T5's ``wo``, ``Fp32ComputeLinear``) keeps no fp32 copy of its weight for
backward (issue 54: ``benchmarks/layer_kinds.py --checkpointing`` measured T5 at 20,932,100 saved bytes, the
14,640,644 documented before ``wo`` was stored quantized: each ``wo`` kept its dequantized fp32 weight until backward,
4 bytes a weight, the bytes its 4-bit storage saved)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers.linear import Fp32ComputeLinear
from lightning_hbm.memory import saved_activation_bytes
from lightning_hbm.precision.registry import get_format


def feed_forward(keep_in_fp32: bool) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    model._keep_in_fp32_modules = ["2"] if keep_in_fp32 else []  # transformers' attribute (T5: ["wo"])
    quantize_model(model, "nf4-dq", dtype="float32")
    return model


def test_a_layer_computed_in_fp32_saves_no_more_for_backward_than_a_4bit_linear() -> None:
    x = torch.randn(8, 64, requires_grad=True)
    fp32, plain = feed_forward(True), feed_forward(False)
    assert isinstance(fp32[2], Fp32ComputeLinear) and not isinstance(plain[2], Fp32ComputeLinear)
    saved = saved_activation_bytes(lambda: fp32(x).pow(2).mean(), fp32)
    # was 131,072 bytes more: the 512 x 64 dequantized fp32 weight
    assert saved <= saved_activation_bytes(lambda: plain(x).pow(2).mean(), plain) < 512 * 64 * 4


def test_its_gradients_are_those_of_the_matmul_with_the_dequantized_weight() -> None:
    model = feed_forward(True)
    wo = model[2]
    wo.bias.requires_grad_(True)
    x = torch.randn(2, 3, 512, requires_grad=True)
    out = wo(x)
    weight = get_format("nf4-dq").dequantize(wo.storage(), torch.float32)
    x_ref, bias_ref = x.detach().clone().requires_grad_(True), wo.bias.detach().clone().requires_grad_(True)
    want = F.linear(x_ref, weight, bias_ref)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(wo.bias.grad, bias_ref.grad, rtol=1e-6, atol=1e-6)
