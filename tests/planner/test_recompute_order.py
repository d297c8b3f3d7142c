"""The planner traces, and its MemTracker reference measures, the step a Trainer runs from its second step on: under
full recompute with LoRA, each block's recompute ends before the base matmul of its last adapted layer
(``ActivationCheckpointing.adapter_first``, decided on the first step; ``lightning_hbm.adapters.lora.order``).

Until session 32 the planner's model and the reference's never had that first step's decision: their recompute ran
peft's order, one 4-bit base matmul more per block than the run (issue 51). The peak was the same to the byte in every
configuration measured (the base output it dropped is smaller than what the block's backward holds after it), so the
test compares the calls themselves: the base layers each step runs, in order, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import Candidate, predict, reference, tracing

CANDIDATE = Candidate("nf4-dq", dtype="float32", lora_r=4, checkpointing="full")
LAST = [f"model.model.layers.{i}.mlp.down_proj.base_layer" for i in range(2)]


@contextmanager
def _base_calls(module: nn.Module, calls: list[str]) -> Iterator[None]:
    """Append to ``calls`` the name of each LoRA base layer ``module`` runs (its forward, and any recompute)."""
    handles = [m.register_forward_hook(lambda *_, name=name: calls.append(name))
               for name, m in module.named_modules() if name.endswith(".base_layer")]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class _SecondStepCalls(pl.Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self._watch: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self._watch = _base_calls(pl_module, self.calls)
            self._watch.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None


def test_the_planned_and_the_measured_step_recompute_as_a_trainers_second_step(
    llama_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch,
) -> None:
    batch = tuple(t.contiguous() for t in synthetic_batch(2, 32))
    run = _SecondStepCalls()
    trainer = trainer_factory(max_steps=2, plugins=[CANDIDATE.precision_plugin()], callbacks=[*CANDIDATE.callbacks(), run])
    samples = [tuple(t[i] for t in batch) for i in range(2)] * 2
    trainer.fit(llama_factory(), torch.utils.data.DataLoader(samples, batch_size=2))
    # 7 base layers per block forward, 7 - 1 in each recompute: it stops before the last down_proj's base matmul
    assert len(run.calls) == 2 * 7 + 2 * 6 and run.calls.count(LAST[1]) == 1, run.calls

    planned: list[str] = []
    steady_step = tracing._steady_step

    def traced(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _base_calls(module, planned):
            return steady_step(module, *args, **kwargs)

    monkeypatch.setattr(tracing, "_steady_step", traced)
    planned_peak = predict(llama_factory, batch, CANDIDATE).peak
    assert planned == run.calls  # was: the recompute of each block ran its last down_proj's base too (28 calls)

    measured: list[str] = []
    step, steps = reference._step, iter(range(2))

    def stepped(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        watch = _base_calls(module, measured) if next(steps) == 1 else _base_calls(nn.Module(), [])
        with watch:
            step(module, *args, **kwargs)

    monkeypatch.setattr(reference, "_step", stepped)
    peak = reference.memtracker_peak(llama_factory, batch, CANDIDATE)
    assert measured == run.calls
    assert planned_peak == peak  # the same bytes: what the recompute dropped was not the peak

