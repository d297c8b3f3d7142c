"""``max_context`` on a MoE model says that its answer assumes the worst routing load, and what that costs (issue 51).

The planner traces on fake tensors, which hold no values, so no router runs: each experts layer is planned with its
first and last expert given every token of a chunk (``LinearExperts._worst_load``; exact under that load,
tests/planner/test_moe_chunks_s40.py). Session 40 measured that assumption as Qwen3-MoE's whole over-count against its
untrained router; a user reading ``max_context``'s answer or ``lightning-hbm plan --max-context`` was not told. Now the
answer carries the bytes the worst load adds over a balanced router at its length (both planned), its notes say it
with that figure, and the CLI table prints them; a dense model gets no note.

Tested on the answer's own step (``_Lengths.result``, where max_context makes every answer): a whole max_context solve
of the tiny Qwen3-MoE plans 4-5 lengths, over 2 min on a shared 2-core CPU.
"""

from __future__ import annotations

from functools import partial

import pytest
from planner_families import HFCausalLM

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import context as context_module
from lightning_hbm.planner.building import build_template
from lightning_hbm.planner.candidates import format_bytes, parse_bytes
from lightning_hbm.planner.config import print_max_context

VOCAB = 512
QWEN3_MOE = partial(HFCausalLM, "Qwen3MoeConfig", pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=VOCAB,
                    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=8192, num_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    moe_intermediate_size=32, head_dim=16)  # fmt: skip
SMALL_LLAMA = partial(LlamaLM, vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
TOKENS = 256


def _lengths(model: partial) -> context_module._Lengths:
    """max_context's configuration of ``model`` (QLoRA, fp32 compute, on the CPU), as max_context builds it."""
    template = build_template(model)
    return context_module._Lengths(
        template, QuantizedPrecision("nf4-dq", dtype="float32"), [LoRA(r=8)], None,
        lambda n: tuple(t.contiguous() for t in synthetic_batch(1, n, vocab_size=VOCAB)), "cpu", 64, False,
    )  # fmt: skip


def test_moe_answer_says_the_worst_load_and_its_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    lengths = _lengths(QWEN3_MOE)
    result = lengths.result(parse_bytes("16MiB"), TOKENS, 1)
    # computed at the answer's length: the answer's plan less the same step under a balanced router's load
    balanced = lengths.balanced_at(TOKENS).total
    assert result.expert_load == result.prediction.total - balanced > 0, (result.prediction.total, balanced)
    [note] = result.notes()
    assert "worst routing load" in note and "balanced router" in note, note
    assert format_bytes(result.expert_load) in note and f"{TOKENS:,} tokens" in note, note
    print_max_context([result])
    assert f"({note})" in capsys.readouterr().out


def test_a_dense_answer_has_no_note() -> None:
    lengths = _lengths(SMALL_LLAMA)
    assert not lengths.routed  # no experts layer: no second plan, no note
    result = context_module.ContextResult(parse_bytes("16MiB"), TOKENS, lengths.predict_at(TOKENS), {}, "")
    assert result.expert_load is None and result.notes() == []
