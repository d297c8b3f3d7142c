"""Step time and gradients of q/k/v fed by the chunked ``input_layernorm`` (issue 51): a bf16 QLoRA Llama with
``mlp_chunks=4``, q/k/v keeping nothing (their input remade from the norm's kept input in the backward, Dec 5 2026)
against the code before (they keep the norm's output: ``recompute.inner_candidates`` returning none), interleaved
in one process, median of the steady steps; then ``torch.equal`` on every trainable gradient of one more step.

    OMP_NUM_THREADS=1 python benchmarks/fed_projections_time.py
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.activations import recompute
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM

FED = recompute.inner_candidates


def build(fed: bool) -> tuple[Any, torch.optim.Optimizer, Any]:
    recompute.inner_candidates = FED if fed else (lambda block: [])  # read when the Trainer sets the blocks up
    torch.manual_seed(0)
    model = LlamaLM(vocab_size=4096, hidden_size=512, intermediate_size=1792, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
                         callbacks=[LoRA(r=16), ActivationCheckpointing("full", mlp_chunks=4)])
    batch = synthetic_batch(1, 2048, vocab_size=4096)
    trainer.fit(model, torch.utils.data.DataLoader(list(zip(*batch)), batch_size=1))
    recompute.inner_candidates = FED
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    return model, optimizer, batch


def main(rounds: int = 11) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    arms = {"q/k/v fed": build(True), "before": build(False)}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, (model, optimizer, batch) in arms.items():
            optimizer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            model.loss(batch).backward()
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median step {statistics.median(values[1:]) * 1000:.0f} ms (forward + backward)")
    ratio = statistics.median(times["q/k/v fed"][1:]) / statistics.median(times["before"][1:])
    print(f"fed / before: {ratio:.3f}")
    grads = [{n: p.grad for n, p in model.named_parameters() if p.grad is not None} for model, _, _ in arms.values()]
    same = sum(torch.equal(grads[0][n], grads[1][n]) for n in grads[1])
    print(f"gradients: {same} of {len(grads[1])} trainable gradients bit-identical ({len(grads[0])} in the fed arm)")


if __name__ == "__main__":
    main()
