"""Many fits in one process (a sweep, a notebook, a test suite; issue 55 item 6): how many fitted models stay alive and
how much the process grows per fit, for a plain Lightning fit and for QuantizedPrecision('nf4-dq') + LoRA (with and
without HBMProfiler). A tiny NanoGPT, one step per fit; resident memory read from /proc after a gc at fit 20 and at
the last fit, so the figure per fit is the slope past the first fits' warm-up (imports, allocator pools).

    OMP_NUM_THREADS=1 python benchmarks/repeated_fits.py 300
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_hbm import HBMProfiler, LoRA, QuantizedPrecision
from lightning_hbm.models import NanoGPT


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fit_once(kind: str, data: list, tmp: str) -> None:
    """One fit, in a frame of its own: nothing of it is held once it returns, unless the library holds it."""
    callbacks: list[Any] = [] if kind == "plain" else [LoRA(r=2)]
    if kind == "lora+profiler":
        callbacks.append(HBMProfiler(summary=False, dirpath=tmp))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=tmp,
        plugins=[] if kind == "plain" else [QuantizedPrecision("nf4-dq", dtype="float32")],
    )  # fmt: skip
    trainer.fit(NanoGPT(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=64), DataLoader(data, batch_size=None))


def run(kind: str, fits: int) -> str:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    data = [(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))) for _ in range(2)]
    marks: dict[int, float] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(fits):
            fit_once(kind, data, tmp)
            if i in (19, fits - 1):
                gc.collect()
                marks[i] = rss_mib()
    gc.collect()
    alive = sum(isinstance(o, NanoGPT) for o in gc.get_objects())
    slope = (marks[fits - 1] - marks[19]) / (fits - 20)
    return (f"{kind}: {fits} fits, models alive at the end {alive}, RSS {marks[19]:.1f} MiB at fit 20 -> "
            f"{marks[fits - 1]:.1f} MiB at fit {fits}: {slope:+.3f} MiB per fit, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    fits = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    if len(sys.argv) > 2:  # one kind in this process
        print(run(sys.argv[2], fits), flush=True)
    else:  # each kind in a process of its own (one kind's imports and pools would count in the next one's figures)
        import subprocess

        for kind in ("plain", "lora", "lora+profiler"):
            subprocess.run([sys.executable, __file__, str(fits), kind], check=True)
