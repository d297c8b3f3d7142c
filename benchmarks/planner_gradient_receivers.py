"""What the planner's structure-deciding forward (``tracing._gradient_receivers``) is for (session 37, issue 51).

Each call below is run "with" that forward (as the planner runs) and "skip" (the forward not run: every trained
parameter assumed reached and no expert routed away, which is what it answers for a model whose loss reaches every
trained parameter), the two interleaved in one process, 3 runs each; CPU seconds (``time.process_time``) and whether
the predictions are equal field by field (the candidate by name). "GR said" is what the forward answered in the
"with" arm: "all" (every trained parameter reached), "N not reached", or "none" (a reentrant checkpoint hides them).

The "skip" arm is the most that reading the receivers from the traced step's own graph could save; where its
predictions differ, that forward is also the first training forward of the model set up, and the step the planner
traces must be a second one (``tests/planner/test_warm_up_forward_s37.py``).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_gradient_receivers.py            # every call
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_gradient_receivers.py llava dict  # those named
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_gradient_receivers.py --share plan  # its share of a call
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "planner"))

from planner_families import HFLM, EncoderLM  # noqa: E402
from planner_set_up_reuse import BATCH, GRID, LLAMA, OFFLOAD  # noqa: E402

from lightning_hbm.activations import ActivationCheckpointing  # noqa: E402
from lightning_hbm.adapters.lora import LoRA  # noqa: E402
from lightning_hbm.data import synthetic_batch  # noqa: E402
from lightning_hbm.planner import Candidate, max_context, plan, predict, tracing  # noqa: E402
from lightning_hbm.planner.routed import Routed  # noqa: E402
from lightning_hbm.precision import QuantizedPrecision  # noqa: E402

ORIGINAL = tracing._gradient_receivers
SAID: list[str] = []


def _recorded(module: Any, batch: Any, plugin: Any) -> Any:
    reached, routed = ORIGINAL(module, batch, plugin)
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    said = "none" if reached is None else "all" if trainable <= reached else f"{len(trainable - reached)} not reached"
    SAID.append(said + (f", {len(routed.ids)} routed away" if routed.ids else ""))
    return reached, routed


def _skipped(module: Any, batch: Any, plugin: Any) -> Any:
    return None, Routed()


def _fields(predictions: list) -> list:
    return [sorted((k, v.name if k == "candidate" else repr(v)) for k, v in vars(p).items()) for p in predictions]


class DictBlock(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, options: Optional[dict[str, Any]] = None) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * (options or {}).get("scale", 1.0)


class BlocksLM(pl.LightningModule):
    """8 checkpointed blocks, each given a dict (which it leaves alone)."""

    def __init__(self, blocks: int = 8, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(DictBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 256)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch[0])
        for block in self.blocks:
            x = block(x, options={"scale": 2.0})
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _calls() -> dict[str, Callable[[], list]]:
    from test_real_architectures_plan import QWEN2_MOE, qwen2_moe_setup
    from test_unlike_blocks_plan import IMAGES, Classifier, TinyLlava, efficientnet_like

    tokens = torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens[:, 1:17] = 255  # (16 / 4) ** 2 image patches
    llava_batch = (tokens, torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    gpt2 = partial(HFLM, "gpt2", n_layer=8, n_embd=64, n_head=4)  # its head tied to the embedding
    nf4 = Candidate("nf4-dq", lora_r=8, checkpointing="full", fused_loss=True)
    return {
        "llama predict nf4-dq+LoRA+AC+FusedLoss": lambda: _fields([predict(LLAMA, BATCH, nf4)]),
        "llama plan, 8 candidates": lambda: _fields(plan(LLAMA, BATCH, candidates=GRID).predictions),
        "llama predict, partial offload (cuda)": lambda: _fields([predict(LLAMA, BATCH, OFFLOAD, device="cuda")]),
        "llama max_context, 2 budgets": lambda: _fields([r.prediction for r in max_context(
            LLAMA, ["64MiB", "1GiB"], plugin=QuantizedPrecision("nf4-dq"), callbacks=[LoRA(r=8), ActivationCheckpointing()],
            device="cuda")]),
        "llama predict int8+LoRA": lambda: _fields([predict(LLAMA, BATCH, Candidate("int8", lora_r=8))]),
        "gpt2 (tied head) predict bf16+LoRA+AC": lambda: _fields([predict(gpt2, BATCH, Candidate("bf16-true", lora_r=8,
                                                                                                  checkpointing="full"))]),
        "qwen2-moe plan nf4-dq+LoRA+AC+FusedLoss": lambda: _fields(plan(
            QWEN2_MOE, synthetic_batch(2, 64, vocab_size=512), plugin=qwen2_moe_setup()[0],
            callbacks=qwen2_moe_setup()[1]).predictions),
        "conv net (EfficientNet-like) predict 32-true AC": lambda: _fields([predict(
            partial(Classifier, efficientnet_like), IMAGES, Candidate("32-true", checkpointing="full"))]),
        "nn.TransformerEncoder predict bf16+LoRA": lambda: _fields([predict(partial(EncoderLM, layers=8), BATCH,
                                                                            Candidate("bf16-true", lora_r=8))]),
        "llava predict 32-true": lambda: _fields([predict(TinyLlava, llava_batch, Candidate("32-true", checkpointing="none"),
                                                          extrapolate=False)]),
        "blocks given a dict predict 32-true AC": lambda: _fields([predict(BlocksLM, BATCH, Candidate("32-true",
                                                                                                      checkpointing="full"))]),
    }


def share(which: list[str]) -> None:
    """CPU seconds of the forward (every call of it) against the whole call, the second of two runs."""
    spent: list[float] = []

    def timed(module: Any, batch: Any, plugin: Any) -> Any:
        start = time.process_time()
        try:
            return ORIGINAL(module, batch, plugin)
        finally:
            spent.append(time.process_time() - start)

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    tracing._gradient_receivers = timed  # type: ignore[assignment]
    for name, call in _calls().items():
        if which and not any(w in name for w in which):
            continue
        call()
        spent.clear()
        start = time.process_time()
        call()
        whole = time.process_time() - start
        print(f"{name}: {len(spent)} forwards, {sum(spent):.2f} s of {whole:.1f} s ({100 * sum(spent) / whole:.0f} %)",
              flush=True)
    tracing._gradient_receivers = ORIGINAL


def main(which: list[str]) -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for name, call in _calls().items():
        if which and not any(w in name for w in which):
            continue
        times: dict[str, list[float]] = {"with": [], "skip": []}
        results, said = {}, []
        for run in range(3):
            for arm in ("with", "skip") if run % 2 == 0 else ("skip", "with"):
                tracing._gradient_receivers = _recorded if arm == "with" else _skipped  # type: ignore[assignment]
                SAID.clear()
                start = time.process_time()
                results[arm] = call()
                times[arm].append(time.process_time() - start)
                said = sorted(set(SAID)) if arm == "with" else said
        tracing._gradient_receivers = ORIGINAL
        differ = sorted({a[0] for pa, pb in zip(results["with"], results["skip"]) for a, b in zip(pa, pb) if a != b})
        print(f"{name}: with {' / '.join(f'{t:.1f}' for t in times['with'])} s, skip "
              f"{' / '.join(f'{t:.1f}' for t in times['skip'])} s, ratio {sum(times['skip']) / sum(times['with']):.3f}; "
              f"GR said {said}; same: {results['with'] == results['skip']}" + (f" (differ: {differ})" if differ else ""),
              flush=True)


if __name__ == "__main__":
    if "--share" in sys.argv:
        share([a for a in sys.argv[1:] if a != "--share"])
    else:
        main(sys.argv[1:])
