"""Step-time overhead of HBMProfiler (light and detailed modes), as ratios of runs in one process.

Runs the same NanoGPT training under Lightning without the callback; with ``HBMProfiler()`` (light,
at its default cadence: the Trainer's ``log_every_n_steps``); light every step; and every step
detailed. The modes are interleaved over several rounds, so drift and neighbours hit all alike.
Step time = time between consecutive ``on_train_batch_start`` calls (all callback work included),
counted in CPU time of this process (``time.process_time``: the dev machine is shared, and wall
time there measures the neighbours), one torch thread, warm-up steps dropped, mean taken (a light
measurement every n steps only shows in the mean).

    python benchmarks/profiler_overhead.py            # default: 4 layers, n_embd 256, batch 8 x 128 tokens
    python benchmarks/profiler_overhead.py --n-layer 2 --n-embd 128 --seq-len 64   # a smaller step: larger share
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch

from lightning_hbm import HBMProfiler
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import NanoGPT


class StepTimer(pl.Callback):
    """Time between consecutive training batch starts: CPU time of this process on CPU, wall time
    after a device synchronization on CUDA (where the work is not in this process's CPU time)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def _now(self, pl_module: pl.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
            return time.perf_counter()
        return time.process_time()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.starts.append(self._now(pl_module))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.starts.append(self._now(pl_module))

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.starts, self.starts[1:])][warmup:]


def run(profiler: Optional[HBMProfiler], args: argparse.Namespace, root: str) -> list[float]:
    torch.manual_seed(0)
    model = NanoGPT(n_layer=args.n_layer, n_head=4, n_embd=args.n_embd, block_size=args.seq_len)
    data = ByteTextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, train_samples=args.steps * args.batch_size)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer] + ([profiler] if profiler is not None else [])
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        default_root_dir=root, callbacks=callbacks, log_every_n_steps=args.log_every,
    )
    trainer.fit(model, data)
    return timer.step_times(warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--log-every", type=int, default=10, help="the Trainer's log_every_n_steps")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    modes: dict[str, Callable[[], Optional[HBMProfiler]]] = {
        "none": lambda: None,
        f"light, default cadence (every {args.log_every} steps)": lambda: HBMProfiler(detailed_steps=(), summary=False),
        "light, every step": lambda: HBMProfiler(every_n_steps=1, detailed_steps=(), summary=False),
        "detailed, every step": lambda: HBMProfiler(detailed_steps=range(args.steps), summary=False),
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.rounds):  # interleaved: drift and neighbours hit every mode alike
            for name, make in modes.items():
                times[name] += run(make(), args, root)
    base = statistics.mean(times["none"])
    print(
        f"model: NanoGPT n_layer={args.n_layer} n_embd={args.n_embd}, batch {args.batch_size} x {args.seq_len} tokens, "
        f"torch threads {torch.get_num_threads()}, {args.rounds} rounds x {args.steps - 2} timed steps per mode"
    )
    clock = "CPU" if args.accelerator == "cpu" else "wall (synchronized)"
    print(f"{args.accelerator}: mean step {clock} time without profiler: {base * 1000:.1f} ms")
    for name in list(modes)[1:]:
        ratio = statistics.mean(times[name]) / base
        print(f"{name:>42}: step-time ratio {ratio:.3f} (overhead {100 * (ratio - 1):+.1f} %)")


if __name__ == "__main__":
    main()
