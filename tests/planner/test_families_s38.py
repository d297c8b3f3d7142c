"""``plan()`` and ``max_context`` on decoder families the planner tests never built, against torch's MemTracker (issue 51).

Twenty transformers causal LMs from tiny configs (benchmarks/README.md, "Planner on twenty more decoder families"),
each under the library's default recipe (``QuantizedPrecision("nf4-dq")``, fp32 compute on this CPU, ``LoRA(r=8)``,
``ActivationCheckpointing()``, ``FusedLoss()``), with ``correction_rank=8``, and through ``max_context(device="cpu")``
with a byte budget measured at the answer and 25 % longer. Two breaks, both on a mixture of experts (Qwen3-MoE, whose
3-D experts the surgery turns into ``LinearExperts``), fixed here:

* ``correction_rank=8`` planned +7.4 % over the measured step: the planner gave every quantized layer zero factors,
  the experts' Linears too, which the run never corrects (their input statistics are measured before the experts are
  converted: "the probe batch did not reach it", warned). Now planned as the run leaves them.
* ``ActivationCheckpointing(mlp_chunks=8)`` planned the sparse MoE block's whole recompute (the ops-following check
  on fake tensors refused ``hidden[token_idx]``) while the run chunks it: +33 % over the step at 256 tokens, and
  ``max_context`` answered 1,024 tokens where 1,280 measured under the budget (+40 % predicted over the measured
  peak). The check now follows rows gathered by an index and added back by the same index
  (``activations/token_rows.py``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
from planner_families import HFCausalLM

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import max_context, plan
from lightning_hbm.planner.reference import memtracker_peak

VOCAB = 512
TOKENS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=VOCAB)
QWEN3_MOE = partial(HFCausalLM, "Qwen3MoeConfig", **TOKENS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=8192, num_experts=4, num_experts_per_tok=2,
                    intermediate_size=64, moe_intermediate_size=32, head_dim=16)  # fmt: skip


def _tokens(length: int) -> Any:
    return tuple(t.contiguous() for t in synthetic_batch(1, length, vocab_size=VOCAB))


def _plugin(**fields: Any) -> QuantizedPrecision:
    return QuantizedPrecision("nf4-dq", dtype="float32", **fields)


@pytest.mark.filterwarnings("ignore")
def test_the_correction_is_planned_on_the_layers_the_run_corrects() -> None:
    pytest.importorskip("transformers")
    batch = synthetic_batch(2, 32, vocab_size=VOCAB)
    planned = plan(QWEN3_MOE, batch, plugin=_plugin(correction_rank=8, probe_batch=batch),
                   callbacks=[LoRA(r=8), ActivationCheckpointing(), FusedLoss()])  # fmt: skip
    assert not planned.failures
    predicted = planned.chosen
    measured = memtracker_peak(QWEN3_MOE, batch, predicted.candidate)
    assert predicted.peak == pytest.approx(measured, rel=0.03), (predicted.peak, measured)  # was +7.38 %


@pytest.mark.filterwarnings("ignore")
def test_a_mixture_of_experts_is_planned_chunked_as_it_runs() -> None:
    pytest.importorskip("transformers")
    batch = _tokens(256)
    callbacks = [LoRA(r=8), ActivationCheckpointing("full", mlp_chunks=8), FusedLoss()]
    predicted = plan(QWEN3_MOE, batch, plugin=_plugin(), callbacks=callbacks).chosen
    measured = memtracker_peak(QWEN3_MOE, batch, predicted.candidate)
    assert predicted.peak == pytest.approx(measured, rel=0.03), (predicted.peak, measured)  # was +32.9 %


@pytest.mark.filterwarnings("ignore")
def test_max_context_of_a_mixture_of_experts_fits_and_a_quarter_longer_does_not() -> None:
    pytest.importorskip("transformers")
    budget = 3 * 2**20
    result = max_context(QWEN3_MOE, budget, plugin=_plugin(), callbacks=[LoRA(r=8)], device="cpu", multiple_of=16)
    assert isinstance(result, type(result)) and result.tokens > 0 and result.choices["mlp_chunks"] > 1
    candidate = result.prediction.candidate
    at = memtracker_peak(QWEN3_MOE, _tokens(result.tokens), candidate)
    assert at <= budget and result.prediction.peak == pytest.approx(at, rel=0.03), (result.prediction.peak, at)
    longer = result.tokens * 5 // 4 // 16 * 16
    assert memtracker_peak(QWEN3_MOE, _tokens(longer), candidate) > budget  # was: fitted too (answered 1,024 of 1,280+)


@pytest.mark.filterwarnings("ignore")
def test_a_mixture_of_experts_without_chunks_is_planned_at_length() -> None:
    """Session 39: the forward's one-hot expert mask (int64 ``[tokens, top_k, experts + 1]``, 80 B per token here) was
    not in the planner's stand-in for the experts: -0.27 % at 64 tokens, -0.86 % at 256, -1.17 % at 1,024, growing
    with the length. Now a constant 2,696 B over (the worst load), +0.13 % at 256 tokens."""
    pytest.importorskip("transformers")
    batch = _tokens(256)
    callbacks = [LoRA(r=8), ActivationCheckpointing(), FusedLoss()]
    predicted = plan(QWEN3_MOE, batch, plugin=_plugin(), callbacks=callbacks).chosen
    measured = memtracker_peak(QWEN3_MOE, batch, predicted.candidate)
    assert measured <= predicted.peak <= measured * 1.003, (predicted.peak, measured)  # was 2,045,172 < 2,062,956
