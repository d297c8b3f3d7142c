"""What checkpoint integrity costs on a SmolLM2-135M-sized model (built from its config, random weights).

* the fingerprint of every as-built tensor, taken before quantization on every fit (v1: 64 samples per tensor;
  v2: every byte up to 16 MiB, exact row/column sums above);
* sealing a full checkpoint (CRC32 of every weight and of AdamW's two states) and verifying it on load.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/checkpoint_integrity.py``
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hbm import resume


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    tensors = model.state_dict(keep_vars=True)
    print(f"model: {params / 1e6:.1f}M parameters, {len(tensors)} tensors")
    for name, fn in [("fingerprint v1 (64 samples)", resume.fingerprint_v1), ("fingerprint v2", resume.fingerprint)]:
        print(f"{name}: {best_of(lambda: [fn(v) for v in tensors.values()]):.2f} s")  # noqa: B023 - called at once, in this iteration
    weights = {k: v.detach() for k, v in tensors.items()}
    states = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for i, v in enumerate(weights.values())}
    checkpoint = {"state_dict": weights, "optimizer_states": [{"state": states}], resume.META_KEY: {}}
    checkpoint[resume.META_KEY] = {"state_dict": {}, "placeholders": [], "omitted": [], "fingerprints": {}, "configs": {}}
    size = sum(t.numel() * t.element_size() for t in resume.tensor_entries(checkpoint).values())
    print(f"seal (CRC32 of {size / 2**20:.0f} MiB: weights + AdamW states): {best_of(lambda: resume.seal(checkpoint)):.2f} s")

    def verify() -> None:
        checkpoint[resume.META_KEY].pop("verified", None)
        resume.verify(checkpoint, "bench.ckpt")

    print(f"verify: {best_of(verify):.2f} s")


if __name__ == "__main__":
    main()
