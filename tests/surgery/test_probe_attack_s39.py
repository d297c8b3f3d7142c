"""Session 39, h5 (issue 55, item 3): the probe step attacked again. Each run trains as it does without the probe step
(``LIGHTNING_HBM_PROBE_STEP=0``): the same global step, losses, optimizer state, lr and RNGs after the fit.

Broke on the parent, fixed here:

1. a manual step reading ``opt.optimizer.state_dict()``, ``opt.state[p].get(...)``, ``opt.param_groups[0]["momentum"]``
   or its scheduler's ``optimizer``, ``last_epoch``, ``state_dict()`` on the probe's stand-ins (AttributeError,
   KeyError: "could not run one step", the layers it reads left to the source);
2. ``training_step(self, batch)`` (no ``batch_idx``, as Lightning allows) stopped the fit under LoRA: LoRA's
   first-step wrapper took ``*args``, so Lightning passed it ``batch_idx``, handed on to the user's step (TypeError);
   ``validation_step(self, batch)`` / ``predict_step(self, batch)`` were probed with a ``batch_idx`` (TypeError);
3. ``configure_optimizers`` returning a helper's ``self._build()``, or a list of ``{"optimizer", "lr_scheduler"}`` dicts:
   their two optimizers / schedulers counted one, a step looping over them saw one.

Held (here so that they keep holding): several validation loaders as a dict during fit (``dataloader_idx``), with
``limit_val_batches=0`` and ``num_sanity_val_steps=0``, and ``trainer.validate`` with ``limit_val_batches=0``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm.layers import readers
from tests.surgery import probe_runs as runs


class _Manual(runs.ManualMLP):
    def __init__(self, reads: str) -> None:
        super().__init__()
        self.reads = reads

    def _read(self, opt: Any, sch: Any) -> Any:
        first = next(p for p in self.parameters() if p.requires_grad)  # LoRA: the base weight is frozen
        return {
            "state_dict": lambda: len(opt.optimizer.state_dict()["state"]),
            "state": lambda: opt.state[first].get("momentum_buffer") is None,
            "momentum": lambda: opt.param_groups[0]["momentum"],
            "scheduler_optimizer": lambda: sch.optimizer.param_groups[0]["lr"],
            "scheduler_state": lambda: sch.state_dict()["last_epoch"] + sch.last_epoch,
        }[self.reads]()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt, sch = self.optimizers(), self.lr_schedulers()
        self.seen.append(self._read(opt, sch))
        self.manual_step(opt, batch)
        sch.step()  # type: ignore[union-attr]

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]


@pytest.mark.parametrize("reads", ["state_dict", "state", "momentum", "scheduler_optimizer", "scheduler_state"])
def test_a_manual_step_reading_the_optimizer_and_scheduler_is_probed_and_trains_the_same(
    reads: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Manual(reads), runs.fit_into(trainers, tmp_path))
    assert len(on.seen) == len(off.seen) + 1 and on.seen[1:] == off.seen  # the probe step's read first, then the run's
    assert torch.equal(torch.stack(on.losses), torch.stack(off.losses))
    assert trainers[0].global_step == 3
    runs.same_optimizers(*trainers)  # the lr the scheduler set, the momentum and its buffers, the scheduler's state


class _NoBatchIdx(pl.LightningModule):
    """Steps declared without ``batch_idx``, as Lightning allows (it inspects the signature)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.body(batch).pow(2).mean()
        self.seen.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: torch.Tensor) -> None:
        self.seen.append(self.body(batch).sum().detach().clone())

    def predict_step(self, batch: torch.Tensor) -> torch.Tensor:
        out = self.body(batch)
        self.seen.append(out.sum().detach().clone())
        return out

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("stage", ["fit", "validate", "predict"])
def test_a_step_without_batch_idx_is_called_as_lightning_calls_it(stage: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []

    def run(module: _NoBatchIdx) -> None:
        trainer = runs.trainer(tmp_path)
        getattr(trainer, stage)(module, DataLoader(torch.randn(12, 16), batch_size=4), **({"verbose": False} if stage == "validate" else {}))
        steps.append(trainer.global_step)

    off, on = runs.both(monkeypatch, _NoBatchIdx, run)
    assert len(off.seen) == 3 and steps[0] == steps[1]
    # the probe step's own call(s) first (a fake-tensor run appends a fake value), then the run's, as without it
    assert torch.equal(torch.stack(on.seen[-3:]), torch.stack(off.seen))


class _Gan(pl.LightningModule):
    def __init__(self, returns: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.d = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.automatic_optimization = False
        self.returns, self.losses = returns, []  # type: ignore[var-annotated]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizers, schedulers = list(self.optimizers()), [s for s in self.lr_schedulers()]  # type: ignore[union-attr]
        assert len(optimizers) == 2 and len(schedulers) == 2, (len(optimizers), len(schedulers))
        for opt, loss in zip(optimizers, (self.d(self.g(batch)).mean(), self.d(batch).pow(2).mean())):
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.losses.append(loss.detach().clone())
        for sch in schedulers:
            sch.step()

    def _build(self) -> Any:
        g, d = torch.optim.Adam(self.g.parameters(), lr=1e-2), torch.optim.SGD(self.d.parameters(), lr=1e-2)
        return [g, d], [torch.optim.lr_scheduler.StepLR(g, 1), torch.optim.lr_scheduler.StepLR(d, 1)]

    def configure_optimizers(self) -> Any:
        if self.returns == "helper":
            return self._build()
        g, d = torch.optim.Adam(self.g.parameters(), lr=1e-2), torch.optim.SGD(self.d.parameters(), lr=1e-2)
        return [
            {"optimizer": g, "lr_scheduler": torch.optim.lr_scheduler.StepLR(g, 1)},
            {"optimizer": d, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(d, 1), "interval": "step"}},
        ]


@pytest.mark.parametrize("returns", ["helper", "dicts"])
def test_a_step_looping_over_several_optimizers_sees_them_all(returns: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[int] = []

    def fit(module: _Gan) -> None:
        trainer = runs.trainer(tmp_path)
        trainer.fit(module, DataLoader(torch.randn(12, 16), batch_size=4))
        steps.append(trainer.global_step)

    off, on = runs.both(monkeypatch, lambda: _Gan(returns), fit)
    assert steps == [6, 6] and torch.equal(torch.stack(on.losses[-6:]), torch.stack(off.losses))


class _Validated(_NoBatchIdx):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch)

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.seen.append(self.body(batch).sum().detach().clone() + 1000 * dataloader_idx)


@pytest.mark.parametrize(
    "stage,kwargs",
    [("fit", {}), ("fit", {"limit_val_batches": 0}), ("fit", {"num_sanity_val_steps": 0}), ("validate", {"limit_val_batches": 0})],
    ids=["fit-dict-val", "fit-limit-val-0", "fit-no-sanity", "validate-limit-0"],
)
def test_held_several_val_loaders_and_no_validation(stage: str, kwargs: dict[str, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    val = {"a": DataLoader(torch.randn(4, 16), batch_size=4), "b": DataLoader(torch.randn(4, 16) + 1, batch_size=4)}
    steps: list[int] = []

    def run(module: _Validated) -> None:
        trainer = runs.trainer(tmp_path, **kwargs)
        if stage == "fit":
            trainer.fit(module, DataLoader(torch.randn(12, 16), batch_size=4), val)
        else:
            trainer.validate(module, val, verbose=False)
        steps.append(trainer.global_step)

    if stage == "validate":  # it reads no batch: nothing to probe, nothing run
        monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", "1")
        module = _Validated()
        assert not runs.unprobed(lambda: run(module)) and module.seen == [] and readers.observation(module) is None
        return
    off, on = runs.both(monkeypatch, _Validated, run)
    assert steps[0] == steps[1] == 3 and torch.equal(torch.stack(on.seen[-len(off.seen):]), torch.stack(off.seen))


def test_the_stand_in_step_runs_no_global_optimizer_hook(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in is no ``torch.optim.Optimizer``: its ``step`` would run the user's global step hooks (a probe step
    counted as an optimizer step); its ``state_dict()`` has torch's layout."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    stepped: list[str] = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: stepped.append(type(opt).__name__))
    try:
        runs.both(monkeypatch, lambda: _Manual("state_dict"), lambda module: runs.trainer(tmp_path).fit(module, DataLoader(torch.randn(12, 16), batch_size=4)))
    finally:
        handle.remove()
    assert stepped == ["SGD"] * 6  # three steps a run, none of the probe's
