"""The transformers ``Conv1D`` kind (``lightning_hbm/layers/conv1d.py``): GPT-2's layers quantized and adapted."""

from __future__ import annotations

from kind_models import build
from transformers.pytorch_utils import Conv1D

from lightning_hbm import LoRA, quantize_model
from lightning_hbm.layers import coverage


def test_gpt2_conv1d_is_quantized_and_adapted_by_all_linear() -> None:
    module = build("gpt2")
    names = quantize_model(module, "nf4-dq", dtype="float32")
    assert "model.transformer.h.0.attn.c_attn" in names
    assert not any(isinstance(m, Conv1D) for m in module.modules())  # no fp32 Conv1D left
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert "model.transformer.h.0.mlp.c_fc" in lora.adapted_modules
    assert not any(p.requires_grad and p.is_floating_point() and ".lora_" not in n for n, p in module.named_parameters())



def test_gpt2_lora_without_quantization_adapts_conv1d() -> None:
    module = build("gpt2")
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert {"model.transformer.h.0.attn.c_attn", "model.transformer.h.1.mlp.c_proj"} <= set(lora.adapted_modules)
    rows = {r.kind: r for r in coverage(module, quantizing=False, adapting=True)}
    assert rows["Conv1D"].adapted == rows["Conv1D"].params

