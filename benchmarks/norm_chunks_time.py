"""Step time of the RMSNorms recomputed in token chunks (issue 51): a bf16 QLoRA Llama with ``mlp_chunks=4``, its fp32
norms chunked (the rule since Dec 4 2026) against whole (the rule before: ``UPCAST = WIDENING``), interleaved in one
process, median of the steady steps. The verdicts are made at each model's first step, so each arm keeps its own.

    OMP_NUM_THREADS=1 python benchmarks/norm_chunks_time.py
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.activations import token_chunks
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM


def build(norms_whole: bool) -> tuple[Any, torch.optim.Optimizer, Any]:
    token_chunks.UPCAST = token_chunks.WIDENING if norms_whole else 1.0
    torch.manual_seed(0)
    model = LlamaLM(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
                         callbacks=[LoRA(r=16), ActivationCheckpointing("full", mlp_chunks=4), FusedLoss()])
    batch = synthetic_batch(2, 1024, vocab_size=4096)
    trainer.fit(model, torch.utils.data.DataLoader(list(zip(*batch)), batch_size=2))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return model, optimizer, batch


def main(rounds: int = 6) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    arms = {"norms chunked": build(False), "norms whole": build(True)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, (model, optimizer, batch) in arms.items():
            start = time.perf_counter()
            model.loss(batch).backward()
            optimizer.zero_grad()
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median step {statistics.median(values[1:]) * 1000:.0f} ms")
    ratio = statistics.median(times["norms chunked"][1:]) / statistics.median(times["norms whole"][1:])
    print(f"chunked / whole: {ratio:.3f}")


if __name__ == "__main__":
    main()
