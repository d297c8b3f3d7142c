"""Output heads found by one rule in every model (:func:`lightning_hbm.layers.output_heads`).

A nanoGPT-style untied ``lm_head`` (:class:`lightning_hbm.models.GPT`) and a torchtune-style model whose head
is named ``output``: each head stays in the compute dtype with a coverage row saying why,
``quantize_head=True`` quantizes it, and ``FusedLoss`` finds it without ``heads=``.
"""

from __future__ import annotations

import logging
from typing import Callable

import bitsandbytes as bnb
import pytest
import torch
from torch import nn

from lightning_hbm import FusedLoss, quantize_model
from lightning_hbm.activations.loss import default_heads
from lightning_hbm.layers import coverage, output_heads
from lightning_hbm.models import GPT

VOCAB, DIM = 96, 32


class TorchtuneStyle(nn.Module):
    """torchtune's layout: ``tok_embeddings``, ``layers``, ``norm``, ``output`` (no ``lm_head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 64), nn.GELU(), nn.Linear(64, DIM)) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.output(self.norm(x))


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=DIM, bias=True)


def _torchtune() -> nn.Module:
    torch.manual_seed(0)
    return TorchtuneStyle()


MODELS = [pytest.param(_gpt, "lm_head", id="nanogpt-untied"), pytest.param(_torchtune, "output", id="torchtune")]


@pytest.mark.parametrize(("make", "head"), MODELS)
def test_head_found_and_kept_in_compute_dtype(make: Callable[[], nn.Module], head: str) -> None:
    model = make()
    assert output_heads(model) == [head]
    names = quantize_model(model, "nf4", dtype="bfloat16")
    assert head not in names and len(names) >= 4
    layer = model.get_submodule(head)
    assert type(layer) is nn.Linear and layer.weight.dtype == torch.bfloat16
    reasons = {r for row in coverage(model, quantizing=True, adapting=False) for r in row.reasons}
    assert "output head kept in full precision (quantize_head=True quantizes it)" in reasons


@pytest.mark.parametrize(("make", "head"), MODELS)
def test_quantize_head_quantizes_it(make: Callable[[], nn.Module], head: str) -> None:
    model = make()
    names = quantize_model(model, "nf4", dtype="bfloat16", quantize_head=True)
    assert head in names
    assert isinstance(model.get_submodule(head), bnb.nn.Linear4bit)


@pytest.mark.parametrize(("make", "head"), MODELS)
def test_fused_loss_finds_the_head(make: Callable[[], nn.Module], head: str) -> None:
    model = make()
    assert default_heads(model) == [head]
    assert FusedLoss()._resolve(model) == [head]


def test_tied_head_is_the_head() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=DIM, bias=False, tie_weights=True)
    assert output_heads(model) == ["lm_head"]


class HeadFirst(nn.Module):
    """LitGPT's layout: ``lm_head`` registered before the blocks, whose MLP is as wide as a tiny vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.wte = nn.Embedding(VOCAB, DIM)
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(DIM, VOCAB), nn.GELU(), nn.Linear(VOCAB, DIM)) for _ in range(2))


def test_a_vocabulary_wide_linear_inside_a_block_is_no_head() -> None:
    # was: the last vocabulary-wide Linear, h.1.0 (LitGPT with intermediate_size == vocab_size)
    assert output_heads(HeadFirst()) == ["lm_head"]


def test_a_classifier_whose_blocks_are_as_wide_as_its_vocabulary_has_no_head() -> None:
    """Was: BERT's last ``intermediate.dense`` (1024 wide, vocabulary 1024) kept unquantized as "the output head"
    (benchmarks/layer_kinds.py: BERT's saved bytes 3,417,392 -> 3,482,928, issue 54)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=VOCAB,
                        vocab_size=VOCAB, max_position_embeddings=16, num_labels=3)
    model = BertForSequenceClassification(config)
    assert output_heads(model) == []
    quantize_model(model, "nf4", dtype="float32")
    assert isinstance(model.bert.encoder.layer[1].intermediate.dense, bnb.nn.Linear4bit)


def test_only_the_vocabulary_counts() -> None:
    # a Linear as wide as the position table (block_size 64 == MLP width 4 * 16) is no head; no embedding: no head
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=64, n_layer=1, n_head=2, n_embd=16, bias=False)
    assert output_heads(model) == ["lm_head"]
    del model.lm_head
    assert output_heads(model) == []
    assert output_heads(nn.Sequential(nn.Linear(4, VOCAB))) == []


@pytest.mark.parametrize(("make", "head"), MODELS)
def test_all_linear_lora_leaves_the_head_out_with_a_reason(
    make: Callable[[], nn.Module], head: str, caplog: pytest.LogCaptureFixture
) -> None:
    from lightning_hbm import LoRA

    model = make()
    lora = LoRA(r=4)
    targets, _ = lora.resolve(model)
    assert head not in targets and lora.heads_left_out == [head] and len(targets) >= 4
    with caplog.at_level(logging.INFO):
        lora.transform_model(model)
    said = f"LoRA target_modules='all-linear' leaves out the output head(s) ['{head}'] (frozen, not adapted, as peft does)"
    assert any(said in r.getMessage() for r in caplog.records)
    assert not hasattr(model.get_submodule(head), "lora_A") and not model.get_submodule(head).weight.requires_grad
    reasons = {r for row in coverage(model, quantizing=False, adapting=True) for r in row.reasons}
    assert "output head: left out of LoRA 'all-linear' (name it in target_modules to adapt it)" in reasons


@pytest.mark.parametrize(("make", "head"), MODELS)
def test_a_head_in_modules_to_save_is_trained_not_left_out(make: Callable[[], nn.Module], head: str) -> None:
    from lightning_hbm import LoRA

    lora = LoRA(r=4, modules_to_save=[head])
    _, saved = lora.resolve(make())
    assert saved == [head] and lora.heads_left_out == []
