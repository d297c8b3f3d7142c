"""Session 40, h1 (issue 55, item 3): the probe step's optimizer stand-ins, the last three breaks. Each run trains as it
does without the probe step (``LIGHTNING_HBM_PROBE_STEP=0``): the same global step, losses, optimizer and scheduler
state and RNGs after the fit, and the probe step's own reads answer as the run's do.

Broke on the parent, fixed here:

1. ``isinstance(self.optimizers(), list)`` (and ``len``, ``g, d = self.optimizers()``; the same of
   ``self.lr_schedulers()``) in a step of several optimizers: the stand-in was no list (Lightning gives a list), a
   step normalising ``opts if isinstance(opts, list) else [opts]`` stepped one in the probe step;
2. a GAN mixing optimizer classes (Adam for G, SGD for D): both stand-ins carried the first class's group keys
   (``betas`` on D's, ``momentum`` missing: KeyError, "could not run one step");
3. SAM (sharpness-aware minimisation, a user-written ``Optimizer`` subclass with ``first_step``/``second_step``, as
   davda54's ``sam.py``) from a manual step, as ``opt.first_step(...)`` or ``opt.optimizer.first_step(...)``:
   AttributeError on the stand-in, "could not run one step", the layers it reads left to the source. The stand-in's
   methods of a user's optimizer class do nothing (the user's optimizer code never runs on real parameters).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests.surgery import probe_runs as runs


class _Gan(pl.LightningModule):
    """Two optimizers of two classes (Adam for G, SGD with momentum for D), two schedulers, manual optimization."""

    def __init__(self, reads: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.d = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.automatic_optimization = False
        self.reads, self.seen, self.losses = reads, [], []  # type: ignore[var-annotated]

    def _optimizers(self) -> list[Any]:
        opts, scheds = self.optimizers(), self.lr_schedulers()
        if self.reads == "isinstance":
            self.seen.append((isinstance(opts, list), isinstance(opts, tuple), isinstance(scheds, list), len(opts), len(scheds)))  # type: ignore[arg-type]
            return opts if isinstance(opts, list) else [opts]  # type: ignore[return-value]
        if self.reads == "unpack":
            g, d = opts  # type: ignore[misc]
            self.seen.append((type(g).__name__ == type(d).__name__, g is d))
            return [g, d]
        if self.reads == "raw":
            raw = self.optimizers(use_pl_optimizer=False)
            self.seen.append((isinstance(raw, list), len(raw)))  # type: ignore[arg-type]
            return list(opts)  # type: ignore[arg-type]
        if self.reads == "toggle_model":  # LightningOptimizer's, as Lightning documents several optimizers
            g, d = opts  # type: ignore[misc]
            with g.toggle_model(sync_grad=True):
                self.seen.append(isinstance(g, torch.optim.Adam))
            return [g, d]
        g, d = opts  # type: ignore[misc]  # "keys": each its own class's group keys
        self.seen.append((g.param_groups[0]["betas"], d.param_groups[0]["momentum"], "momentum" in g.param_groups[0], "betas" in d.param_groups[0]))
        return [g, d]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        optimizers = self._optimizers()
        for opt, loss in zip(optimizers, (self.d(self.g(batch)).mean(), self.d(batch).pow(2).mean())):
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            self.losses.append(loss.detach().clone())
        for sch in self.lr_schedulers():  # type: ignore[union-attr]
            sch.step()

    def configure_optimizers(self) -> Any:
        g = torch.optim.Adam(self.g.parameters(), lr=1e-2, betas=(0.5, 0.999))
        d = torch.optim.SGD(self.d.parameters(), lr=1e-2, momentum=0.9)
        return [g, d], [torch.optim.lr_scheduler.StepLR(g, 1, 0.5), torch.optim.lr_scheduler.StepLR(d, 1, 0.5)]


@pytest.mark.parametrize("reads", ["isinstance", "unpack", "raw", "toggle_model"])
def test_several_optimizers_read_as_lightning_gives_them(reads: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Gan(reads), runs.fit_into(trainers, tmp_path))
    assert on.seen[0] == on.seen[1] == off.seen[0] and on.seen[1:] == off.seen  # the probe step's answer is the run's
    assert len(off.losses) == 6 and torch.equal(torch.stack(on.losses[-6:]), torch.stack(off.losses))
    runs.same_optimizers(*trainers)


def test_each_optimizer_carries_its_own_class_group_keys(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Gan("keys"), runs.fit_into(trainers, tmp_path))
    # the probe step reads the values configure_optimizers' source passes as literals (else the class's defaults)
    assert on.seen[0] == off.seen[0] == ((0.5, 0.999), 0.9, False, False)
    assert on.seen[1:] == off.seen and torch.equal(torch.stack(on.losses[-6:]), torch.stack(off.losses))
    runs.same_optimizers(*trainers)


class _Groups(runs.ManualMLP):
    """One AdamW with two param groups of different lr and weight decay, read by index; ``use_pl_optimizer=False``."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers(use_pl_optimizer=self.raw is not True)
        second = opt.param_groups[1]  # type: ignore[union-attr]
        self.seen.append((len(opt.param_groups), second["weight_decay"], second["betas"], isinstance(opt, torch.optim.AdamW), isinstance(opt, list)))  # type: ignore[union-attr]
        self.manual_step(opt, batch)

    def configure_optimizers(self) -> Any:
        if self.raw == "built":  # the groups built over a tuple
            return torch.optim.AdamW([{"params": m.parameters(), "weight_decay": 0.0} for m in (self.body[0], self.body[2])], betas=(0.8, 0.99))
        groups = [{"params": self.body[0].parameters(), "lr": 1e-2}, {"params": self.body[2].parameters(), "lr": 1e-3, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, weight_decay=0.05, betas=(0.8, 0.99))


@pytest.mark.parametrize("raw", [False, True, "built"], ids=["lightning-optimizer", "use_pl_optimizer-False", "comprehension"])
def test_two_param_groups_read_by_index(raw: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Groups(raw), runs.fit_into(trainers, tmp_path))
    assert on.seen[0] == off.seen[0] == (2, 0.0, (0.8, 0.99), True, False) and on.seen[1:] == off.seen
    assert len(off.losses) == 3 and torch.equal(torch.stack(on.losses[-3:]), torch.stack(off.losses))
    runs.same_optimizers(*trainers)


def test_each_stand_in_holds_the_parameters_its_source_names(tmp_path: Any) -> None:
    """G's stand-in holds G's parameters, D's D's (read from ``self.g.parameters()``, nothing run); were every
    trainable parameter of the module in each."""
    from lightning_hbm.probe import quiet_logging

    module = _Gan("unpack")
    with quiet_logging(module):
        g, d = module.optimizers()  # type: ignore[misc]
        assert isinstance(g, torch.optim.Adam) and isinstance(d, torch.optim.SGD) and not isinstance(g, torch.optim.SGD)
        assert g.param_groups[0]["params"] == list(module.g.parameters()) and d.param_groups[0]["params"] == list(module.d.parameters())
        assert g.optimizer is g and g.state_dict()["param_groups"][0]["params"] == [0, 1, 2, 3]


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation, as davda54's ``sam.py`` (MIT): a user-written optimizer wrapping a base one."""

    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, adaptive: bool = False, **kwargs: Any) -> None:
        assert rho >= 0.0, f"Invalid rho, should be non-negative: {rho}"
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is not None, "Sharpness Aware Minimization requires closure, but it was not provided"
        closure = torch.enable_grad()(closure)
        self.first_step(zero_grad=True)
        closure()
        self.second_step()

    def _grad_norm(self) -> torch.Tensor:
        shared_device = self.param_groups[0]["params"][0].device
        return torch.norm(
            torch.stack([
                ((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
                for group in self.param_groups for p in group["params"] if p.grad is not None
            ]),
            p=2,
        )  # fmt: skip


class _Sam(runs.ManualMLP):
    def __init__(self, calls: str) -> None:
        super().__init__()
        self.calls = calls

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt = self.optimizers()
        sam = opt.optimizer if self.calls == "inner" else opt  # type: ignore[union-attr]
        self.seen.append((sorted(k for k in opt.param_groups[0] if k != "params"), isinstance(opt, SAM)))  # type: ignore[union-attr]
        loss = self.body(batch).pow(2).mean()
        self.manual_backward(loss)
        sam.first_step(zero_grad=True)  # type: ignore[union-attr]
        self.manual_backward(self.body(batch).pow(2).mean())
        sam.second_step(zero_grad=True)  # type: ignore[union-attr]
        self.losses.append(loss.detach().clone())

    def configure_optimizers(self) -> Any:
        return SAM([p for p in self.parameters() if p.requires_grad], torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)


@pytest.mark.parametrize("calls", ["wrapper", "inner"])
def test_sam_first_and_second_step_are_probed_and_train_the_same(calls: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Sam(calls), runs.fit_into(trainers, tmp_path))
    assert len(off.losses) == 3 and torch.equal(torch.stack(on.losses[-3:]), torch.stack(off.losses))
    assert on.seen[1:] == off.seen and on.seen[0][1] == off.seen[0][1]  # a SAM, as Lightning's wrapper is one
    assert {"rho", "adaptive", "lr"} <= set(on.seen[0][0])  # SAM's own group keys (the base optimizer's: unknowable unrun)
    runs.same_optimizers(*trainers)


class _SamBase(_Sam):
    """Reads what SAM's ``__init__`` sets (``opt.base_optimizer``): unknowable before the optimizers exist."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen.append(type(self.optimizers().base_optimizer).__name__)  # type: ignore[union-attr]
        super().training_step(batch, batch_idx)


def test_what_the_optimizer_init_sets_falls_back_said_exactly(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", "1")
    module, trainers = _SamBase("wrapper"), []  # type: ignore[var-annotated]
    with pytest.warns(UserWarning, match="could not run one step") as caught:
        runs.fit_into(trainers, tmp_path)(module)
    said = [str(w.message) for w in caught if "could not run one step" in str(w.message)]
    assert len(said) == 1 and "the probe step's stand-in for SAM has no attribute 'base_optimizer'" in said[0], said
    assert "SAM.__init__ sets is not there" in said[0] and [s for s in module.seen if isinstance(s, str)] == ["SGD"] * 3
    assert len(module.losses) == 3 and trainers[0].global_step == 0  # trained (SAM's base step is no LightningOptimizer's)


class _Plain(runs.ManualMLP):
    """One optimizer, no scheduler (``self.lr_schedulers()`` is ``None``), of a class chosen by a branch; another branch
    returns two (the stand-in then reads as one, and unpacks as two)."""

    def __init__(self, choice: str) -> None:
        super().__init__()
        self.choice = choice

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt, sch = self.optimizers(), self.lr_schedulers()
        self.seen.append((sch is None, isinstance(opt, torch.optim.Adam)))
        self.manual_step(opt, batch)

    def configure_optimizers(self) -> Any:
        if self.choice == "pair":  # never taken here: one optimizer on some paths, two on others
            return [torch.optim.SGD(self.body[0].parameters(), lr=1e-2), torch.optim.SGD(self.body[2].parameters(), lr=1e-2)], []
        if self.choice == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2)
        return torch.optim.SGD(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("choice", ["adam", "sgd"])
def test_no_scheduler_is_none_and_a_branch_chosen_class_is_not_guessed(choice: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    trainers: list[pl.Trainer] = []
    off, on = runs.both(monkeypatch, lambda: _Plain(choice), runs.fit_into(trainers, tmp_path))
    assert off.seen[0] == (True, choice == "adam") and on.seen[1:] == off.seen
    assert on.seen[0] == (True, False)  # the class a branch picks is not read unrun: of neither (never the wrong one)
    assert torch.equal(torch.stack(on.losses[-3:]), torch.stack(off.losses))
    runs.same_optimizers(*trainers)
