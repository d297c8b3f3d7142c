"""Step time of ``ActivationCheckpointing(regenerate=n)`` under ``QuantizedFSDPStrategy`` (FSDP2), n = 1, 2, 3.

The 8-block case whose per-rank memory is in benchmarks/README.md (FSDP section, session 37: 4,098,192 B with
``regenerate=1``, 3,704,976 with 2, 3,573,904 with 3): a LightningModule holding an ``nn.Embedding``, eight residual
MLP blocks (LayerNorm, Linear 256 -> 512 -> 256) in ``self.blocks = nn.Sequential(...)``, a LayerNorm and an untied
head (vocabulary 256, hidden 256), nf4 (fp32 compute), LoRA r=4, every block checkpointed (``policy="full"``), each
block an FSDP2 unit (the strategy's default), batch 4 x 32 tokens per rank, 2 gloo ranks on the CPU (Lightning's
launcher runs this script again for rank 1).

The settings are interleaved in one process pair: ``--rounds`` rounds, each one fit of ``--steps`` steps per setting
(a fresh model and Trainer, seed 0), in the order 1, 2, 3; a step is timed from ``on_train_batch_start`` to
``on_train_batch_end`` (forward, backward with the remakes and their all-gathers, reduce-scatter, optimizer step),
the first ``--warmup`` steps of each fit left out. Rank 0 prints the median step of each setting over all rounds, in
wall time and in rank 0's CPU time (``time.process_time``: less moved by other processes on a shared machine), each
with its ratio to ``regenerate=1``, and each round's median wall step (the spread). CPU and gloo only: not run on NCCL or a GPU.

    OMP_NUM_THREADS=1 python benchmarks/regenerate_fsdp_time.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.models import _CausalLMModule

HIDDEN = 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Stack(_CausalLMModule):
    """tests/strategies/test_fsdp_sequential_blocks_s35.py's ``called_long``: eight blocks, the stack called."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, HIDDEN)
        self.blocks = nn.Sequential(*(Block() for _ in range(8)))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, 256, bias=False)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.blocks(self.embed(idx))))


class StepTimes(pl.Callback):
    """Each step's wall time and this process's CPU time (its threads, gloo's included)."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.cpu: list[float] = []
        self.start = self.start_cpu = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.start, self.start_cpu = time.perf_counter(), time.process_time()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.seconds.append(time.perf_counter() - self.start)
        self.cpu.append(time.process_time() - self.start_cpu)


def fit(regenerate: int, steps: int) -> tuple[StepTimes, int]:
    """The step times of one fit of ``steps`` steps, and the inputs remade in its last step's backward."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (4 * steps, 33))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    timer = StepTimes()
    checkpointing = ActivationCheckpointing("full", regenerate=regenerate)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp_qlora", max_steps=steps, logger=False,
        plugins=[QuantizedPrecision("nf4", dtype="float32")],
        callbacks=[LoRA(r=4, alpha=8, dropout=0.0), checkpointing, timer], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(Stack(), train_dataloaders=loader)
    return timer, checkpointing.remade.inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = (1, 2, 3)
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in settings} for k in ("wall", "cpu")}
    rounds: dict[int, list[float]] = {n: [] for n in settings}
    remade: dict[int, int] = {}
    for _ in range(args.rounds):
        for n in settings:
            timer, remade[n] = fit(n, args.steps)
            times["wall"][n] += timer.seconds[args.warmup:]
            times["cpu"][n] += timer.cpu[args.warmup:]
            rounds[n].append(statistics.median(timer.seconds[args.warmup:]))
    if torch.distributed.get_rank() != 0:
        return
    base = {k: statistics.median(t[1]) for k, t in times.items()}
    for n in settings:
        wall, cpu = (statistics.median(times[k][n]) for k in ("wall", "cpu"))
        spread = ", ".join(f"{r * 1000:.1f}" for r in rounds[n])
        print(f"regenerate={n}: median step {wall * 1000:.1f} ms wall ({wall / base['wall']:.3f}x), "
              f"{cpu * 1000:.1f} ms of rank 0's CPU ({cpu / base['cpu']:.3f}x), {len(times['wall'][n])} steps, "
              f"{remade[n]} inputs remade a step; wall per round {spread} ms")

if __name__ == "__main__":
    main()
