"""Issue 33: 3-D Parameters are experts only in real expert layers; what else holds weights outside any layer kind
gets its own row (routers, weight_norm factors, RG-LRU gates, position tables). Real transformers classes, tiny
configs, random weights."""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from kind_models import VOCAB, GradientRecorder, ViTClassifier, Wrapped, images
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import coverage, coverage_warnings, kind_of, prepare_model
from lightning_hbm.layers.outside import GROUPED_WEIGHTS, PARAMETRIZED_WEIGHTS, POSITION_TABLES, RAW_WEIGHTS, ROUTER_WEIGHTS
from lightning_hbm.precision import quantize_model

EXPERTS = "Experts (3-D parameters)"


def rows_of(model: nn.Module, quantizing: bool = False) -> dict:
    return {r.kind: r for r in coverage(model, quantizing, False)}


def test_recurrent_gemma_rg_lru_gates_are_not_experts() -> None:
    config = transformers.RecurrentGemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, lru_width=64,
        attention_window_size=16, conv1d_width=4, block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    model = transformers.RecurrentGemmaForCausalLM(config)
    rows = rows_of(model)
    assert EXPERTS not in rows  # was: "Experts (3-D parameters): this variant is not supported yet", MoE advice
    gates = rows[GROUPED_WEIGHTS]
    # per recurrent layer: input and recurrent gate weights [4, 16, 16] and their biases [4, 16]
    assert gates.params == gates.left_alone == 2 * 2 * (4 * 16 * 16 + 4 * 16) and gates.layers == 2
    # each reason names its parameter's own shape; RG-LRU is the example (session 38)
    assert sorted(r.split(" Parameter")[0] for r in gates.reasons) == ["[4, 16, 16]", "[4, 16]"]
    assert all("for example" in r and "RG-LRU" in r for r in gates.reasons)
    assert not [m for m in coverage_warnings(list(rows.values())) if "experts" in m.lower()]


