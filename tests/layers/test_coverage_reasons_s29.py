"""The coverage table names why every quantized layer has no adapter while LoRA adapts others (session 29 review):
the ``ConvTranspose`` row of a quantized decoder showed 0 adapted and no reason, as did the depthwise convolutions of
a quantized conv net and the layers left out of ``target_modules``."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hbm import LoRA
from lightning_hbm.layers import CoverageRow, coverage
from lightning_hbm.layers.conv_transpose import NOT_ADAPTED
from lightning_hbm.precision import quantize_model


class TinyDecoder(nn.Module):
    """A latent decoder without diffusers: a Linear to a 4x4 map, a transposed convolution (x2), a depthwise and a
    pointwise convolution."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 16 * 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.depthwise(self.up(self.proj(x).view(-1, 16, 4, 4))))


def _table(model: nn.Module, lora: LoRA) -> dict[str, CoverageRow]:
    quantize_model(model, "nf4-dq", dtype="float32")
    lora.transform_model(model)
    return {r.kind: r for r in coverage(model, quantizing=True, adapting=True)}


def _unadapted_without_reason(rows: dict[str, CoverageRow]) -> list[str]:
    kinds = [r for kind, r in rows.items() if not kind.startswith(("LoRA adapters", "other"))]
    return [r.kind for r in kinds if r.adapted < r.params and not r.reasons]


def test_a_quantized_transposed_convolution_names_why_it_has_no_adapter() -> None:
    model = TinyDecoder()
    rows = _table(model, LoRA(r=2))
    up, conv = rows["ConvTranspose"], rows["Conv"]
    assert up.quantized == up.params == 16 * 8 * 2 * 2 + 8 and up.adapted == 0
    assert up.reasons == {NOT_ADAPTED: up.params}  # was {}: "0 adapted" without a word
    assert up.unhandled == 0  # quantized, left unadapted by design: in the table, not warned
    depthwise = 8 * 3 * 3 + 8
    assert conv.adapted == conv.params - depthwise  # the pointwise one
    assert [n for why, n in conv.reasons.items() if "grouped/depthwise" in why] == [depthwise]
    assert _unadapted_without_reason(rows) == []


def test_a_quantized_layer_left_out_of_target_modules_says_so() -> None:
    model = TinyDecoder()
    rows = _table(model, LoRA(r=2, target_modules=["out"]))
    assert rows["Linear"].adapted == 0
    assert list(rows["Linear"].reasons) == ["not adapted: not a LoRA target (LoRA(target_modules=[...]) names the layers it adapts)"]
    assert _unadapted_without_reason(rows) == []


def test_a_transformers_model_from_config_has_no_unadapted_kind_without_a_reason() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    rows = _table(model, LoRA(r=2))
    assert rows["Linear"].adapted == rows["Linear"].params - 128 * 32  # every projection; the head is left out
    assert _unadapted_without_reason(rows) == []
