"""Step-time overhead of HBMProfiler: light mode (every step) and detailed mode, as ratios in one process.

Runs the same NanoGPT training under Lightning without the callback, with ``HBMProfiler()``
(light, every step) and with every step detailed, interleaved over several rounds so that load
from other processes hits all three alike. Step time = time between consecutive
``on_train_batch_start`` calls (all callback work included), counted in CPU time of this process
(``time.process_time``: the dev machine is shared, and wall time there measures the neighbours),
one torch thread, warm-up steps dropped, median taken.

    python benchmarks/profiler_overhead.py            # default: 4 layers, n_embd 256, batch 8 x 128 tokens
    python benchmarks/profiler_overhead.py --rounds 5 --steps 12
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_hbm import HBMProfiler
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import NanoGPT


class StepTimer(pl.Callback):
    """CPU time of this process between consecutive training batch starts."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(time.process_time())

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])][warmup:]


def run(profiler: Optional[HBMProfiler], args: argparse.Namespace, root: str) -> list[float]:
    torch.manual_seed(0)
    model = NanoGPT(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.seq_len)
    data = ByteTextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, train_samples=args.steps * args.batch_size)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer] + ([profiler] if profiler is not None else [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=root, callbacks=callbacks,
    )
    trainer.fit(model, data)
    return timer.step_times(warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    times: dict[str, list[float]] = {"none": [], "light": [], "detailed": []}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.rounds):
            times["none"] += run(None, args, root)
            times["light"] += run(HBMProfiler(summary=False), args, root)
            times["detailed"] += run(HBMProfiler(detailed_steps=range(args.steps), summary=False), args, root)
    base = statistics.median(times["none"])
    print(f"model: NanoGPT n_layer={args.n_layer} n_embd={args.n_embd}, batch {args.batch_size} x {args.seq_len} tokens, "
          f"torch threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps - 2} timed steps each")
    print(f"median step CPU time without profiler: {base * 1000:.1f} ms")
    for mode in ("light", "detailed"):
        ratio = statistics.median(times[mode]) / base
        print(f"{mode:>8}: step-time ratio {ratio:.3f} (overhead {100 * (ratio - 1):+.1f} %)")


if __name__ == "__main__":
    main()
