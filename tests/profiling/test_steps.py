"""``StepMemory``, the domain object under ``HBMProfiler``: a step measured without a Trainer (issue 54)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from lightning_hbm.profiling.steps import COLUMNS, StepMemory


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _step(steps: StepMemory, model: _Tiny, optimizer: torch.optim.Optimizer, step: int, detailed: bool) -> dict:
    batch = torch.randn(32, 64)
    steps.start(step, 0, model, [optimizer], batch, detailed=detailed)
    loss = model.net(batch).square().mean()
    steps.at_forward_end(model, [optimizer])
    steps.enter_phase("backward")
    loss.backward()
    steps.enter_phase("optimizer")
    optimizer.step()
    optimizer.zero_grad()
    row = steps.finish(model, [optimizer])
    assert row is not None
    steps.append(row)
    return row


@pytest.mark.parametrize("detailed", [False, True])
def test_a_step_measured_without_a_trainer(detailed: bool) -> None:
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    steps = StepMemory(max_rows=10)
    _step(steps, model, optimizer, 0, detailed=False)  # the optimizer states exist from here on
    row = _step(steps, model, optimizer, 1, detailed=detailed)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert set(COLUMNS) <= set(row) and row["mode"] == ("detailed" if detailed else "light")
    assert row["parameters"] == weights and row["optimizer_states"] == 2 * weights + 4 * len(list(model.parameters()))
    if detailed:  # the step's tracked peak (here AdamW's temporaries, in ``other``), every term at that moment
        assert row["tracked_peak"] == row["total"] > row["parameters"] + row["optimizer_states"]
    else:
        assert row["activations"] >= 32 * 256 * 4  # the hidden layer, at least, at the forward's end
    assert (row["tracked_peak"] is not None) == detailed and (1 in steps.modules) == detailed
    assert not _get_current_dispatch_mode_stack()  # the tracker's dispatch mode was left
    assert steps.finish(model, [optimizer]) is None  # no step is being measured
    steps.reset()
    assert steps.rows == [] and steps.modules == {} and steps.figure is None


def test_a_step_that_ran_out_after_its_forward_is_kept_as_an_oom_row() -> None:
    model = _Tiny()
    optimizer = torch.optim.SGD(model.parameters())
    steps = StepMemory(max_rows=10)
    steps.start(0, 3, model, [optimizer], torch.randn(4, 64), detailed=True)
    model.net(torch.randn(4, 64)).sum()
    steps.at_forward_end(model, [optimizer])
    steps.abandon()
    assert not _get_current_dispatch_mode_stack()
    steps.keep_failed_step(model, [optimizer])
    assert [(r["mode"], r["batch_idx"]) for r in steps.rows] == [("oom", 3)]
    steps.keep_failed_step(model, [optimizer])  # kept once
    assert len(steps.rows) == 1
