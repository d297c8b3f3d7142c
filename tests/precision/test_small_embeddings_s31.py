"""``quantize_embeddings="auto"`` keeps tables too small to gain wide (T5's relative_attention_bias), said in the
coverage table, not warned; an explicit setting converts them; ``quantize_model(..., quantize_embeddings="auto")``
does what the plugin's default does (issue 51 residues, session 31)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers.coverage_table import coverage, format_coverage
from lightning_hbm.layers.embedding import QuantizedEmbedding
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.targets import SMALL_EMBEDDING_VALUES

BIAS = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias"


def _t5() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, num_layers=1, num_heads=4, d_kv=16, vocab_size=100)
    return transformers.T5ForConditionalGeneration(config)


def _tables(model: nn.Module) -> dict[str, bool]:
    return {n: isinstance(m, QuantizedEmbedding) for n, m in model.named_modules() if isinstance(m, nn.Embedding)}


def test_auto_keeps_t5s_relative_bias_wide_with_the_reason_in_the_coverage_table() -> None:
    model = _t5()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        QuantizedPrecision("nf4-dq", dtype="float32").convert_module(model)
    assert not _tables(model)[BIAS]  # 32 x 4 values: was converted to int8
    assert not [w for w in caught if "relative_attention_bias" in str(w.message)]  # no warning per table
    table = format_coverage(coverage(model, quantizing=True, adapting=False))
    assert "too small to gain: 0.5 KiB" in table


def test_an_explicit_setting_still_converts_a_tiny_table() -> None:
    for setting in (True, "int8"):
        model = _t5()
        QuantizedPrecision("int8", dtype="float32", quantize_embeddings=setting).convert_module(model)
        assert _tables(model)[BIAS]


def _tokens_and_types() -> nn.Module:
    """A token table exactly at the threshold (converted) and BERT's 2-row token-type table (kept)."""
    return nn.Sequential(nn.Embedding(128, SMALL_EMBEDDING_VALUES // 128), nn.Embedding(2, 64), nn.Linear(64, 64))


def test_the_threshold_is_by_values_and_a_table_at_it_is_converted() -> None:
    model = _tokens_and_types()
    QuantizedPrecision("nf4-dq", dtype="float32").convert_module(model)
    assert _tables(model) == {"0": True, "1": False}


def test_quantize_model_auto_does_what_the_plugins_default_does() -> None:
    by_plugin, by_function, by_default = _tokens_and_types(), _tokens_and_types(), _tokens_and_types()
    QuantizedPrecision("nf4-dq", dtype="float32").convert_module(by_plugin)
    quantize_model(by_function, "nf4-dq", "float32", quantize_embeddings="auto")
    quantize_model(by_default, "nf4-dq", "float32")  # its default stays False (documented in its docstring)
    assert _tables(by_function) == _tables(by_plugin) and any(_tables(by_plugin).values())
    kinds = {n: type(m).__name__ for n, m in by_plugin.named_modules()}
    assert {n: type(m).__name__ for n, m in by_function.named_modules()} == kinds
    assert not any(_tables(by_default).values())
    with pytest.raises(ValueError, match=r"quantize_model\(quantize_embeddings='int9'\): pass 'auto' \(int8, as QuantizedPrecision's default\)"):
        quantize_model(_t5(), "nf4-dq", "float32", quantize_embeddings="int9")
