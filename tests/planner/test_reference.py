"""The planner against memory it does not measure itself: torch's MemTracker, 10 configurations, 4 model families.

The reference is one real training step run by hand (MemTracker labels everything OPT inside Lightning),
after a first step, in Lightning's order (see ``lightning_hbm/planner/reference.py``). Tiny models, batch
4 x 32: each case takes a few seconds. ``python benchmarks/planner.py --memtracker`` prints the same table.
"""

from __future__ import annotations

import sys

import pytest
import torch
from planner_families import FAMILIES, FAMILIES_32K, MEMTRACKER_CASES, VOCAB_32K

from lightning_hbm.activations.loss import chunk_tokens, softmax_rows
from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.reference import memtracker_peak

# contiguous, as a DataLoader collates it and as the reference's step clones it (with synthetic_batch's views of one
# tensor the planner read 1,072 B high until session 35, when it learnt to lay the batch out so: benchmarks/README.md)
BATCH = tuple(t.contiguous() for t in synthetic_batch(4, 32))


@pytest.mark.parametrize(("family", "candidate"), MEMTRACKER_CASES, ids=[f"{f}-{c.name}" for f, c in MEMTRACKER_CASES])
@pytest.mark.slow
def test_predicted_peak_within_5_percent_of_memtracker(family: str, candidate: Candidate) -> None:
    predicted = predict(FAMILIES[family], BATCH, candidate)
    measured = memtracker_peak(FAMILIES[family], BATCH, candidate)
    assert predicted.peak == pytest.approx(measured, rel=0.05)
    assert predicted.peak == pytest.approx(measured, rel=0.005)
    assert abs(predicted.peak - measured) <= 8  # what it reaches: equal to the byte on all ten (Dec 1)


# 2 x 128 tokens of a 32k vocabulary: two chunks of FusedLoss's default size (132 tokens of bf16 logits)
BATCH_32K = synthetic_batch(2, 128, vocab_size=VOCAB_32K)
QLORA = Candidate("nf4-dq", lora_r=8, checkpointing="full")


# unfused, a 32k vocabulary's full logits make the real step slow on CPU (~20-40 s each): marked slow
@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True], ids=["unfused", "fused-loss"])
@pytest.mark.parametrize("family", list(FAMILIES_32K))
def test_predicted_peak_within_3_percent_of_memtracker_at_a_32k_vocabulary(family: str, fused: bool) -> None:
    """QLoRA + checkpointing on Llama, GPT-NeoX, Phi-3 with and without FusedLoss: the chunks, the fp32 upcast and
    the head are traced as they run. Unfused, the logits are the peak; fused, they are gone and the loss term holds
    one chunk."""
    candidate = Candidate(**{**QLORA.__dict__, "fused_loss": fused})
    predicted = predict(FAMILIES_32K[family], BATCH_32K, candidate)
    measured = memtracker_peak(FAMILIES_32K[family], BATCH_32K, candidate)
    assert predicted.peak == pytest.approx(measured, rel=0.03)
    tokens = 2 * 128 - (family != "llama") * 2  # transformers' loss shifts the labels: one token less per row
    if fused:
        rows = softmax_rows(VOCAB_32K, torch.bfloat16)  # one chunk (132 tokens of the batch) + fp32 rows softmaxed
        assert predicted.loss >= chunk_tokens(tokens, VOCAB_32K) * VOCAB_32K * 2 + rows * VOCAB_32K * 4
        assert predicted.peak < tokens * VOCAB_32K * 6
    else:
        assert predicted.loss == 0 and predicted.peak > tokens * VOCAB_32K * 6


def test_memtracker_reference_is_not_the_planner() -> None:
    """The reference really measures: a larger batch raises its peak by the activations it adds."""
    small = memtracker_peak(FAMILIES["encoder"], synthetic_batch(2, 16), Candidate("32-true"))
    large = memtracker_peak(FAMILIES["encoder"], synthetic_batch(4, 32), Candidate("32-true"))
    assert large > small


def test_memtracker_missing_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)  # a torch without it
    with pytest.raises(RuntimeError, match=r"torch .* has no torch.distributed._tools.mem_tracker"):
        memtracker_peak(FAMILIES["encoder"], BATCH, Candidate("32-true"))
