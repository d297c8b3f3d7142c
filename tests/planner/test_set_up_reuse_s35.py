"""The probe step shared by the candidates of a plan (session 35): the surgery's probe step (who reads which layer's
weight) runs once per cut model, not once per candidate set up on it; each prediction equal to the byte to the one a
set-up of its own makes (planner/tracing.py ``_SharedProbe``, layers/readers.py ``adopt``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers import readers
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, plan, predict

# transformers' Llama, 8 blocks: cut to 3 and 4 and extended (two set-ups per candidate)
LLAMA = partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2)
BATCH = tuple(t.contiguous() for t in synthetic_batch(2, 32))


class ReadsAndGuesses(pl.LightningModule):
    """Its step reads ``proj``'s weight directly (a layer the quantization stores as a ``ReadableLinear``, marked by the
    probe step) and branches on values too large for a real twin (read as 0/False, counted in ``guessed_reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.proj = nn.Linear(64, 64)
        self.wide = nn.Linear(64, 4096)
        self.back = nn.Linear(4096, 64)
        self.head = nn.Linear(64, 256)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        h = F.linear(self.embed(idx), self.proj.weight, self.proj.bias)
        wide = self.wide(h)
        if bool((wide > 1e6).any()):  # 2 x 32 x 4096 values: no twin, guessed
            wide = wide.clamp(max=1e6)
        logits = self.head(self.back(F.gelu(wide)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _counting_probe_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    observe = readers.observe

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return observe(*args, **kwargs)

    monkeypatch.setattr(readers, "observe", counted)
    return calls


CASES = {
    # bf16, and a 4-bit base with full recompute: two configurations, two cut models each
    "llama-cut": (LLAMA, [Candidate("bf16-true", lora_r=8), Candidate("nf4-dq", lora_r=8, checkpointing="full")], 2),
    # traced whole: a layer served quantized (the probe's marks adopted), reads guessed in the step (replayed)
    "reads-and-guesses": (ReadsAndGuesses, [Candidate("nf4-dq", dtype="float32", lora_r=4), Candidate("int8", lora_r=4),
                                            Candidate("32-true", lora_r=4)], 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_candidates_of_one_cut_model_share_its_probe_step(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prediction of the plan equals the one predict() makes alone (every field; the first candidate's probe step
    is its own); the plan runs one probe step per cut model (before: one per configuration and cut model)."""
    factory, candidates, models = CASES[case]
    calls = _counting_probe_steps(monkeypatch)
    fresh = {candidate.name: predict(factory, BATCH, candidate) for candidate in candidates[1:]}
    calls.clear()
    planned = plan(factory, BATCH, candidates=candidates)
    assert not planned.failures
    assert len(planned.predictions) == len(candidates)
    for prediction in planned.predictions:
        if prediction.candidate.name not in fresh:
            continue
        assert prediction == fresh[prediction.candidate.name], prediction.candidate.name
        assert prediction.categories == fresh[prediction.candidate.name].categories
    if case == "reads-and-guesses":
        assert all(p.guessed_reads > 0 for p in planned.predictions)
    assert len(calls) == models  # was: len(candidates) * models


def test_a_probe_step_is_shared_only_on_the_same_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another batch (another plan) steps the model again: nothing kept between plans."""
    calls = _counting_probe_steps(monkeypatch)
    candidates = [Candidate("32-true", lora_r=4), Candidate("int8", lora_r=4)]
    plan(ReadsAndGuesses, BATCH, candidates=candidates)
    plan(ReadsAndGuesses, tuple(t.clone() for t in BATCH), candidates=candidates)
    assert len(calls) == 2
