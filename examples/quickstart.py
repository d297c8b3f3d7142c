"""Quickstart: your own LightningModule, trained on a 4-bit base with LoRA, on a CPU (no GPU needed) or a GPU.

The model below is what a user writes: a small GPT (nanoGPT style) and an unchanged
``configure_optimizers`` over ``self.parameters()``. lightning_hbm changes nothing in it; the lines
marked ``# lightning_hbm`` are all it takes to shrink the memory terms:

* ``QuantizedPrecision("nf4-dq-b32", rounding="gptq", correction_rank=4)``: parameters (frozen Linear weights stored
  as 4-bit NF4 in blocks of 32, GPTQ-rounded, with a frozen rank-4 correction of each layer's 4-bit output error,
  fitted at fit start on the first training batches: the accurate 4-bit base, what ``AutoFit`` picks for this model
  at 0.65 bytes per weight). ``QuantizedPrecision("nf4-dq")`` is Hugging Face's QLoRA base, bit for bit: the
  reference, further from 16-bit on pretrained weights (``benchmarks/README.md``, "The quickstart's base").
* ``LoRA(r=16)``: gradients and optimizer states (only small adapters train: QLoRA).
* ``ActivationCheckpointing()``: activations (each block's are recomputed in backward).
* ``HBMProfiler()``: shrinks nothing, shows all five terms per step (table at the end, CSV/JSON/PNG
  in ``lightning_logs/quickstart``).

The data is byte-level text from Python's own standard library sources: nothing is downloaded.
The same script runs on a GPU unchanged (``accelerator="auto"``).

    python examples/quickstart.py             # 60 steps
    python examples/quickstart.py --steps 8   # shorter (tests/test_examples.py does this)
    OMP_NUM_THREADS=1 python examples/quickstart.py   # on a CPU busy with other jobs: one torch thread
"""

from __future__ import annotations

import argparse
import logging
import math
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import ActivationCheckpointing, HBMProfiler, LoRA, QuantizedPrecision  # lightning_hbm
from lightning_hbm.data import VOCAB_SIZE, ByteTextDataModule


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a GELU MLP, each with a residual."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(n_embd)
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_out = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


class TinyGPT(pl.LightningModule):
    """A plain LightningModule: nothing in it knows about lightning_hbm."""

    def __init__(self, n_layer: int = 4, n_embd: int = 128, n_head: int = 4, block_size: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB_SIZE, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class PrintLoss(pl.Callback):
    """Prints the training loss every few steps, so the falling loss is visible without a logger."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: dict, batch: object, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))
        step = len(self.losses)
        if step == 1 or step % self.every == 0 or step == trainer.max_steps:
            print(f"step {step:4d}  loss {self.losses[-1]:.3f}", flush=True)


def main(steps: int = 60, seed: int = 0, root_dir: str = "lightning_logs/quickstart") -> list[float]:
    """Train for ``steps`` optimizer steps (run files under ``root_dir``); return the per-step losses."""
    pl.seed_everything(seed, verbose=False)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a harmless notice about an optional kernel
    on_gpu = torch.cuda.is_available()
    model = TinyGPT()
    data = ByteTextDataModule(seq_len=128, batch_size=8, train_samples=8 * steps, max_bytes=500_000)
    printer = PrintLoss(every=max(1, steps // 10))
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        # lightning_hbm: the accurate 4-bit base (AutoFit's pick here, bf16 compute): within 1 % of 16-bit LoRA on SmolLM2, MiniLM
        plugins=[QuantizedPrecision("nf4-dq-b32", rounding="gptq", correction_rank=4)],
        # plugins=[QuantizedPrecision("nf4-dq")],  # Hugging Face's QLoRA base, bit for bit: +4.94 / +3.05 % on SmolLM2
        callbacks=[LoRA(r=16, alpha=32), ActivationCheckpointing(), HBMProfiler(every_n_steps=10), printer],  # lightning_hbm
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=root_dir,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    losses = printer.losses
    first, last = sum(losses[:5]) / min(5, len(losses)), sum(losses[-5:]) / min(5, len(losses))
    print(
        f"done: {len(losses)} steps in {time.perf_counter() - start:.0f}s on {'GPU' if on_gpu else 'CPU'}; "
        f"loss {first:.3f} -> {last:.3f} (uniform guess: {math.log(VOCAB_SIZE):.3f})"
    )
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default 60)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root_dir", default="lightning_logs/quickstart", help="where the profiler report goes")
    args = parser.parse_args()
    main(args.steps, args.seed, args.root_dir)
