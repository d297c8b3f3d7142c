"""Token-wise or not, decided on fake tensors by following the ops (``activations/token_rows.py``), on real library
layers; and never "chunk" where the real, value-based decision says no (the plan would then be under the run)."""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
import transformers as tf
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_hbm import quantize_model
from lightning_hbm.activations.token_chunks import decide
from lightning_hbm.activations.token_rows import fake_rowwise_reason
from lightning_hbm.models import NanoGPT

SHAPE = (2, 16, 64)


def _llama() -> nn.Module:
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=100)
    return tf.LlamaForCausalLM(config).model.layers[0]


def _gemma2_mlp() -> nn.Module:
    config = tf.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=100)
    return tf.Gemma2ForCausalLM(config).model.layers[0].mlp


def _falcon_mlp() -> nn.Module:
    return tf.FalconForCausalLM(tf.FalconConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=100)).transformer.h[0].mlp


def _t5_ff() -> nn.Module:
    config = tf.T5Config(d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=100)
    return tf.T5ForConditionalGeneration(config).encoder.block[0].layer[1]


def _nanogpt_attention() -> nn.Module:
    return NanoGPT(vocab_size=100, n_layer=1, n_head=4, n_embd=64, block_size=32).model.h[0].attn


def _quantized_llama_mlp() -> nn.Module:
    mlp = _llama().mlp
    quantize_model(mlp, "nf4-dq", "float32")  # bitsandbytes' gemm_4bit: a format's own matmul operator
    return mlp


def _qlora_llama_mlp() -> nn.Module:
    import peft

    from lightning_hbm._compat import peft as peft_compat
    from lightning_hbm.adapters.lora.forward import lora_forward

    mlp = _quantized_llama_mlp()
    peft_compat.mark_quantized(mlp, ["4bit"])
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]), mlp)
    assert all(lora_forward(getattr(mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))  # the sum inside addmm
    return mlp


def _qwen3_moe_mlp() -> nn.Module:
    """Qwen3-MoE's sparse block with its experts as the surgery leaves them (``LinearExperts``): on fake tensors the
    experts gather their tokens by index and add them back with ``index_add_`` (was refused: "runs aten.index.Tensor
    on its tokens", so a plan with mlp_chunks counted the MoE's whole recompute, +33 % over the measured step at 256
    tokens, tests/planner/test_families_s38.py)."""
    from lightning_hbm.layers.experts import LinearExperts

    config = tf.Qwen3MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                               num_experts_per_tok=2, vocab_size=100)
    block = tf.Qwen3MoeForCausalLM(config).model.layers[0].mlp
    block.experts = LinearExperts.from_transformers(block.experts)
    return block


class _GathersBack(nn.Module):
    """Rows gathered by an index over the tokens, computed, and added back (``flip``: to other tokens than theirs)."""

    def __init__(self, flip: bool = False, mix: bool = False) -> None:
        super().__init__()
        self.up, self.flip, self.mix = nn.Linear(64, 128), flip, mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        index = torch.arange(rows.shape[0])
        out = self.up(rows[index])[:, :64]
        if self.mix:  # gathered rows combined with the tokens themselves: the index may reorder them
            out = out + rows
        final = torch.zeros_like(rows).index_add_(0, index.flip(0) if self.flip else index, out)
        return final.view(x.shape)


class _MixesInAddmm(nn.Module):  # the tokens on the right of a matmul: each output row sums over every token
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        return torch.addmm(rows, torch.ones(rows.shape[0], rows.shape[0]), rows).view(x.shape)


class _AddsPositions(nn.Module):  # each token gets its position's row: token-wise per row, wrong in chunks
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(x) + torch.arange(x.shape[-2], dtype=x.dtype)[:, None]


class _MeanOverTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 4.0) - x.mean(dim=-2, keepdim=True)


ACCEPTED: dict[str, Callable[[], nn.Module]] = {
    "llama-mlp": lambda: _llama().mlp,
    "llama-norm": lambda: _llama().input_layernorm,
    "gemma2-mlp": _gemma2_mlp,
    "falcon-mlp": _falcon_mlp,
    "nf4-llama-mlp": _quantized_llama_mlp,
    "qlora-llama-mlp": _qlora_llama_mlp,
    "qwen3-moe-mlp": _qwen3_moe_mlp,
    "gathered-and-added-back": _GathersBack,
}
REFUSED: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "nanogpt-attention": (_nanogpt_attention, r"runs aten\.transpose\.int across tokens"),
    "t5-ff-training": (_t5_ff, r"draws random numbers \(aten\.bernoulli_"),
    "positions": (_AddsPositions, r"combines its tokens with a tensor of shape \(16, 1\) along them"),
    "mean-over-tokens": (_MeanOverTokens, r"runs aten\.mean\.dim across tokens"),
    "convolution": (lambda: nn.Conv1d(16, 16, 3, padding=1), r"aten\.convolution\.default on its tokens"),
    "tokens-right-of-addmm": (_MixesInAddmm, r"multiplies across its tokens \(aten\.addmm\.default\)"),
    "gathered-added-to-other-tokens": (lambda: _GathersBack(flip=True), r"adds rows to tokens other than those they were gathered from"),
    "gathered-mixed-with-tokens": (lambda: _GathersBack(mix=True), r"combines rows gathered by different indices or with its tokens"),
}


def _fake_reason(layer: nn.Module) -> str:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return fake_rowwise_reason(layer, layer, torch.randn(*SHAPE))


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_token_wise_layers_are_accepted(name: str) -> None:
    torch.manual_seed(0)
    assert _fake_reason(ACCEPTED[name]().train()) == ""


@pytest.mark.parametrize("name", list(REFUSED))
def test_layers_that_may_mix_tokens_are_refused_by_name(name: str) -> None:
    torch.manual_seed(0)
    factory, reason = REFUSED[name]
    got = _fake_reason(factory().train())
    assert re.search(reason, got), got


@pytest.mark.parametrize("name", [*ACCEPTED, *REFUSED])
def test_the_fake_decision_never_chunks_what_the_real_one_refuses(name: str) -> None:
    torch.manual_seed(0)
    layer: Any = ACCEPTED[name]() if name in ACCEPTED else REFUSED[name][0]()
    layer.train()
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = decide(layer, layer, 2, (torch.randn(*SHAPE),), {})
    real = decide(layer, layer, 2, (torch.randn(*SHAPE),), {})
    assert real == "" or fake != "", (fake, real)
    if name in ("llama-mlp", "gemma2-mlp", "falcon-mlp", "nf4-llama-mlp", "qlora-llama-mlp", "qwen3-moe-mlp"):
        assert fake == real == ""  # the MLPs: planned chunked, as they run
