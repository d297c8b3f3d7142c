"""``max_context``'s cap at a learned position table counts the positions the model can index (session 31).

Was: RoBERTa's table of ``max_position_embeddings`` rows, with ``padding_idx`` = the pad token (positions numbered
from ``padding_idx + 1``), was read as that many tokens: 514 for roberta-base, which runs 512 (an ``IndexError`` at
513), so a budget that fit the whole table was answered with two tokens the model cannot run.
"""

from __future__ import annotations

import pytest
import torch

from lightning_hbm.planner.context import _position_limit


@pytest.mark.slow  # ~3 s: transformers' RoBERTa
def test_a_roberta_position_table_caps_at_the_tokens_it_runs() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.RobertaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                        intermediate_size=32, max_position_embeddings=66, pad_token_id=1)  # fmt: skip
    model = transformers.RobertaModel(config).eval()
    limit = _position_limit(model, 1)
    assert limit == (64, "the model's longest sequence (64 positions in its position table embeddings.position_embeddings)")  # was 66
    with torch.no_grad():
        model(torch.full((1, 64), 5))  # the model runs the answer
        with pytest.raises((IndexError, RuntimeError)):
            model(torch.full((1, 65), 5))  # and no token more


def test_a_table_without_padding_keeps_every_row() -> None:
    from torch import nn

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wpe = nn.Embedding(128, 8)

    assert _position_limit(GPT(), 16) == (128, "the model's longest sequence (128 positions in its position table wpe)")
