"""A model set up for one trace, stepped again by the next (session 34): plan() sets up once for two candidates that
differ only by the optimizer, and a partial offload once for both offload counts of a cut model; each plan equal to the
byte to the one a fresh set-up makes (planner/tracing.py ``Decided``, planner/api.py ``_set_ups_for``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from lightning_hbm.activations import ActivationCheckpointing
from lightning_hbm.adapters.lora import LoRA
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM, NanoGPT
from lightning_hbm.optim import MemoryEfficientOptimizer
from lightning_hbm.planner import Candidate, plan, predict, tracing
from lightning_hbm.planner.building import build_template
from lightning_hbm.planner.tracing import Decided
from lightning_hbm.precision import QuantizedPrecision

# transformers' Llama, 8 blocks: cut to 3 and 4 and extended (two traces per candidate)
LLAMA = partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2)
GPT = partial(NanoGPT, n_layer=2, n_head=2, n_embd=64, block_size=64)
BATCH = tuple(t.contiguous() for t in synthetic_batch(2, 32))


def _counting_set_ups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    set_up = tracing._set_up

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return set_up(*args, **kwargs)

    monkeypatch.setattr(tracing, "_set_up", counted)
    return calls


CASES = {
    # transformers' Llama cut to 3 and 4 blocks: a quantized base, LoRA, full recompute, both optimizers
    "llama-cut": (LLAMA, [Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full"),
                          Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full", optimizer="adamw8bit")]),
    # traced whole: selective recompute, the 8-bit optimizer first and back; no transform at all (never shared: the
    # optimizer's transform would be the model's only change)
    "gpt-whole": (GPT, [Candidate("32-true", lora_r=4, checkpointing="selective", optimizer="adamw8bit"),
                        Candidate("32-true", lora_r=4, checkpointing="selective"),
                        Candidate("32-true"), Candidate("32-true", optimizer="adamw8bit")]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_candidates_that_differ_by_the_optimizer_share_one_set_up(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prediction of the plan equals the one predict() makes alone (every field: categories, regions, side terms);
    the second of a pair sets nothing up."""
    factory, candidates = CASES[case]
    calls = _counting_set_ups(monkeypatch)
    fresh, set_ups = {}, {}
    for candidate in candidates:
        before = len(calls)
        fresh[candidate.name] = predict(factory, BATCH, candidate)
        set_ups[candidate.name] = len(calls) - before
    calls.clear()
    planned = plan(factory, BATCH, candidates=candidates)
    assert not planned.failures
    for prediction in planned.predictions:
        assert prediction == fresh[prediction.candidate.name], prediction.candidate.name
        assert prediction.categories == fresh[prediction.candidate.name].categories
    shared = [c.name for c in candidates[1:2]] if case == "llama-cut" else [candidates[1].name]
    assert len(calls) == sum(n for name, n in set_ups.items() if name not in shared)  # was: the sum over all of them


def test_traces_of_one_set_up_equal_fresh_ones_phase_by_phase() -> None:
    """At the trace level: the same cut model stepped again with another offload count, then for another optimizer (the
    same callbacks and the 8-bit one), gives the phases, scopes and regions of a model set up for it alone."""
    template = build_template(LLAMA)
    callbacks = [LoRA(r=8), ActivationCheckpointing(offload=5)]
    first = Candidate.from_trainer(QuantizedPrecision("nf4-dq", dtype="float32"), callbacks, None)
    other = Candidate.from_trainer(QuantizedPrecision("nf4-dq", dtype="float32"),
                                   [*callbacks, MemoryEfficientOptimizer("adamw8bit")], None)
    assert other.optimizer == "adamw8bit"
    decided = Decided()
    for candidate, offload in ((first, 3), (first, 2), (other, None)):
        kept = tracing.trace(template, BATCH, candidate, "cuda", 4, decided=decided, offload=offload)
        alone = tracing.trace(template, BATCH, candidate, "cuda", 4, offload=offload)
        assert kept.phases == alone.phases and kept.scopes == alone.scopes and kept.regions == alone.regions
        assert kept == alone
    assert list(decided.built) == [4]  # one model set up served the three


def test_a_trace_that_fails_forgets_its_set_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that failed half-way leaves the model in a state no later trace may step again: set up anew."""
    template = build_template(GPT)
    candidate = Candidate("32-true", lora_r=4)
    decided = Decided()

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the step failed")

    steady = tracing._steady_step
    monkeypatch.setattr(tracing, "_steady_step", failing)
    with pytest.raises(RuntimeError, match="the step failed"):
        tracing.trace(template, BATCH, candidate, "cpu", None, decided=decided)
    assert None not in decided.built
    monkeypatch.setattr(tracing, "_steady_step", steady)
    assert tracing.trace(template, BATCH, candidate, "cpu", None, decided=decided) == tracing.trace(
        template, BATCH, candidate, "cpu", None)
