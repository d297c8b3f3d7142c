"""The ``nn.MultiheadAttention`` kind (``lightning_hbm/layers/multihead_attention.py``): its replacement with four
projections equals torch (masks, ``kdim``, weights, gradients), is quantized and adapted, refuses what it cannot do."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from kind_models import BATCH, SEQ, WIDTH, build, fit, tokens
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import ProjectedMultiheadAttention


def test_multihead_attention_projections_are_quantized_and_out_proj_adapter_is_alive(tmp_path: Any) -> None:
    module = build("transformer_encoder")
    quantize_model(module, "nf4-dq", dtype="float32")
    attn = module.model.encoder.layers[0].self_attn
    assert isinstance(attn, ProjectedMultiheadAttention)
    assert all(not getattr(attn, p).weight.is_floating_point() for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert not any(p.dim() == 2 and p.is_floating_point() and p.shape[0] == 3 * WIDTH for p in module.parameters())
    recorder = fit(build("transformer_encoder"), "nf4-dq", steps=2, tmp_path=tmp_path)
    assert not recorder.no_grad



@pytest.mark.parametrize(("batch_first", "kdim", "need_weights", "average"), list(itertools.product([True, False], [None, 24], [True, False], [True, False])))
def test_projected_attention_equals_torch(batch_first: bool, kdim: int | None, need_weights: bool, average: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=kdim, vdim=kdim).double()
    new = ProjectedMultiheadAttention.from_torch(mha)
    n, length, source = 3, 5, 6
    query = torch.randn(n, length, 32, dtype=torch.double, requires_grad=True)
    key = torch.randn(n, source, kdim or 32, dtype=torch.double, requires_grad=True)
    q, k = (query, key) if batch_first else (query.transpose(0, 1), key.transpose(0, 1))
    attn_mask = torch.rand(length, source, generator=torch.Generator().manual_seed(0)) > 0.7
    attn_mask[:, 0] = False
    padding = torch.zeros(n, source, dtype=torch.bool)
    padding[0, -2:] = True
    for masks in ({}, {"attn_mask": attn_mask}, {"key_padding_mask": padding}, {"attn_mask": attn_mask, "key_padding_mask": padding},
                  {"attn_mask": torch.randn(n * 4, length, source, dtype=torch.double)}):
        out, weights = mha(q, k, k, need_weights=need_weights, average_attn_weights=average, **masks)
        out2, weights2 = new(q, k, k, need_weights=need_weights, average_attn_weights=average, **masks)
        torch.testing.assert_close(out2, out)
        assert (weights is None) == (weights2 is None)
        if weights is not None:
            torch.testing.assert_close(weights2, weights)
        grads = torch.autograd.grad(out.sum(), [query, key, mha.out_proj.weight, mha.in_proj_weight if kdim is None else mha.q_proj_weight])
        grads2 = torch.autograd.grad(out2.sum(), [query, key, new.out_proj.weight, new.q_proj.weight])
        for g, g2 in zip(grads[:3], grads2[:3]):
            torch.testing.assert_close(g2, g)
        torch.testing.assert_close(grads2[3], grads[3][:32])



def test_projected_attention_unbatched_and_in_transformer_layers_eval() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4).double()
    new = ProjectedMultiheadAttention.from_torch(mha)
    x = torch.randn(5, 32, dtype=torch.double)
    torch.testing.assert_close(new(x, x, x)[0], mha(x, x, x)[0])
    module = build("transformer_encoder").eval()
    batch = tokens()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    with torch.no_grad():  # eval + key padding: torch's fused fast path would read the raw in_proj weights
        expected = module.model.encoder(module.model.embed(batch), src_key_padding_mask=padding)
        from lightning_hbm.layers import prepare_model

        prepare_model(module)
        actual = module.model.encoder(module.model.embed(batch), src_key_padding_mask=padding)
    torch.testing.assert_close(actual[~padding], expected[~padding], atol=1e-5, rtol=1e-4)



def test_unsupported_attention_options_are_clear_errors_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 4, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"add_bias_kv=True.*not supported.*ignore_modules"):
        quantize_model(model, "nf4-dq", dtype="float32")
    assert type(model[0]) is nn.Linear  # nothing changed

