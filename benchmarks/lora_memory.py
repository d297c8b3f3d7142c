"""What LoRA shrinks: trainable parameters, gradient bytes and optimizer-state bytes vs full fine-tune.

One Lightning training step per setup on a transformers Llama (random weights, nothing
downloaded), then every storage alive is classified by owner with the profiler's categories
(:func:`lightning_hbm.memory.owned_storages`): exact bytes, also on CPU.

    python benchmarks/lora_memory.py                      # hidden 512, 4 layers, r=8, all-linear
    python benchmarks/lora_memory.py --hidden-size 1024 --layers 2 --r 16
    python benchmarks/lora_memory.py --accelerator cuda --hidden-size 2048   # GPU: adds the CUDA peak

Setups: full fine-tune (fp32, AdamW over everything), LoRA (fp32 frozen base) and QLoRA (nf4-dq
base, fp32 compute), and the Lightning checkpoint size of each. The user's ``configure_optimizers`` is the unchanged ``AdamW(self.parameters())``.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.memory import owned_storages, parameter_count
from lightning_hbm.models import LlamaLM

MiB = 2**20


def measure(args: argparse.Namespace, setup: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = LlamaLM(
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 2.6875),  # Llama's 11008/4096
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=max(1, args.hidden_size // 128),
    )
    callbacks = [] if setup == "full fine-tune" else [LoRA(r=args.r, target_modules=args.target_modules)]
    plugins = [QuantizedPrecision("nf4-dq", dtype="float32")] if setup.startswith("QLoRA") else []
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        plugins=plugins,
        default_root_dir="/tmp/lightning_hbm_lora_benchmark",
    )
    cuda = args.accelerator == "cuda"
    if cuda:  # guarded: on the CPU build these calls return 0 or raise
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(model, ByteTextDataModule(seq_len=64, batch_size=4, train_samples=64, max_bytes=300_000))
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    # After the step the gradients are still alive (Lightning zeroes them before the next backward).
    per_category: dict[str, int] = {}
    for category, nbytes in owned_storages(model, trainer.optimizers).values():
        per_category[category] = per_category.get(category, 0) + nbytes
    trainable, total = parameter_count(model, trainable=True), parameter_count(model)
    # LoRA's default checkpoint holds the trainable weights and their optimizer states only
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save_checkpoint(os.path.join(tmp, "last.ckpt"))
        checkpoint_bytes = os.path.getsize(os.path.join(tmp, "last.ckpt"))
    return {
        "setup": setup,
        "trainable": trainable,
        "percent": 100.0 * trainable / total,
        "parameters": per_category.get("parameters", 0),
        "gradients": per_category.get("gradients", 0),
        "optimizer_states": per_category.get("optimizer_states", 0),
        "checkpoint": checkpoint_bytes,
        "peak": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--target-modules", nargs="+", default=["all-linear"])
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu", help="cuda also prints the peak")
    args = parser.parse_args()
    if args.target_modules == ["all-linear"]:
        args.target_modules = "all-linear"
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    rows = [measure(args, setup) for setup in ("full fine-tune", "LoRA", "QLoRA (nf4-dq)")]
    full = rows[0]
    print(
        f"\nLlama hidden={args.hidden_size} layers={args.layers}, LoRA r={args.r} on {args.target_modules}; "
        "bytes after one training step (AdamW)\n"
    )
    print("| setup | trainable params | % | parameters MiB | gradients MiB | optimizer MiB | grad+opt vs full | checkpoint MiB (vs full) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        grad_opt = row["gradients"] + row["optimizer_states"]
        ratio = grad_opt / (full["gradients"] + full["optimizer_states"])
        print(
            f"| {row['setup']} | {row['trainable']:,} | {row['percent']:.2f} | {row['parameters'] / MiB:.2f} | "
            f"{row['gradients'] / MiB:.3f} | {row['optimizer_states'] / MiB:.3f} | {100 * ratio:.2f} % | "
            f"{row['checkpoint'] / MiB:.2f} ({100 * row['checkpoint'] / full['checkpoint']:.2f} %) |"
            + (f" CUDA peak {row['peak'] / MiB:.1f} MiB" if args.accelerator == "cuda" else "")
        )


if __name__ == "__main__":
    main()
