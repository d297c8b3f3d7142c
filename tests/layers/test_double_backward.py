"""A second derivative through a quantized layer (issue 53 item 3, session 24): a gradient penalty (WGAN-GP, R1 in
StyleGAN-like discriminators) takes ``torch.autograd.grad(out, x, create_graph=True)`` and backpropagates a function
of it. The frozen-weight autograd Function (:class:`~lightning_hbm.layers.frozen_weight.FrozenWeight`, which runs the
convolutions, the transposed convolutions and T5's fp32-computed ``wo``) computes the input gradient in its backward: with
``create_graph`` that backward is recorded by autograd (``aten.convolution_backward`` and a matmul are differentiable
in the gradient they take), so the penalty's gradient is the one of the same model with the dequantized weight held
as a plain frozen weight, to the bit on CPU. Checked here against that exact reference, for every quantized layer kind
that runs its own backward, with a trained bias and LoRA adapters (the penalty's gradient must reach them)."""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA
from lightning_hbm.layers import stored_in
from lightning_hbm.layers.linear import Fp32ComputeLinear
from lightning_hbm.precision import quantize_model


def _dequantized_copy(layer: nn.Module, plain: nn.Module) -> nn.Module:
    """``plain`` (the layer as built) holding ``layer``'s dequantized weight as a frozen Parameter: the exact reference."""
    reference = copy.deepcopy(plain)
    with torch.no_grad():
        reference.weight = nn.Parameter(layer.weight.detach().clone().to(reference.weight.dtype), requires_grad=False)
    reference.bias = layer.bias  # the same trained Parameter
    return reference


def _penalty_gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """R1: ``||d sum(D(x)) / dx||^2``, backpropagated to ``x`` and to every trainable parameter."""
    x = x.clone().requires_grad_(True)
    (grad_x,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    penalty = grad_x.pow(2).sum()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(penalty, [x, *params.values()], allow_unused=True)
    return {"input": grads[0], **{n: g for n, g in zip(params, grads[1:])}}


def _discriminator(layer: nn.Module, tail: nn.Module) -> nn.Sequential:
    # a curved activation after the layer: with a linear one, the penalty's gradient would not depend on the input
    return nn.Sequential(layer, nn.SiLU(), nn.Flatten(), tail)


LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "conv2d": (lambda: nn.Conv2d(4, 8, 3, padding=1), (2, 4, 6, 6)),
    "conv2d-strided-reflect": (lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1, padding_mode="reflect"), (2, 4, 6, 6)),
    "conv1d-grouped": (lambda: nn.Conv1d(4, 8, 3, padding=1, groups=2), (2, 4, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 4, 2), (1, 2, 3, 3, 3)),
    "conv-transpose2d": (lambda: nn.ConvTranspose2d(4, 8, 2, stride=2), (2, 4, 3, 3)),
}


@pytest.mark.parametrize("adapted", [False, True], ids=["frozen", "lora"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_gradient_penalty_through_a_quantized_convolution_equals_the_dequantized_reference(kind: str, adapted: bool) -> None:
    build, shape = LAYERS[kind]
    torch.manual_seed(0)
    plain = build()
    model = nn.Sequential(copy.deepcopy(plain))
    quantize_model(model, "nf4-dq", dtype="float32")
    assert stored_in(model[0]) is not None
    width = model[0](torch.zeros(shape)).numel() // shape[0]
    tail = nn.Linear(width, 1)
    quantized = _discriminator(model[0], tail)
    reference = _discriminator(_dequantized_copy(model[0], plain), tail)
    if adapted:
        if kind in ("conv-transpose2d", "conv1d-grouped"):
            pytest.skip("not a LoRA target: peft has no transposed-convolution layer and needs r divisible by groups")
        targets = ["0"]
        quantized, reference = (LoRA(r=2, target_modules=targets).transform_model(m) or m for m in (quantized, reference))
        with torch.no_grad():  # a nonzero update, the same in both
            for ours, theirs in zip(quantized[0].lora_B.values(), reference[0].lora_B.values()):
                ours.weight.normal_(generator=torch.Generator().manual_seed(3))
                theirs.weight.copy_(ours.weight)
            for ours, theirs in zip(quantized[0].lora_A.values(), reference[0].lora_A.values()):
                theirs.weight.copy_(ours.weight)
    quantized[0].bias.requires_grad_(True)  # a trained bias (LoRA(bias="all")) gets the penalty's gradient too
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got, want = _penalty_gradients(quantized, x), _penalty_gradients(reference, x)
    assert set(got) == set(want)
    assert want["input"].abs().sum() > 0 and (not adapted or want["0.lora_B.default.weight"].abs().sum() > 0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_gradient_penalty_through_a_linear_computed_in_fp32_equals_the_dequantized_reference() -> None:
    """T5's ``wo`` (``_keep_in_fp32_modules``): ``FrozenWeight`` dequantizes into fp32 again in its backward."""
    torch.manual_seed(0)
    plain = nn.Linear(8, 8)
    model = nn.Sequential(copy.deepcopy(plain))
    model._keep_in_fp32_modules = ["0"]  # type: ignore[assignment]  # transformers' attribute
    quantize_model(model, "nf4-dq", dtype="float32")
    assert isinstance(model[0], Fp32ComputeLinear)
    tail = nn.Linear(8, 1)
    quantized = nn.Sequential(model[0], nn.SiLU(), tail)
    reference = nn.Sequential(_dequantized_copy(model[0], plain), nn.SiLU(), tail)
    quantized[0].bias.requires_grad_(True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    got, want = _penalty_gradients(quantized, x), _penalty_gradients(reference, x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_bitsandbytes_4bit_linear_gives_the_dequantized_references_second_derivative() -> None:
    """Not ours (bitsandbytes' ``MatMul4Bit``), checked for the record: on CPU its backward is recorded too."""
    torch.manual_seed(0)
    plain = nn.Linear(8, 8)
    model = nn.Sequential(copy.deepcopy(plain))
    quantize_model(model, "nf4-dq", dtype="float32")
    import bitsandbytes as bnb

    layer = model[0]
    assert isinstance(layer, bnb.nn.Linear4bit)
    layer.support_avx512bf16_for_cpu = False  # verified-facts: the CPU fast path bypasses autograd
    dequantized = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    reference = copy.deepcopy(plain)
    reference.weight = nn.Parameter(dequantized, requires_grad=False)
    reference.bias = layer.bias
    tail = nn.Linear(8, 1)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    got = _penalty_gradients(nn.Sequential(layer, nn.SiLU(), tail), x)
    want = _penalty_gradients(nn.Sequential(reference, nn.SiLU(), tail), x)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
