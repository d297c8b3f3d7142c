"""The planner's MemTracker reference with and without torch's per-module peaks (session 42), in one process.

``memtracker_peak`` (module hooks on, its default) on a deep tiny Llama under nf4-dq + LoRA r=8 + full activation
checkpointing + FusedLoss: the step's total as torch counts it, and the process CPU time, with torch's own
``MemTracker._update_peak_stats`` (every module's peak walked at every operator) and with
``lightning_hbm._compat.torch.total_peak_only`` (the device total only). Rounds alternate the two; the totals must be
equal to the byte.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/memtracker_bookkeeping.py --layers 30 --rounds 2
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext
from unittest import mock

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate
from lightning_hbm.planner.reference import memtracker_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    def factory() -> LlamaLM:
        return LlamaLM(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                       num_attention_heads=4, num_key_value_heads=2)  # fmt: skip

    batch = synthetic_batch(1, 64, vocab_size=512)
    candidate = Candidate("nf4-dq", dtype="float32", lora_r=8, checkpointing="full", fused_loss=True)
    for round_ in range(args.rounds):
        for name, torchs in (("torch's bookkeeping", True), ("total_peak_only", False)):
            # torch's own: total_peak_only switched off where the reference calls it
            switched = mock.patch.object(torch_compat, "total_peak_only", lambda tracker: None) if torchs else nullcontext()
            started = time.process_time()
            with switched:
                peak = memtracker_peak(factory, batch, candidate)
            print(f"round {round_} {name:20s} total {peak:,} B  CPU {time.process_time() - started:.2f} s", flush=True)

if __name__ == "__main__":
    main()
