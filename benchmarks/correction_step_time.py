"""Step time of the accurate 4-bit base AutoFit now prefers (issue 52): ``nf4-dq-b32`` + GPTQ + a rank-16 calibrated
correction, against the plain QLoRA base ``nf4-dq``, as a ratio of training step times (forward + backward + AdamW on
LoRA r=16 adapters of every Linear) measured interleaved in one process, median of rounds. GPTQ and the block size
change only the stored values and constants; the correction adds two rank-16 matmuls per quantized Linear.

    OMP_NUM_THREADS=1 python benchmarks/correction_step_time.py [--rounds 5] [--steps 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM

ARMS = {
    "nf4-dq": dict(mode="nf4-dq"),
    "nf4-dq-b32+gptq+c16": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16),
}
# SmolLM2-135M's widths at 4 layers: the correction's share of a Linear's work is what it is on the real model
SHAPE = dict(vocab_size=4096, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=1024)  # fmt: skip
BATCH, SEQ = 2, 256


def build(arm: str, reference: nn.Module, dtype: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(reference)
    probe = synthetic_batch(4, 512, vocab_size=SHAPE["vocab_size"], seed=1)  # 2048 tokens, as the default probe
    QuantizedPrecision(dtype=dtype, probe_batch=probe, **ARMS[arm]).convert_module(model)
    LoRA(r=16, alpha=32).transform_model(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-4)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, dtype: torch.dtype) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = model.training_step(batch, 0)
    loss = loss["loss"] if isinstance(loss, dict) else loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    torch.manual_seed(0)
    reference = LlamaLM(**SHAPE)
    built = {arm: build(arm, reference, args.dtype) for arm in ARMS}
    batch = synthetic_batch(BATCH, SEQ, vocab_size=SHAPE["vocab_size"], seed=2)
    dtype = getattr(torch, args.dtype)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for arm in ARMS:  # one warm-up step each
        step(*built[arm], batch, dtype)
    for _ in range(args.rounds):  # interleaved: the machine's load falls on both alike
        for arm in ARMS:
            times[arm].append(statistics.median(step(*built[arm], batch, dtype) for _ in range(args.steps)))
    base = statistics.median(times["nf4-dq"])
    for arm in ARMS:
        median = statistics.median(times[arm])
        print(f"{arm}: median step {median * 1000:.0f} ms, {median / base:.3f}x nf4-dq's "
              f"({args.rounds} rounds x {args.steps} steps, {args.dtype}, batch {BATCH} x {SEQ})", flush=True)


if __name__ == "__main__":
    main()
