"""What the probe-step tests share (``test_probe_standins_s38.py``, ``test_probe_attack_s39.py``,
``test_probe_standins_s40.py``): a quiet CPU Trainer with nf4 + LoRA, the "could not run one step" warnings of a run,
a run with the probe step off then on, the check that both runs left the same optimizers, and a small MLP module of
manual optimization. One body each, so that a fix to one (a Trainer flag, a warning's wording) reaches every test."""

from __future__ import annotations

import random
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers


def trainer(tmp_path: Any, hbm: bool = True, **kwargs: Any) -> pl.Trainer:
    """A quiet one-epoch CPU Trainer under ``tmp_path``; with ``hbm``, nf4 and LoRA r=4 (the probe step runs)."""
    extra: dict[str, Any] = {"plugins": [QuantizedPrecision("nf4")], "callbacks": [LoRA(r=4)]} if hbm else {}
    return pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **extra, **kwargs,
    )  # fmt: skip


def unprobed(run: Callable[[], Any]) -> list[str]:
    """The "could not run one step" warnings of ``run()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "could not run one step" in str(w.message)]


def _rngs() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def both(monkeypatch: pytest.MonkeyPatch, make: Any, fit: Any) -> tuple[Any, Any]:
    """The modules of a run with the probe step off, then on (``LIGHTNING_HBM_PROBE_STEP``), each seeded alike; the
    on-run must not warn, must be observed, and must leave Python's, numpy's and torch's RNGs as the off-run does."""
    runs = []
    for probe in ("0", "1"):
        monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", probe)
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        module = make()
        failed = unprobed(lambda module=module: fit(module))
        assert not failed, failed
        runs.append((module, _rngs()))
    (off, rngs_off), (on, rngs_on) = runs
    assert readers.observation(on) is not None and rngs_on == rngs_off
    return off, on


def fit_into(trainers: list[pl.Trainer], tmp_path: Any) -> Callable[[pl.LightningModule], None]:
    """A ``fit(module)`` for :func:`both`: three batches of 4 x 16, its Trainer appended to ``trainers``."""

    def fit(module: pl.LightningModule) -> None:
        trainers.append(trainer(tmp_path))
        trainers[-1].fit(module, DataLoader(torch.randn(12, 16), batch_size=4))

    return fit


def same_optimizers(t_off: pl.Trainer, t_on: pl.Trainer) -> None:
    """Both runs took the same steps and left equal optimizers (class, groups, every state tensor) and schedulers."""
    assert t_on.global_step == t_off.global_step
    for off, on in zip(t_off.optimizers, t_on.optimizers, strict=True):
        assert type(on) is type(off)
        state_off, state_on = off.state_dict(), on.state_dict()
        assert state_on["param_groups"] == state_off["param_groups"]
        assert state_on["state"].keys() == state_off["state"].keys()
        for key, value in state_off["state"].items():
            for name, tensor in value.items():
                assert torch.equal(torch.as_tensor(state_on["state"][key][name]), torch.as_tensor(tensor)), (key, name)
    for off, on in zip(t_off.lr_scheduler_configs, t_on.lr_scheduler_configs, strict=True):
        assert on.scheduler.state_dict() == off.scheduler.state_dict()


class ManualMLP(pl.LightningModule):
    """A seeded 16 -> 32 -> 4 MLP of manual optimization; ``seen`` for what a step reads, ``losses`` for its losses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.automatic_optimization = False
        self.seen: list[Any] = []
        self.losses: list[torch.Tensor] = []

    def manual_step(self, opt: Any, batch: torch.Tensor) -> None:
        """One plain step of ``opt`` on the squared output; its loss appended to ``losses``."""
        loss = self.body(batch).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.losses.append(loss.detach().clone())
