"""``MemoryProfile``, the domain object under ``HBMProfiler``: a run profiled without a Trainer (issue 54), and the
callback left a thin adapter over it."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm.profiling import HBMProfiler, MemoryProfile
from lightning_hbm.profiling.memory_profile import FIRST_STEPS


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))


def _run(profile: MemoryProfile, steps: int) -> list[dict[str, float] | None]:
    """A training loop of one's own, told to the profile as the docstring's example does."""
    torch.manual_seed(0)
    model = _Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    logged = []
    for step in range(steps):
        batch = torch.randn(8, 32)
        profile.start_step(step, step, model, [optimizer], batch)
        loss = model.net(batch).square().mean()
        profile.forward_ended("backward", model, [optimizer])
        loss.backward()
        profile.enter_phase("optimizer")
        optimizer.step()
        optimizer.zero_grad()
        logged.append(profile.end_step(model, [optimizer]))
    return logged


def test_a_run_profiled_without_a_trainer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    profile = MemoryProfile(every_n_steps=4, detailed_steps=[6])
    logged = _run(profile, 10)
    # the first five, the cadence (8), the detailed step (6); the others cost nothing and log nothing
    measured = [0, 1, 2, 3, 4, 6, 8]
    assert FIRST_STEPS == 5 and [r["step"] for r in profile.rows] == measured
    assert [step for step, metrics in enumerate(logged) if metrics is not None] == measured
    assert [r["mode"] for r in profile.rows] == ["light"] * 5 + ["detailed", "light"] and list(profile.modules) == [6]
    metrics = logged[6]
    assert metrics is not None and metrics["hbm/tracked_peak"] == profile.rows[5]["tracked_peak"] / 2**20
    assert {f"hbm/{k}" for k in ("parameters", "gradients", "optimizer_states", "activations", "other", "total")} <= set(metrics)
    assert logged[0] is not None and "hbm/tracked_peak" not in logged[0]  # a light step
    profile.finish(str(tmp_path))  # the report, its picture's data, the summary table
    written = json.loads((tmp_path / "hbm_profile.json").read_text())
    assert [r["step"] for r in written["rows"]] == measured and (tmp_path / "hbm_profile.csv").exists()
    assert (tmp_path / "hbm_figure.json").exists() and profile.figure_data() is not None
    assert "HBMProfiler (MiB): 7 steps measured" in capsys.readouterr().out
    profile.new_run()
    assert profile.rows == [] and profile.figure is None and "No step was measured" in profile.diagnosis()


def test_the_profiler_is_a_thin_adapter_over_its_profile() -> None:
    """HBMProfiler had 29 methods (session 34); what it measures and writes is its profile's, reached as before."""
    (cls,) = ast.parse(inspect.getsource(HBMProfiler)).body
    assert isinstance(cls, ast.ClassDef)
    methods = [node for node in cls.body if isinstance(node, ast.FunctionDef)]
    assert len(methods) <= 10, [m.name for m in methods]
    assert all((m.end_lineno or 0) - m.lineno < 20 for m in methods), [m.name for m in methods]
    profiler = HBMProfiler(every_n_steps=3, detailed_steps=[2], max_rows=7)
    assert profiler.rows is profiler.profile.rows and profiler.detailed_steps == {2} and profiler.max_rows == 7
    profiler.used = {"transforms": ["LoRA"]}  # written where it is read: the profile's report advises from it
    assert profiler.profile.used == {"transforms": ["LoRA"]} and profiler.report().used == profiler.used
    assert profiler.every_n_steps == 3 and profiler.profile.every_n_steps == 3
