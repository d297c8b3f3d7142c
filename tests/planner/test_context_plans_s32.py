"""``max_context`` plans its first lengths shortest first and stops at the first one over the budget (session 32).

Was: 2,048, 32,768 and 131,072 tokens planned for every call, each a traced step (seconds), though a small model's
answer of a few thousand tokens is bracketed once 32,768 is over. The answers are the old algorithm's, byte for byte:
recorded from it (``b69ed48``) on the same call.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from lightning_hbm import LoRA
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import CUDA_CONTEXT_BYTES, max_context
from lightning_hbm.planner import context as context_module

SMALL_LLAMA = partial(LlamaLM, vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)  # fmt: skip
MIB = 2**20
# the old algorithm's answers for CUDA context + 3, 6, 12, 24 MiB (one call): tokens, planned total, limit; it planned
# 2,048, 32,768, 131,072 tokens, then one length per budget (7 plans). 32,768 tokens plan 915,908,220 bytes: over all four
OLD = [
    (512, 807866300, "largest term activations 1.70 MiB"),
    (1536, 811438012, "largest term activations 5.09 MiB"),
    (3328, 817688508, "largest term activations 11.02 MiB"),
    (6912, 830189500, "largest term activations 22.89 MiB"),
]


def _planned_lengths(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token lengths max_context plans, in order, appended as it plans them."""
    planned: list[int] = []
    original = context_module.predict

    def counted(template: Any, batch: Any, candidate: Any, **kwargs: Any) -> Any:
        planned.append(int(batch[0].shape[-1]))
        return original(template, batch, candidate, **kwargs)

    monkeypatch.setattr(context_module, "predict", counted)
    return planned


def test_short_answers_plan_no_128k_step_and_stay_the_old_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    planned = _planned_lengths(monkeypatch)
    budgets = [CUDA_CONTEXT_BYTES + n * MIB for n in (3, 6, 12, 24)]
    results = max_context(SMALL_LLAMA, budgets, callbacks=[LoRA(r=4)], multiple_of=256)
    assert isinstance(results, list)
    assert [(r.tokens, r.prediction.total, r.limit) for r in results] == OLD
    # was 2,048, 32,768, 131,072, then the same four; session 39: 32,768 only once a budget fits 2,048 (the 12 MiB one)
    assert planned == [2048, 512, 1536, 32768, 3328, 6912]


def test_a_budget_under_the_first_length_plans_shorter_not_longer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Session 39: where 2,048 tokens are already over every budget, the second point is 512, not 32,768 (transformers'
    Mamba without CUDA kernels traces its scan token by token: 32,768 tokens took FalconMamba and Jamba over 10 min of
    CPU for answers near 1,000). The answers stay the old ones."""
    planned = _planned_lengths(monkeypatch)
    results = max_context(SMALL_LLAMA, [CUDA_CONTEXT_BYTES + n * MIB for n in (3, 6)], callbacks=[LoRA(r=4)], multiple_of=256)
    assert isinstance(results, list)
    assert [(r.tokens, r.prediction.total, r.limit) for r in results] == OLD[:2]
    assert planned == [2048, 512, 1536]  # was [2048, 32768, 512, 1536]
