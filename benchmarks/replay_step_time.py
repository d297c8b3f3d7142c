"""What the checkpoint replay costs the training step (``lightning_hbm/activations/replay.py``, session 25).

At every checkpointed block's training forward ``ActivationCheckpointing`` builds a ``ForwardState``: the buffers the
block's forward changes (BatchNorm statistics, spectral_norm's ``u``, ``v``), copied so that checkpoint's recompute
starts from them. Here one Lightning fit per model (``QuantizedPrecision("nf4-dq")`` + ``LoRA`` +
``ActivationCheckpointing``) alternates, step by step, the library as it is and the library with ``ForwardState``
replaced by a no-op (the replay's absence: a BatchNorm's statistics are then updated twice a step, the bug it fixes;
for timing only). Each step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward,
optimizer step); pairs alternate the order (with, without / without, with) so that a slow drift of the machine falls
on both; the figure is the median of the per-pair ratios. Also printed: the time ``ForwardState``'s own work takes inside the
steps with it (added up step by step, median; the step's noise does not reach it), and the same work run alone in a
loop (building every block's ``ForwardState`` and replaying it once: µs a step, caches warm).

Models: a transformers ``LlamaForCausalLM`` from a config (8 layers, hidden 256; no buffer to replay: the cost is
the walk over the block's submodules) on 2 x 128 tokens, and a Conv-BN net (``tests/layers/conv_models.py``'s
ResNet18, its 8 ``BasicBlock`` s checkpointed, 19 BatchNorms in them; its EfficientNet-B0, 16 ``InvertedResidual`` s
with 3 BatchNorms each and little compute between them: the replay's worst case among real layouts) on
8 x 3 x 64 x 64 images.

    OMP_NUM_THREADS=1 python benchmarks/replay_step_time.py [--pairs 30] [--models llama resnet18]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import torch
import transformers as tf
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.activations import block_forward
from lightning_hbm.activations.replay import ForwardState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import EfficientNetB0, ResNet18  # noqa: E402

WARMUP = 4


class NoReplay:
    """``ForwardState`` that copies nothing and replays nothing: the step as it was before the replay."""

    def __init__(self, block: nn.Module) -> None:
        pass

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        yield


class Timed(ForwardState):
    """``ForwardState`` adding up the time of its own work inside the step (the walk and the copies, at the forward
    and around the recompute; not the block's)."""

    spent = 0.0

    def __init__(self, block: nn.Module) -> None:
        start = time.perf_counter()
        super().__init__(block)
        Timed.spent += time.perf_counter() - start

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        start = time.perf_counter()
        context = super().replayed(recompute)
        context.__enter__()
        Timed.spent += time.perf_counter() - start
        try:
            yield
        finally:
            start = time.perf_counter()
            context.__exit__(None, None, None)
            Timed.spent += time.perf_counter() - start


class Llama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = tf.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=2000, use_cache=False)  # fmt: skip
        self.model = tf.LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class ConvNet(pl.LightningModule):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


# model name -> (LightningModule, batch, LoRA targets, checkpointed block class)
MODELS: dict[str, Callable[[], tuple[pl.LightningModule, torch.Tensor, Any, str]]] = {
    "llama": lambda: (Llama(), torch.randint(0, 2000, (2, 128)), "all-linear", "LlamaDecoderLayer"),
    "resnet18": lambda: (ConvNet(ResNet18(classes=10)), torch.randn(8, 3, 64, 64), ["conv1", "conv2"], "BasicBlock"),
    "efficientnet-b0": lambda: (ConvNet(EfficientNetB0(classes=10)), torch.randn(8, 3, 64, 64), ["conv_pw", "conv_pwl"], "InvertedResidual"),
}


class Alternate(pl.Callback):
    """Times each step and switches ``ForwardState`` before it: after the warm-up, pairs (with, without) and
    (without, with) in turn."""

    def __init__(self) -> None:
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.spent: list[float] = []  # ms of ForwardState work in each step with it
        self.replay = True
        self.start = 0.0

    def arm(self, step: int) -> bool:
        pair, second = divmod(max(step - WARMUP, 0), 2)
        return (pair % 2 == 0) != bool(second)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.replay = self.arm(trainer.global_step)
        block_forward.ForwardState = Timed if self.replay else NoReplay  # type: ignore[misc]
        Timed.spent = 0.0
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        elapsed = time.perf_counter() - self.start
        if trainer.global_step > WARMUP:  # global_step already counts this step
            self.times[self.replay].append(elapsed * 1e3)
            if self.replay:
                self.spent.append(Timed.spent * 1e3)


def replay_us(module: nn.Module, block_class: str, calls: int = 2000) -> tuple[int, int, float]:
    """(blocks, buffers replayed per step, µs a step of ``ForwardState`` work for every block: built at the forward,
    replayed once by the recompute), median of ``calls``."""
    blocks = [m for m in module.modules() if type(m).__name__ == block_class]
    buffers = sum(len(ForwardState(b).buffers) for b in blocks)
    times = []
    with torch.no_grad():
        for _ in range(calls):
            start = time.perf_counter()
            for block in blocks:
                with ForwardState(block).replayed(True):
                    pass
            times.append(time.perf_counter() - start)
    return len(blocks), buffers, statistics.median(times) * 1e6


def measure(name: str, pairs: int) -> None:
    torch.manual_seed(0)
    module, batch, targets, block_class = MODELS[name]()
    timer = Alternate()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=WARMUP + 2 * pairs, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[timer, LoRA(r=8, target_modules=targets, modules_to_save=[]), ActivationCheckpointing(blocks=[block_class])],
    )  # fmt: skip
    trainer.fit(module, DataLoader([batch] * (WARMUP + 2 * pairs), batch_size=None))
    block_forward.ForwardState = ForwardState  # type: ignore[misc]
    with_, without = timer.times[True], timer.times[False]
    ratios = [w / o for w, o in zip(with_, without)]
    blocks, buffers, us = replay_us(module, block_class)
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"{name}: step with replay {statistics.median(with_):.1f} ms, without {statistics.median(without):.1f} ms, "
          f"median ratio of {len(ratios)} pairs {statistics.median(ratios):.4f} (quartiles {quartiles[0]:.4f}.."
          f"{quartiles[2]:.4f}); ForwardState for its {blocks} blocks ({buffers} buffers): inside the step "
          f"{statistics.median(timer.spent):.3f} ms, {100 * statistics.median(timer.spent) / statistics.median(without):.2f} % "
          f"of the step without it; alone {us:.1f} µs a step")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in args.models:
        measure(name, args.pairs)


if __name__ == "__main__":
    main()
