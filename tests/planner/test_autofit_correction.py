"""AutoFit and the accurate 4-bit base (issue 52): nf4-dq-b32 + GPTQ rounding + a rank-16 calibrated correction, taken
when it fits, left with the reason said when it does not, and its bytes planned as MemTracker measures them."""

from __future__ import annotations

import re
from functools import partial
from typing import Any, Callable

import pytest

from lightning_hbm import AutoFit, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import NanoGPT
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.candidates import ACCURATE_4BIT
from lightning_hbm.planner.reference import memtracker_peak
from lightning_hbm.precision.correction import corrected_layers
from lightning_hbm.surgery import applied_transforms

# The tiny GPT at batch 4 x 64, planned on CPU (Dec 5, its embeddings in int8, the default since session 30): plain
# nf4-dq+lora8+ac-full 1,212,604 B, the accurate base with full recompute 1,410,772 B; without recompute plain 2,230,460 B,
# accurate 2,297,556 B; 32-true 5,030,572 B (Dec 4, bf16 embeddings: 1,235,596 / 1,433,764 / 2,253,452 / 2,320,548 B).
ACCURATE_FULL = "nf4-dq-b32+gptq+corr16+lora8+ac-full"


def _fit(gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, **axes: Any) -> tuple[AutoFit, Any, Any]:
    model = gpt_factory()
    # this width-64 GPT stores rank 16 at 1.296 bytes per weight: the target that keeps the figures below (session 41)
    autofit = AutoFit(lora_ranks=[0, 8], optimizers=["user"], fused_loss=[False], accurate_bytes_per_weight=1.3, **axes)
    trainer = trainer_factory(max_steps=1, callbacks=[autofit])
    trainer.fit(model, datamodule_factory(seq_len=64, batch_size=4))
    return autofit, model, trainer.strategy.precision_plugin


