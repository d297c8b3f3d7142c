"""lightning_hbm._compat.peft against the installed peft: the test fails when peft stops reading the flags."""

from __future__ import annotations

import bitsandbytes as bnb
import peft
import pytest
import torch
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
