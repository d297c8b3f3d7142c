"""``plan()`` with a sensitivity plan (``QuantizedPrecision(min_cosine=...)`` / ``max_bytes_per_param=...``): the fit
measures the Linears' modes at its start on real weights; the planner's trace holds fake ones. Session 38: ``plan()``
failed on every such plugin (bitsandbytes' ``Params4bit`` wrapping a FakeTensor, in ``weight_bytes`` and in the plan's
measures). Now the Linears are planned in the plugin's mode and named in the notes with the bytes they may add."""

from __future__ import annotations

from functools import partial

import pytest

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import plan
from tests.conftest import TINY_LLAMA


@pytest.mark.parametrize("target", [dict(min_cosine=0.9999), dict(max_bytes_per_param=0.9)], ids=["min_cosine", "max_bytes"])
def test_a_sensitivity_plan_is_planned_and_named(target: dict) -> None:
    batch = synthetic_batch(4, 64)
    measured = plan(partial(LlamaLM, **TINY_LLAMA), batch, plugin=QuantizedPrecision("nf4-dq", probe_batch=batch, **target),
                    callbacks=[LoRA(r=4)])  # fmt: skip
    plain = plan(partial(LlamaLM, **TINY_LLAMA), batch, plugin=QuantizedPrecision("nf4-dq"), callbacks=[LoRA(r=4)])
    ours, theirs = measured.predictions[0], plain.predictions[0]
    assert ours.peak == theirs.peak and not theirs.chosen_linears
    assert len(ours.chosen_linears) == 14 and all(b > 0 for b in ours.chosen_linears.values())
    notes = [n for n in measured.notes() if "Linear(s) planned in nf4-dq" in n]
    assert len(notes) == 1 and "sensitivity plan" in notes[0] and "Candidate(layer_modes=...)" in notes[0]
