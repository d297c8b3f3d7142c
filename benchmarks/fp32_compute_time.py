"""Step time of T5's ``wo`` stored quantized and computed in fp32 (``Fp32ComputeLinear``, issue 53 item 3).

transformers' T5 feed-forward reads ``self.wo.weight`` up to four times a forward (its dtype, to cast the hidden
states to it); ``Fp32ComputeLinear.weight`` dequantizes the whole stored weight into fp32 on each read, and its
forward dequantizes once more. What that costs, as a ratio of training step times (forward + backward, LoRA r=8 on
every Linear, bf16 compute) measured interleaved in one process, median of rounds:

- ``fp32-compute``: the library's default (every Linear in nf4-dq, ``wo`` an ``Fp32ComputeLinear``);
- ``reads cached``: the same, with ``weight`` returning an fp32 copy made once (the cost of the reads alone);
- ``fp32 wo (before)``: the behaviour before issue 53: ``wo`` a float32 ``nn.Linear`` (4 bytes a weight);
- ``bf16``: nothing quantized (the whole model in bf16, ``wo`` included).

    OMP_NUM_THREADS=1 python benchmarks/fp32_compute_time.py [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

from lightning_hbm import LoRA, quantize_model
from lightning_hbm.layers.linear import Fp32ComputeLinear

VOCAB, BATCH, SEQ = 512, 4, 64


def t5(variant: str) -> nn.Module:
    torch.manual_seed(0)
    config = T5Config(
        d_model=512, d_ff=1024, num_layers=4, num_heads=8, d_kv=64, vocab_size=VOCAB, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu", dropout_rate=0.0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config).to(torch.bfloat16)
    if variant == "fp32 wo (before)":
        for name, layer in model.named_modules():
            if name.endswith(".wo"):
                layer.float().weight.requires_grad_(False)
        quantize_model(model, "nf4-dq", dtype="bfloat16", ignore_modules=["wo"])
    elif variant != "bf16":
        quantize_model(model, "nf4-dq", dtype="bfloat16")
    else:
        model.requires_grad_(False)
    LoRA(r=8, alpha=16).transform_model(model)
    return model


def cached_reads() -> Callable[[], None]:
    """Make ``Fp32ComputeLinear.weight`` return an fp32 copy made once per layer; returns the undo."""
    original = Fp32ComputeLinear.weight
    cache: dict[int, torch.Tensor] = {}

    def weight(self: Fp32ComputeLinear) -> torch.Tensor:
        if id(self) not in cache:
            cache[id(self)] = original.fget(self)  # type: ignore[attr-defined]
        return cache[id(self)]

    Fp32ComputeLinear.weight = property(weight)  # type: ignore[assignment,method-assign]
    return lambda: setattr(Fp32ComputeLinear, "weight", original)


def step_seconds(model: nn.Module, tokens: torch.Tensor, steps: int, cached: bool) -> float:
    undo = cached_reads() if cached else (lambda: None)
    try:
        start = time.perf_counter()
        for _ in range(steps):
            loss = model(input_ids=tokens, labels=tokens.flip(1)).loss
            loss.backward()
        return (time.perf_counter() - start) / steps
    finally:
        undo()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    variants = ["fp32-compute", "reads cached", "fp32 wo (before)", "bf16"]
    models = {v: t5(v) for v in variants}
    times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up
        step_seconds(models[v], tokens, 1, v == "reads cached")
    for _ in range(args.rounds):
        for v in variants:
            times[v].append(step_seconds(models[v], tokens, args.steps, v == "reads cached"))
    base = statistics.median(times["fp32-compute"])
    print("| variant | step (s, median) | ratio to fp32-compute |")
    print("|---|---:|---:|")
    for v in variants:
        print(f"| {v} | {statistics.median(times[v]):.4f} | {statistics.median(times[v]) / base:.3f} |")


if __name__ == "__main__":
    main()