class Temperature(nn.Module):  # EdgeNeXt / Swin-V2 style: a [heads, 1, 1] factor in the module's own batched matmul
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.temperature = nn.Parameter(torch.ones(4, 1, 1))
        self.mix = nn.Parameter(torch.randn(4, 2, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.qkv(x)[..., :8].reshape(4, -1, 2)
        return torch.matmul(q * self.temperature, self.mix)


def test_a_3d_parameter_that_is_no_expert_stack_is_explained_by_its_own_shape() -> None:
    reasons = rows_of(nn.Sequential(Temperature()))[GROUPED_WEIGHTS].reasons
    # was: one text citing RecurrentGemma's RG-LRU gates as if they were these parameters
    assert sorted(r.split(" Parameter")[0] for r in reasons) == ["[4, 1, 1]", "[4, 2, 2]"]
    assert all("no quantized form for a 3-D Parameter that is no expert stack" in r for r in reasons)


def test_wav2vec2_weight_norm_is_a_parametrized_row_with_its_fix() -> None:
    config = transformers.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=32,
    )  # fmt: skip
    model = transformers.Wav2Vec2ForCTC(config)
    rows = rows_of(model)
    assert EXPERTS not in rows
    factors = rows[PARAMETRIZED_WEIGHTS]
    assert factors.params == 64 * 16 * 16 + 16  # weight_norm's v [64, 16, 16] and g [1, 1, 16]
    messages = coverage_warnings(list(rows.values()))
    assert len(messages) == 1, messages
    assert re.search(r"parametrized weights, left as they were .*pos_conv_embed.*remove_parametrizations", messages[0]), messages
    assert "MoE" not in messages[0] and "experts" not in messages[0].lower()

def _mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
def test_moe_experts_stay_experts_and_routers_get_their_row(build: object) -> None:
    torch.manual_seed(0)
    model = build()  # type: ignore[operator]
    experts = [n for n, m in model.named_modules() if kind_of(m) is not None and kind_of(m).name == EXPERTS]
    assert experts == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    rows = rows_of(model)
    router = rows[ROUTER_WEIGHTS]  # was: "weights outside any layer"
    assert RAW_WEIGHTS not in rows and router.params == 2 * 4 * 64 and router.layers == 2
    assert router.unhandled == 0 and "F.linear" in next(iter(router.reasons))
    # converted and quantized: still experts (per-expert Linears, quantized), the routers still their row
    quantize_model(model, "nf4-dq", dtype="float32")
    rows = rows_of(model, quantizing=True)
    assert rows[EXPERTS].quantized == rows[EXPERTS].params > 0
    assert rows[ROUTER_WEIGHTS].params == 2 * 4 * 64


class LearnedPositions(nn.Module):
    """OpenAI CLIP's text tower: a [tokens, width] Parameter added to the embeddings (no leading 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.positional_embedding = nn.Parameter(torch.randn(16, 32))
        self.proj = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(tokens) + self.positional_embedding[: tokens.shape[1]])


def test_a_position_table_is_not_a_weight() -> None:
    rows = rows_of(LearnedPositions())
    assert rows[POSITION_TABLES].params == 16 * 32 and rows[POSITION_TABLES].unhandled == 0
    assert RAW_WEIGHTS not in rows  # was: a 'weights outside any layer' warning (32 % of this model)
    assert not coverage_warnings(list(rows.values()))


def test_prepare_model_leaves_non_expert_3d_parameters_alone() -> None:
    config = transformers.RecurrentGemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, lru_width=64,
        attention_window_size=16, conv1d_width=4, block_types=["recurrent"],
    )  # fmt: skip
    model = transformers.RecurrentGemmaForCausalLM(config)
    assert prepare_model(model) == []


# -------- weights outside any layer, 3-D tables that are no experts


class RawExperts(nn.Module):
    """DBRX's experts: 2-D ``w1``/``v1``/``w2`` Parameters ``[experts * ffn, width]`` used by the module's own code."""

    def __init__(self, experts: int = 4, width: int = 32, ffn: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.ffn = ffn
        self.w1 = nn.Parameter(torch.randn(experts * ffn, width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(experts * ffn, width) / ffn**0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + F.silu(hidden @ self.w1[: self.ffn].t()) @ self.w2[: self.ffn])



def test_weights_outside_any_layer_are_a_named_row_and_warning() -> None:
    """Was: DBRX's experts (68 % of the parameters) counted with the embeddings and norms, no warning."""
    from lightning_hbm.layers import RAW_WEIGHTS, report_coverage

    torch.manual_seed(0)
    module = Wrapped(RawExperts(), "plain")
    quantize_model(module, "nf4-dq", dtype="float32")
    with pytest.warns(UserWarning, match=r"% of the parameters are weights outside any layer, left as they were .*Parameters of \['model'\]"):
        rows = {r.kind: r for r in report_coverage(module, quantizing=True)}
    assert rows[RAW_WEIGHTS].params == rows[RAW_WEIGHTS].left_alone == 2 * 4 * 32 * 32
    assert rows["other (embeddings, norms, ...)"].params == VOCAB * 32  # the embedding stays "other"



def test_vit_trains_and_its_tokens_are_not_called_experts(tmp_path: Any) -> None:
    torch.manual_seed(0)
    module, recorder = ViTClassifier(), GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4), ActivationCheckpointing(), recorder],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([images(1)] * 4, batch_size=None))
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    assert not [w for w in caught if "Experts" in str(w.message)]
    rows = {r.kind: r for r in coverage_of(module)}
    assert "Experts (3-D parameters)" not in rows  # was: "Experts (3-D parameters): this variant is not supported yet"
    assert rows["other (embeddings, norms, ...)"].params >= module.model.class_token.numel() + module.model.encoder.pos_embedding.numel()
    assert rows["MultiheadAttention"].quantized == rows["MultiheadAttention"].params > 0
    blocks = rows["MultiheadAttention"].checkpointed + rows["Linear"].checkpointed
    assert rows["MultiheadAttention"].checkpointed == rows["MultiheadAttention"].params and blocks > 0



def test_siglip_probe_is_no_expert_and_its_patch_convolution_is_adapted() -> None:
    """SigLIP: a 3-D pooling ``probe`` [1, 1, width], nn.MultiheadAttention in the pooling head, a Conv2d patch
    embedding whose weight's dtype its parent reads (harmless for an adapter, so it is adapted; and since session 32 for
    a quantized conv, whose weight reads as its dequantized one: stored quantized too)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
    model = SiglipVisionModel(config)
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4).transform_model(model)
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=True)}
    assert "Experts (3-D parameters)" not in rows  # was: "Experts (3-D parameters): this variant is not supported yet"
    assert rows["MultiheadAttention"].quantized == rows["MultiheadAttention"].adapted == rows["MultiheadAttention"].params
    assert rows["Conv"].adapted == rows["Conv"].params == rows["Conv"].quantized
    model(pixel_values=torch.randn(2, 3, 32, 32)).pooler_output.pow(2).sum().backward()
    lora_b = {n: p.grad for n, p in model.named_parameters() if "lora_A" in n}
    assert lora_b and all(g is not None for g in lora_b.values()), [n for n, g in lora_b.items() if g is None]

