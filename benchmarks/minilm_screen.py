"""MiniLM bases screened before training: held-out loss, embedding cosine to fp32, bytes per quantized weight.

The one-step screen that chose ``benchmarks/finetune_minilm.py``'s arms at 0.65 bytes per weight or less (issue 52,
session 40): for each ``QuantizedPrecision`` configuration given (keyword syntax, e.g. ``'mode="nf4-dq",rounding="gptq",
correction_rank=8'``), the fine-tune of ``finetune_minilm.py`` (same task, seed, probe, LoRA) is started and stopped at
``on_train_start``, after the surgery and before any step: the held-out InfoNCE loss there, the mean cosine of the
held-out embeddings to the unquantized fp32 model's, and the bytes per quantized Linear weight as the coverage table
counts them (constants, biases and correction factors included)::

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/minilm_screen.py --seed 0 'mode="nf4-dq"' \\
        'mode="nf4-dq",rounding="gptq",correction_rank=8'
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch.nn.functional as F

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers.coverage_table import coverage

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_minilm as fm  # noqa: E402  (the sibling benchmark's task)


class _Stop(pl.Callback):
    def __init__(self, held_out: list[Any], reference: Any) -> None:
        self.held_out, self.reference = held_out, reference
        self.out: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        emb = fm.held_out_embeddings(pl_module, self.held_out)
        linear = [row for row in coverage(pl_module, True, True) if row.kind == "Linear"]
        bpw = sum(row.bytes for row in linear) / sum(row.params for row in linear)
        cosine = F.cosine_similarity(emb, self.reference, dim=-1).mean().item()
        self.out = (fm.scores(emb)["loss"], cosine, bpw)
        raise KeyboardInterrupt  # Lightning's graceful stop: the screen needs no step


def _config(spec: str) -> dict[str, Any]:
    return dict(eval(f"dict({spec})", {"__builtins__": {"dict": dict}}))  # keyword syntax only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="QuantizedPrecision keywords, e.g. 'mode=\"nf4-dq\",correction_rank=8'")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    path = str(fm.minilm_path())
    encode = fm.Encoder(path, 32)
    train_pairs, held = fm.split(256)
    held_out = [encode(held[i : i + 64]) for i in range(0, len(held), 64)]
    order = random.Random(args.seed).sample(train_pairs, len(train_pairs))
    train = [encode(order[i * 8 : (i + 1) * 8]) for i in range(150)]  # all of them: the probe takes the first ones
    pl.seed_everything(args.seed, verbose=False)
    reference = fm.held_out_embeddings(fm.PairEmbedding(path, 5e-4).eval(), held_out)
    for spec in args.configs:
        pl.seed_everything(args.seed, verbose=False)
        module, stop = fm.PairEmbedding(path, 5e-4), _Stop(held_out, reference)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, limit_val_batches=0, logger=False,
                             enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                             plugins=[QuantizedPrecision(dtype="float32", **_config(spec))],
                             callbacks=[LoRA(r=fm.R, alpha=fm.ALPHA), stop])
        start = time.perf_counter()
        with contextlib.suppress(SystemExit):  # Lightning's graceful shutdown after the KeyboardInterrupt exits
            trainer.fit(module, datamodule=fm.Batches(train))
        loss, cosine, bpw = stop.out
        print(f"{spec}: before {loss:.4f}, cosine to fp32 {cosine:.5f}, {bpw:.4f} B/weight, "
              f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
