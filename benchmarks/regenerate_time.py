"""Step time of ``ActivationCheckpointing(regenerate=n)`` (block inputs remade in the backward) against every input kept.

A fp32 transformers Llama (hidden 256, intermediate 688, 8 blocks, 1,024 tokens), LoRA r=8, full recompute with the
inputs offloaded (to the same CPU memory here) and ``mlp_chunks=4``; forward + backward steps of each setting
interleaved in one process, the median of each. CPU only: the extra block forwards cost the same share of the
compute on a GPU, but the copies to and from the host do not overlap here.

    OMP_NUM_THREADS=1 python benchmarks/regenerate_time.py
"""

from __future__ import annotations

import statistics
import time

import torch

from lightning_hbm import ActivationCheckpointing, LoRA
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM


def model(regenerate: int) -> LlamaLM:
    torch.manual_seed(0)
    built = LlamaLM(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=1024)
    LoRA(r=8).transform_model(built)
    ActivationCheckpointing("full", offload=True, mlp_chunks=4, regenerate=regenerate).transform_model(built)
    return built


def main(steps: int = 15) -> None:
    x, y = synthetic_batch(1, 1024, vocab_size=2048)
    models = {n: model(n) for n in (1, 2, 3)}
    times: dict[int, list[float]] = {n: [] for n in models}
    for _ in range(steps):
        for n, built in models.items():
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(built(x).flatten(0, 1), y.flatten())
            loss.backward()
            times[n].append(time.perf_counter() - start)
            built.zero_grad(set_to_none=True)
    base = statistics.median(times[1][1:])
    for n, measured in times.items():
        median = statistics.median(measured[1:])
        print(f"regenerate={n}: median step {median * 1000:.0f} ms ({median / base:.2f}x), {steps - 1} steps after the first")


if __name__ == "__main__":
    main()
