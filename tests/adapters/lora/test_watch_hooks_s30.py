"""The adapter watch's forward pre-hooks (which adapters and parents ran in the first training step) are removed
whatever ends the watch: the first backward's check, the loss check that raises, a fit that ends or fails before any
backward (session 30 review: the hooks stayed on the model, holding the watch, for the rest of the process)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA


class _Net(pl.LightningModule):
    def __init__(self, detach: bool = False, fail: bool = False) -> None:
        super().__init__()
        self.detach, self.fail = detach, fail
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        for block in self.blocks:
            batch = block(batch)
        if self.fail and self.trainer.state.stage == "train":  # the loop's step, not the surgery's probe
            raise KeyError("the user's bug")
        loss = batch.pow(2).mean()
        return loss.detach() if self.detach else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _hooks(module: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in module.modules())


def _fit(module: _Net, **kwargs: object) -> None:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=2)], **kwargs)  # type: ignore[arg-type]  # fmt: skip
    trainer.fit(module, DataLoader([torch.randn(2, 8)] * 2, batch_size=None))


def test_the_watch_leaves_no_hook_after_a_healthy_fit() -> None:
    module = _Net()
    _fit(module, max_steps=1)
    assert _hooks(module) == 0


@pytest.mark.parametrize("case", ["loss-without-grad", "step-fails", "no-step"])
def test_the_watch_leaves_no_hook_when_the_fit_ends_before_its_check(case: str) -> None:
    module = _Net(detach=case == "loss-without-grad", fail=case == "step-fails")
    if case == "no-step":
        _fit(module, max_steps=1, limit_train_batches=0)
    else:
        with pytest.raises((RuntimeError, KeyError)):
            _fit(module, max_steps=1)
    assert _hooks(module) == 0  # was 6: each adapter's and each parent's hook, holding the watch
