"""Qwen3-MoE's chunked MoE recompute planned over the measured step (issue 51, session 40): the router, not a term.

Session 40 measured the plan of Qwen3-MoE (4 experts, top-2) with ``ActivationCheckpointing(mlp_chunks=4)`` over
MemTracker's peak by 2,696 B + about 39 B per token (+10,984 B at 256 tokens, +60,728 B at 1,488), growing with the
tokens of one chunk (+22,664 B at 128 per chunk, +0 at 32). The planner's stand-in for the experts on fake tensors
(``LinearExperts._worst_load``) gives the first and the last expert every token of a chunk; the real router of this
untrained model on synthetic tokens gives its busiest expert 40-48 of a 64-token chunk. Run with the planned load in
the measured step (the real routing in the first, where the chunks are decided), MemTracker measures the plan to the
byte, with and without chunks: no term is wrong, the plan is the worst load by design (a trained router may well
send a chunk's tokens to one expert). This test keeps it so; it passes on the parent too (nothing was changed).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from planner_families import HFCausalLM

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers.experts import LinearExperts
from lightning_hbm.planner import plan, reference
from lightning_hbm.planner.reference import memtracker_peak

VOCAB = 512
QWEN3_MOE = partial(HFCausalLM, "Qwen3MoeConfig", pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=VOCAB,
                    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=8192, num_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    moe_intermediate_size=32, head_dim=16)  # fmt: skip


def _planned_load_in_the_measured_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the measured step (memtracker_peak's second) as the plan does: every chunk through ``_worst_load``."""
    real_step, real_forward, steps = reference._step, LinearExperts.forward, []

    def step(*args: Any) -> None:
        steps.append(None)
        if len(steps) == 2:
            monkeypatch.setattr(LinearExperts, "forward", lambda self, hidden, index, weights: self._worst_load(hidden, weights))
        try:
            real_step(*args)
        finally:
            monkeypatch.setattr(LinearExperts, "forward", real_forward)

    monkeypatch.setattr(reference, "_step", step)


def test_chunked_moe_recompute_is_planned_to_the_byte_under_the_planned_load(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    batch = tuple(t.contiguous() for t in synthetic_batch(1, 256, vocab_size=VOCAB))
    callbacks = [LoRA(r=8), ActivationCheckpointing("full", mlp_chunks=4), FusedLoss()]
    predicted = plan(QWEN3_MOE, batch, plugin=QuantizedPrecision("nf4-dq", dtype="float32"), callbacks=callbacks).chosen
    assert predicted.candidate.mlp_chunks == 4
    routed = memtracker_peak(QWEN3_MOE, batch, predicted.candidate, module_hooks=False)
    assert routed <= predicted.peak <= routed * 1.01, (predicted.peak, routed)  # the router's load: +10,984 B (Dec 7 2026)
    _planned_load_in_the_measured_step(monkeypatch)
    assert memtracker_peak(QWEN3_MOE, batch, predicted.candidate, module_hooks=False) == predicted.peak
