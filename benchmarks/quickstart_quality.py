"""Quality of the quickstart's run per base: ``examples/quickstart.py``'s own model, data and step count (issue 52).

Each arm trains the quickstart's ``TinyGPT`` (4 blocks, width 128, random weights from the seed) with its callbacks
(``LoRA(r=16, alpha=32)``, ``ActivationCheckpointing()``; the profiler is left out: it measures, it changes nothing)
on its data (``ByteTextDataModule(seq_len=128, batch_size=8, train_samples=8 * steps, max_bytes=500_000)``) for
``--steps`` steps (the quickstart's 60), bf16 compute, on the CPU. Held out: ``--val`` windows of 128 bytes of the
corpus' last 5 % (the datamodule's validation split, never trained on), mean next-byte cross-entropy of the model as
trained, in eval mode (``before``: the same at fit start, adapters at ``B = 0``: the stored base alone), and the mean
per-token cosine of the arm's logits to the ``16-bit`` arm's of the same seed, before and as trained. Per seed the arms share the base (the seed draws the model's weights, then the LoRA A draws)
and the batches.

Arms: ``16-bit`` (``precision="bf16-true"``: LoRA on the unquantized bf16 base, the ceiling), ``nf4-dq`` (the
quickstart's base until session 42: Hugging Face's QLoRA recipe), ``accurate-rN`` (``QuantizedPrecision("nf4-dq-b32",
rounding="gptq", correction_rank=N)``, its default probe: the first training batches up to 2048 tokens) for each
``--ranks``. ``B/weight``: the quantized Linears' stored bytes per weight as trained (packed weights, constants,
biases, the correction's factors), as ``benchmarks/finetune_quality.py`` counts them; the line above the table gives
``lightning_hbm.planner.accurate.accurate_4bit``'s count for the same model (what AutoFit would pick at 0.65).
``fit``: CPU seconds of ``trainer.fit`` and its ratio to the ``nf4-dq`` arm of the same seed (one process).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/quickstart_quality.py --seeds 0,1
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.planner.accurate import accurate_4bit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from finetune_quality import bytes_per_weight  # noqa: E402  (the sibling benchmark's count, so the figures compare)
from quickstart import TinyGPT  # noqa: E402  (the quickstart's own model)


def arms(ranks: list[int]) -> dict[str, Optional[dict[str, Any]]]:
    """Each arm's ``QuantizedPrecision`` arguments (``None``: no quantization)."""
    accurate = {f"accurate-r{r}": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=r) for r in ranks}
    return {"16-bit": None, "nf4-dq": dict(mode="nf4-dq"), **accurate}


@torch.no_grad()
def held_out(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, torch.Tensor]:
    """Mean next-byte cross-entropy of ``model`` over ``(input, target)`` batches, in eval mode, and its logits (fp32)."""
    was_training = model.training
    model.eval()
    logits = torch.cat([model(x).float().flatten(0, 1) for x, _ in batches])
    model.train(was_training)
    return F.cross_entropy(logits, torch.cat([y.flatten() for _, y in batches])).item(), logits


def cosine(logits: torch.Tensor, reference: Optional[torch.Tensor]) -> float:
    """Mean per-token cosine of two arms' logits (nan without a 16-bit arm)."""
    return F.cosine_similarity(logits, reference, dim=-1).mean().item() if reference is not None else math.nan


class Start(pl.Callback):
    """The held-out loss and logits of the model as the arm stores it, adapters at their start (``B = 0``)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loss, self.logits = held_out(pl_module, self.batches)


def run_arm(quant: Optional[dict[str, Any]], seed: int, steps: int, batches: list[Any]) -> dict[str, Any]:
    """Train the quickstart's model with one arm's base; its held-out loss and logits at the start and as trained,
    bytes per weight and fit CPU seconds."""
    pl.seed_everything(seed, verbose=False)
    model = TinyGPT()
    data = ByteTextDataModule(seq_len=128, batch_size=8, train_samples=8 * steps, max_bytes=500_000)
    start = Start(batches)
    precision: dict[str, Any] = {"plugins": [QuantizedPrecision(dtype="bfloat16", **quant)]} if quant else {"precision": "bf16-true"}
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[LoRA(r=16, alpha=32), ActivationCheckpointing(), start], **precision,
    )  # fmt: skip
    began = time.process_time()
    trainer.fit(model, datamodule=data)
    fit_s = time.process_time() - began
    after, logits = held_out(model, batches)
    return dict(before=start.loss, start_logits=start.logits, after=after, logits=logits, bpw=bytes_per_weight(model) if quant else 2.0, fit_s=fit_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (the quickstart's default, 60)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--ranks", default="4,8,16", help="correction ranks of the accurate arms")
    parser.add_argument("--arms", default=None, help="comma-separated subset of the arms (default: all)")
    parser.add_argument("--val", type=int, default=256, help="held-out windows of 128 bytes")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    table = arms([int(r) for r in args.ranks.split(",")])
    chosen = args.arms.split(",") if args.arms else list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        parser.error(f"--arms: unknown {unknown}; known: {list(table)}")
    batches = list(ByteTextDataModule(seq_len=128, batch_size=8, val_samples=args.val, max_bytes=500_000).val_dataloader())
    picked = accurate_4bit(TinyGPT(), "bfloat16")
    print(f"accurate_4bit on the quickstart's model (AutoFit's accurate candidate at 0.65): {picked.describe()}")
    print(f"quickstart's model, {args.steps} steps of 8 x 128 bytes, LoRA r=16, bf16, CPU; held out {args.val} x 128 bytes")
    print("| arm | seed | before | cos to 16-bit, before | after, as trained | gap to 16-bit | cos to 16-bit, trained | B/weight | fit CPU s | fit / nf4-dq |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in (int(s) for s in args.seeds.split(",")):
        results = {name: run_arm(table[name], seed, args.steps, batches) for name in chosen}
        ceiling = results.get("16-bit")
        reference = results.get("nf4-dq", {}).get("fit_s", math.nan)
        for name, r in results.items():
            gap = 100 * (r["after"] / ceiling["after"] - 1) if ceiling else math.nan
            start_cos = cosine(r["start_logits"], ceiling["start_logits"] if ceiling else None)
            trained_cos = cosine(r["logits"], ceiling["logits"] if ceiling else None)
            print(
                f"| {name} | {seed} | {r['before']:.4f} | {start_cos:.5f} | {r['after']:.4f} | {gap:+.2f} % | {trained_cos:.5f} | {r['bpw']:.3f} | {r['fit_s']:.1f} | {r['fit_s'] / reference:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
