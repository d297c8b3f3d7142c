"""Step time against ``ActivationCheckpointing(mlp_chunks=k)`` (issue 51): the count ``max_context`` chooses for a
Llama whose MLP widens 3.5x (8B, 70B: 16) against 4 and 1 (the MLP recomputed whole), interleaved in one process.

A bf16 QLoRA Llama of the 8B's proportions (hidden 512, intermediate 1792: ``max_context`` chooses 16 chunks for it as
for the 8B), 4 layers, ``nf4-dq`` + ``LoRA(r=16)`` + full recompute + ``FusedLoss``, batch 1 x 2048 (the MLP is most of
a block's work there: per token 6 x 512 x 1792 multiply-adds against 4 x 2048 x 512 for attention). Each arm is its own
model, set up by one Trainer step (its chunk verdicts and the adapter-first recompute are decided there), then timed
forward + backward by hand; the arms run round-robin, one step each per round, and each arm's figure is the median of
its steady rounds in CPU time of this process (one thread: the other jobs on the machine do not count).

    OMP_NUM_THREADS=1 python benchmarks/mlp_chunks_time.py            # 1, 4, 16 chunks, 7 rounds
    OMP_NUM_THREADS=1 python benchmarks/mlp_chunks_time.py --chunks 1 16 --rounds 9 --length 1024
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2)


def build(chunks: int, length: int) -> tuple[Any, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = LlamaLM(**SHAPE)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
                         callbacks=[LoRA(r=16), ActivationCheckpointing("full", mlp_chunks=chunks), FusedLoss()])
    batch = synthetic_batch(1, length, vocab_size=SHAPE["vocab_size"])
    trainer.fit(model, torch.utils.data.DataLoader(list(zip(*batch)), batch_size=1))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return model, optimizer, batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--length", type=int, default=2048)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    arms = {k: build(k, args.length) for k in args.chunks}
    times: dict[int, list[float]] = {k: [] for k in arms}
    for _ in range(args.rounds):
        for k, (model, optimizer, batch) in arms.items():
            start = time.process_time()
            model.loss(batch).backward()
            optimizer.zero_grad()
            times[k].append(time.process_time() - start)
    base = statistics.median(times[args.chunks[0]][1:])
    print(f"LlamaLM {SHAPE}, batch 1 x {args.length}, {args.rounds} rounds (the first of each arm not counted)")
    for k, values in times.items():
        median = statistics.median(values[1:])
        print(f"| mlp_chunks={k} | {median * 1000:.0f} ms | {median / base:.3f}x | "
              f"{min(values[1:]) * 1000:.0f}-{max(values[1:]) * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
