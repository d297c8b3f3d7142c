"""Session 38, h8 (issue 55, item 3): three healthy steps the probe step could not run (the fit ran, warned "could not
run one step", the layers they read left to the source):

1. a step reading ``self.trainer.optimizers[0]`` (empty before the model is changed: IndexError); the probe now lends
   the stand-ins there, and puts Lightning's own list back after;
2. a step reading ``opt.param_groups[0]["lr"]`` or ``opt.optimizer`` on the stand-in ``self.optimizers()`` gives
   (AttributeError); the stand-in has one group of the module's trainable parameters, lr 0.0, and is its own optimizer;
3. ``trainer.validate`` over several loaders: Lightning calls ``validation_step(batch, batch_idx, dataloader_idx)``;
   the probe called it without ``dataloader_idx`` (TypeError)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm.layers import readers
from lightning_hbm.probe import quiet_logging
from tests.surgery import probe_runs as runs


class _Net(runs.ManualMLP):
    def __init__(self, manual: bool, reads: str = "trainer") -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.reads, self.calls, self.lrs, self.indices = reads, 0, [], []  # type: ignore[var-annotated]

    def _lr(self) -> float:
        if self.reads == "trainer":
            return float(self.trainer.optimizers[0].param_groups[0]["lr"])
        opt = self.optimizers()
        inner = opt.optimizer  # type: ignore[union-attr]  # LightningOptimizer's wrapped optimizer
        return float(opt.param_groups[0]["lr"]) + 0.0 * len(inner.param_groups)  # type: ignore[union-attr]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> Any:
        self.calls += 1
        self.lrs.append(self._lr())
        if self.automatic_optimization:
            return self.body(batch).pow(2).mean()
        self.manual_step(self.trainer.optimizers[0] if self.reads == "trainer" else self.optimizers(), batch)
        return None

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int) -> None:
        self.calls += 1
        self.indices.append(dataloader_idx)
        self.body(batch)

    def predict_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int) -> torch.Tensor:
        self.calls += 1
        self.indices.append(dataloader_idx)
        return self.body(batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


@pytest.mark.parametrize(
    "manual,reads", [(True, "trainer"), (False, "trainer"), (True, "stand-in")], ids=["manual-trainer", "auto-trainer", "manual-param-groups"]
)
def test_a_step_reading_the_optimizers_is_probed_once_and_trains(manual: bool, reads: str, tmp_path: Any) -> None:
    data = DataLoader(torch.randn(8, 16), batch_size=4)
    plain, plain_trainer = _Net(manual, reads), runs.trainer(tmp_path, False)
    assert not runs.unprobed(lambda: plain_trainer.fit(plain, data))
    module = _Net(manual, reads)
    trainer = runs.trainer(tmp_path, True)
    failed = runs.unprobed(lambda: trainer.fit(module, data))
    assert not failed, failed
    assert module.calls == plain.calls + 1  # the two steps, and the probe step once
    assert module.lrs == [0.0, 0.1, 0.1] and plain.lrs == [0.1, 0.1]  # the stand-in's lr 0.0 in the probe step only
    seen = readers.observation(module)
    assert seen is not None and seen.ran.startswith("_Net.training_step")
    assert trainer.global_step == plain_trainer.global_step and isinstance(trainer.optimizers[0], torch.optim.SGD)


def test_the_lent_optimizers_are_put_back(tmp_path: Any) -> None:
    module = _Net(True)
    trainer = runs.trainer(tmp_path, False)
    trainer.strategy.connect(module)
    mine = trainer.strategy._optimizers
    module._trainer = trainer
    with quiet_logging(module):
        lent = trainer.optimizers
        assert len(lent) == 1 and lent[0].param_groups[0]["lr"] == 0.0
        assert lent[0].param_groups[0]["params"] == list(module.parameters()) and lent[0].optimizer is lent[0]
        assert module.optimizers().optimizer.param_groups[0]["lr"] == 0.0  # type: ignore[union-attr]
        assert module.lr_schedulers() is None  # configure_optimizers returns no scheduler: None, as Lightning (s40 h1)
    assert trainer.strategy._optimizers is mine and mine == []
    with pytest.raises(ValueError, match="the step failed"), quiet_logging(module):
        assert len(trainer.optimizers) == 1
        raise ValueError("the step failed")
    assert trainer.strategy._optimizers is mine and mine == []  # put back when the step fails too
    assert "optimizers" not in vars(module) and module.lr_schedulers is not None


@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_several_loaders_pass_the_dataloader_idx(stage: str, tmp_path: Any) -> None:
    loaders = [DataLoader(torch.randn(4, 16), batch_size=4), DataLoader(torch.randn(4, 16), batch_size=4)]
    kwargs: dict[str, Any] = {"verbose": False} if stage == "validate" else {}
    plain = _Net(False)
    assert not runs.unprobed(lambda: getattr(runs.trainer(tmp_path, False), stage)(plain, loaders, **kwargs))
    module = _Net(False)
    failed = runs.unprobed(lambda: getattr(runs.trainer(tmp_path, True), stage)(module, loaders, **kwargs))
    assert not failed, failed
    assert plain.indices == [0, 1] and module.indices == [0, 0, 1]  # the probe step: the first loader's, as Lightning
    seen = readers.observation(module)
    assert seen is not None and seen.ran.startswith(f"_Net.{'validation' if stage == 'validate' else 'predict'}_step")
