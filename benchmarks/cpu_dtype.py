"""Which compute dtype trains fastest on this CPU: the example's QLoRA step (SmolLM2-135M, ``--mode`` (default the
example's ``int4-g32``), LoRA r=16 on every Linear, 2 x 128 tokens) in float32 and in bfloat16, interleaved in one
process.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/cpu_dtype.py --rounds 2 --steps 4 [--mode nf4-dq]

Reported: the median CPU time (``time.process_time``) of the steps after the first of each fit, per dtype, and the
ratio bf16 / fp32, with the CPU's flags (``avx512_bf16``, ``amx_bf16``) and the load average.
Then what ``QuantizedPrecision(dtype="auto")`` (``lightning_hbm.precision.compute_dtype``, what
``examples/finetune_smollm2.py`` uses) chooses on the same machine from its timed block, and whether that agrees with
the step measured here.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import HFCausalLM
from lightning_hbm.precision.compute_dtype import auto_dtype
from lightning_hbm.pretrained import smollm2_path


class StepTimer(pl.Callback):
    """CPU seconds of each training step (forward, backward, optimizer)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.process_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.process_time() - self._start)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def run(path: str, dtype: str, steps: int, mode: str) -> list[float]:
    pl.seed_everything(0, verbose=False)
    data = ByteTextDataModule(128, 2, train_samples=steps * 2, val_samples=2, max_bytes=200_000, tokenizer=path)
    timer = StepTimer()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         plugins=[QuantizedPrecision(mode, dtype=dtype)], callbacks=[LoRA(r=16, alpha=32), timer])
    trainer.fit(HFCausalLM(path, lr=1e-3), train_dataloaders=data.train_dataloader())
    return timer.times[1:]  # the first step pays one-time costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--mode", default="int4-g32", help="the precision mode (examples/finetune_smollm2.py: int4-g32)")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    path = str(smollm2_path())
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for _ in range(args.rounds):
        for dtype in times:
            times[dtype] += run(path, dtype, args.steps, args.mode)
    flags = cpu_flags()
    med = {d: statistics.median(t) for d, t in times.items()}
    print(f"mode {args.mode}, torch {torch.__version__}, threads {torch.get_num_threads()}, avx512_bf16 {'avx512_bf16' in flags}, "
          f"amx_bf16 {'amx_bf16' in flags}, load {os.getloadavg()}")
    for d, t in times.items():
        print(f"{d:9s} median CPU s/step {med[d]:.2f} over {len(t)} steps: {[round(x, 2) for x in t]}")
    print(f"bf16 / fp32 = {med['bfloat16'] / med['float32']:.2f}")
    choice = auto_dtype("cpu")
    faster = "bfloat16" if med["bfloat16"] < med["float32"] else "float32"
    print(choice.describe())
    print(f"dtype='auto' {'agrees' if str(choice.dtype) == f'torch.{faster}' else 'DISAGREES'} with the step: {faster} is faster here")


if __name__ == "__main__":
    main()
