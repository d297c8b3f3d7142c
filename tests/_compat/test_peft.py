"""lightning_hbm._compat.peft against the installed peft: the test fails when peft stops reading the flags."""

from __future__ import annotations

import bitsandbytes as bnb
import peft
import pytest
import torch
from conftest import peft_lora_layer
from peft.tuners.lora import bnb as lora_bnb
from torch import nn

from lightning_hbm._compat import peft as compat


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "4bit":
        layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4").to("cpu")
    else:
        layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(torch.randn(64, 64), requires_grad=False, has_fp16_weights=False).to("cpu")
    return nn.Sequential(layer)


@pytest.mark.parametrize(("kind", "aware"), [("4bit", "Linear4bit"), ("8bit", "Linear8bitLt")])
def test_mark_quantized_picks_peft_bitsandbytes_layers(kind: str, aware: str) -> None:
    config = peft.LoraConfig(r=4, target_modules=["0"])
    plain = peft.inject_adapter_in_model(config, _model(kind))
    assert not isinstance(plain[0], getattr(lora_bnb, aware))  # unmarked: peft's generic layer
    marked = _model(kind)
    compat.mark_quantized(marked, [kind])
    assert getattr(marked, f"is_loaded_in_{kind}") is True
    assert isinstance(peft.inject_adapter_in_model(config, marked)[0], getattr(lora_bnb, aware))


@pytest.mark.parametrize("kind", ["plain", "4bit"])
def test_keep_input_dtype_stops_peft_casting_the_input(kind: str) -> None:
    """peft's plain and bitsandbytes LoRA layers cast the input through ``_cast_input_dtype``, which reads the flag."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False)) if kind == "plain" else _model("4bit")
    compat.mark_quantized(model, ["4bit"] if kind == "4bit" else [])
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["0"]), model)
    layer = model[0]
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    seen: list[torch.dtype] = []
    layer.lora_A["default"].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    assert layer._cast_input_dtype(x, torch.float32).dtype == torch.float32  # peft casts by default
    compat.keep_input_dtype(layer)
    assert layer._cast_input_dtype(x, torch.float32) is x
    layer.lora_A["default"].to(torch.bfloat16)
    layer.lora_B["default"].to(torch.bfloat16)
    if kind == "plain":
        layer.base_layer.to(torch.bfloat16)
    layer(x)  # the forward goes through the same switch: lora_A sees the input's own dtype
    assert seen == [torch.bfloat16]


@pytest.mark.parametrize("kind", ["plain", "4bit"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dora", [False, True])
def test_adapter_first_is_peft_forward_to_the_bit(kind: str, dtype: torch.dtype, dora: bool) -> None:
    """LoRAForward's unfused sum, adapter first in a recompute, reproduces the installed peft's LoRA forward
    (cast_input, is_4bit_lora): the output and every gradient equal to the bit (DoRA falls back to peft's own forward)."""
    import copy

    from lightning_hbm.adapters.lora.forward import lora_forward, recomputing

    reference = peft_lora_layer(kind, dtype, dora)
    changed = copy.deepcopy(reference)
    assert compat.is_plain_lora_linear(changed) and compat.is_4bit_lora(changed) == (kind == "4bit")
    forward = lora_forward(changed, fuse=False)
    assert forward is not None
    forward.first = True
    x = torch.randn(3, 5, 64, dtype=dtype)
    results = []
    for layer in (reference, changed):
        source = x.clone().requires_grad_(True)
        with recomputing():
            out = layer(source * 1.0)  # the input has two users in the layer: the base and lora_A
        out.backward(torch.ones_like(out))
        grads = [p.grad for p in layer.parameters() if p.requires_grad]
        results.append((out, source.grad, grads))
    (out_a, x_a, g_a), (out_b, x_b, g_b) = results
    assert out_a.dtype == out_b.dtype and torch.equal(out_a, out_b)
    assert torch.equal(x_a, x_b) and len(g_a) == len(g_b) >= 2
    assert all(torch.equal(a, b) for a, b in zip(g_a, g_b))
    assert compat.cast_input(changed, x, torch.float32).dtype == torch.float32


def test_adapter_first_only_on_the_layers_it_reproduces() -> None:
    from peft.tuners.lora import bnb as lora_bnb

    from lightning_hbm.adapters.lora.order import adapter_first, is_adapter_first

    four = peft_lora_layer("4bit", torch.float32)
    assert adapter_first(four) and is_adapter_first(four)  # bitsandbytes' 4-bit matmul saves nothing for backward
    assert adapter_first(four)  # already: a later Trainer's callback lists it too
    other = peft_lora_layer("4bit", torch.float32)
    other.forward = other.forward  # another instance forward (as another lightning_hbm feature sets)
    assert not adapter_first(other) and not is_adapter_first(other)
    dense = peft_lora_layer("plain", torch.float32)
    assert compat.is_plain_lora_linear(dense) and not adapter_first(dense)  # F.linear saves its weight
    eight = _model("8bit")
    compat.mark_quantized(eight, ["8bit"])
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["0"]), eight)
    assert isinstance(eight[0], lora_bnb.Linear8bitLt) and not compat.is_plain_lora_linear(eight[0])
    assert not adapter_first(eight[0]) and "forward" not in vars(eight[0])
    assert not adapter_first(nn.Linear(4, 4))