@pytest.mark.slow
def test_the_accurate_base_is_taken_over_a_faster_plain_one_when_it_fits(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    # 2,280,000 B: plain nf4-dq without recompute fits (1.25x), the accurate base only with it (1.70x): quality first
    autofit, model, plugin = _fit(gpt_factory, datamodule_factory, trainer_factory, budget=2_280_000,
                                  checkpointing=["none", "full"])
    assert autofit.chosen is not None and autofit.chosen.candidate.name == ACCURATE_FULL
    assert autofit.reason is not None and autofit.reason.startswith(f"AutoFit chose the accurate 4-bit base {ACCURATE_FULL}")
    assert "taken over the faster plain nf4-dq+lora8 (1.25x against 1.70x)" in autofit.reason
    # what the Trainer computes with: the option a user would set by hand
    assert isinstance(plugin, QuantizedPrecision)
    assert (plugin.mode.name, plugin.rounding, plugin.correction_rank) == ("nf4-dq-b32", "gptq", 16)
    assert applied_transforms(model) == ["QuantizedPrecision(nf4-dq-b32)", "LoRA", "ActivationCheckpointing"]
    assert len(corrected_layers(model)) == 8  # 2 blocks x (qkv, proj, fc, fc2): the head stays unquantized


@pytest.mark.slow
def test_a_budget_too_tight_for_the_correction_drops_it_and_says_why(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    # 1.3 MiB = 1,363,148 B: plain nf4-dq with full recompute fits, the accurate base (1,433,764 B) does not
    with pytest.warns(UserWarning, match=r"a plain 4-bit base without the calibrated correction: the accurate 4-bit base "
                                         rf"does not fit the budget of 1.30 MiB \(its smallest candidate {re.escape(ACCURATE_FULL)} needs"):
        autofit, model, _ = _fit(gpt_factory, datamodule_factory, trainer_factory, budget="1.3MiB", checkpointing=["full"])
    assert autofit.chosen is not None and autofit.chosen.candidate.name == "nf4-dq+lora8+ac-full"
    assert autofit.reason is not None and "+4.94 / +3.05 %" in autofit.reason and "Raise the budget to" in autofit.reason
    assert applied_transforms(model) == ["QuantizedPrecision(nf4-dq)", "LoRA", "ActivationCheckpointing"]
    assert corrected_layers(model) == []


@pytest.mark.slow
def test_a_loader_passed_to_fit_is_the_probe_of_the_accurate_candidates(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = gpt_factory()
    autofit = AutoFit(budget="1.3MiB", lora_ranks=[8], checkpointing=["full"], optimizers=["user"], fused_loss=[False],
                      accurate_bytes_per_weight=1.3)
    trainer = trainer_factory(max_steps=1, callbacks=[autofit])
    """Was: without a datamodule the quantized candidates were plain nf4-dq ("no datamodule, so no probe batch")."""
    with caplog.at_level("INFO"):
        trainer.fit(model, datamodule_factory(seq_len=64, batch_size=4).train_dataloader())
    assert autofit.chosen is not None
    assert "no probe batch to fit GPTQ rounding" not in caplog.text
    assert any(p.candidate.correction_rank for p in autofit.plan.predictions)


def test_a_users_explicit_precisions_get_no_accurate_candidates(gpt_factory: Callable[..., Any]) -> None:
    plain, model = [Candidate("nf4-dq", lora_r=8)], gpt_factory()
    assert AutoFit(precisions=["nf4-dq"])._accurate_candidates(plain, "32-true", model) == []
    assert AutoFit()._accurate_candidates(plain, "nf4-dq", model) == []  # the Trainer's own QuantizedPrecision
    offered = AutoFit(accurate_bytes_per_weight=1.3)._accurate_candidates(plain, "32-true", model)  # the default: offered
    assert [c.correction_rank for c in offered] == [16]  # its rank chosen by bytes: tests/planner/test_accurate_s41.py


def test_the_rounding_axis_of_a_candidate() -> None:
    candidate = Candidate(lora_r=8, **ACCURATE_4BIT)
    assert candidate.name == "nf4-dq-b32+gptq+corr16+lora8"
    assert "init_args: {mode: nf4-dq-b32, dtype: bfloat16, rounding: gptq, correction_rank: 16}" in candidate.yaml()
    plugin = candidate.precision_plugin()
    assert isinstance(plugin, QuantizedPrecision) and (plugin.rounding, plugin.correction_rank) == ("gptq", 16)
    assert Candidate.from_trainer(plugin).rounding == "gptq"
    with pytest.raises(ValueError, match=r"Candidate rounding='gptq': use 'nearest', or 'gptq' with a lightning_hbm 4-bit"):
        Candidate("bf16-true", rounding="gptq")
    with pytest.raises(ValueError, match=r"Candidate rounding='round': use 'nearest'"):
        Candidate("nf4-dq", rounding="round")


@pytest.mark.slow
def test_the_accurate_base_is_planned_at_memtrackers_peak() -> None:
    """The correction's frozen factors (and the GPTQ-rounded, block-32 weight) in the planner's step peak, against
    torch's MemTracker on one real step of the same configuration (tests/planner/test_reference.py's reference)."""
    factory = partial(NanoGPT, n_layer=2, n_head=2, n_embd=64, block_size=128)
    batch = tuple(t.contiguous() for t in synthetic_batch(4, 32))  # 128 tokens: enough rows for rank 16
    plugin = QuantizedPrecision("nf4-dq-b32", rounding="gptq", correction_rank=16, probe_batch=batch)
    accurate = Candidate.from_trainer(plugin, [LoRA(r=8)])
    plain = Candidate.from_trainer(QuantizedPrecision("nf4-dq-b32", probe_batch=batch), [LoRA(r=8)])
    predicted, measured = predict(factory, batch, accurate).peak, memtracker_peak(factory, batch, accurate)
    assert predicted == pytest.approx(measured, rel=0.03)
    # and the correction is what tells the two apart: 8 layers x 16 x (in + out) bf16 elements
    factors = 2 * 16 * 2 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))  # 2 blocks, rank 16, 2 B per element
    assert predict(factory, batch, accurate).categories["parameters"] - predict(factory, batch, plain).categories["parameters"] == factors
    assert memtracker_peak(factory, batch, accurate) - memtracker_peak(factory, batch, plain) >= factors
