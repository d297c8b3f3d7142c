"""Adapters run with gradients off inside a ``torch.autograd.Function`` (issue 53, session 30): made to train.

Was: a clear error naming ``enable_input_require_grads()`` (session 29); the user had to call it. transformers Reformer
runs its layers inside a Function (reversible layers: gradients off in the forward, recomputed in its backward), so
the backward reaches the adapters only when the layers' input requires grad, which the frozen embeddings' output does
not. Now the first training step shows it (adapters ran with gradients off, and the loss had no gradient or the input
embedding's output did not require grad), the input embeddings' output is made to require grad (what transformers'
``enable_input_require_grads()`` does), said once, and the step runs again: the fit equals, to the bit, the fit of a
user who called the fix. Where it cannot apply (no embedding to hook) the error stays.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA
from tests.test_any_model import Recorder


class Reversible(torch.autograd.Function):
    """Reformer's way: the block runs with gradients off; the backward recomputes it with gradients on."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, block: nn.Module) -> torch.Tensor:
        ctx.block = block
        ctx.save_for_backward(x)
        return block(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            torch.autograd.backward(ctx.block(x), grad)
        return x.grad, None


class Model(pl.LightningModule):
    """Tokens (or features, ``embed=False``) through two blocks run inside the Function; ``fix``: the user's hook."""

    def __init__(self, embed: bool = True, fix: bool = False, head: bool = False, flip: bool = False) -> None:
        super().__init__()
        self.flip = flip  # the step changes its batch in place (the second run must see the batch as the first did)
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 32) if embed else None
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.1), nn.Tanh()) for _ in range(2)])
        self.norm = nn.BatchNorm1d(32)  # running statistics: moved once per step, the rerun included
        self.score = nn.Linear(32, 4) if head else None  # a task head trained in full: the loss has a gradient anyway
        if fix and self.embed is not None:
            self.embed.register_forward_hook(lambda m, a, out: out.requires_grad_())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.flip:
            batch[:] = batch.flip(0)
        x = self.embed(batch) if self.embed is not None else batch
        for block in self.blocks:
            x = Reversible.apply(x, block)
        x = self.norm(x.mean(1))
        return (self.score(x) if self.score is not None else x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(module: Model, batches: list[torch.Tensor], steps: int = 3) -> tuple[Recorder, list[str]]:
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=4, target_modules=r"blocks\.\d\.0"), recorder])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(batches, batch_size=None))
    return recorder, [str(w.message) for w in caught]


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("head", [False, True], ids=["loss_without_gradient", "task_head_trained"])
def test_the_first_step_makes_the_embeddings_require_grad_and_trains_as_the_fixed_model(head: bool) -> None:
    batches = [tokens(1), tokens(2), tokens(3)]
    mended, warned = fit(Model(head=head), batches)
    said = [w for w in warned if "ran with gradients off" in w]
    assert len(said) == 1, warned
    assert re.search(r"e\.g\. blocks\.0\.0, blocks\.1\.0\) ran with gradients off .*of Model did not require grad, so no backward could reach "
                     r"them \((the loss had no gradient|they would get no gradient)\)\. lightning_hbm made the output of embed require grad "
                     r".*ran the first step again .*a forward hook on the input embedding", said[0]), said
    fixed, warned = fit(Model(fix=True, head=head), batches)
    assert not [w for w in warned if "ran with gradients off" in w]  # the user's own hook: nothing to do
    assert mended.trained == set(mended.adapters) and len(mended.adapters) == 4  # was: an error, or (head) no gradient
    assert mended.losses == fixed.losses


@pytest.mark.parametrize("flip", [False, True], ids=["batch_as_given", "batch_changed_in_place"])
def test_it_trains_to_the_bit_as_the_fixed_model(flip: bool) -> None:
    mended = Model(flip=flip)  # each built just before its fit: the adapters' initial values draw from the same random state
    fit(mended, [tokens(1), tokens(2)], steps=2)
    fixed = Model(fix=True, flip=flip)
    fit(fixed, [tokens(1), tokens(2)], steps=2)
    want, got = LoRA.adapter_state_dict(fixed), LoRA.adapter_state_dict(mended)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(mended.norm.running_mean, fixed.norm.running_mean, rtol=0, atol=0)  # moved once at the first step


def test_without_an_embedding_to_hook_the_error_stays() -> None:
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=4, target_modules=r"blocks\.\d\.0")])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"does not require grad: the adapters .*blocks\.0\.0.*ran with gradients off .*no input "
                       r"embedding .*Make that input require grad"):  # fmt: skip
        trainer.fit(Model(embed=False), DataLoader([torch.randn(4, 6, 32)], batch_size=None))


def test_a_manual_optimization_step_is_never_run_twice() -> None:
    """Its training_step steps the optimizers itself: a second run would step twice. No wrapper; its loss without
    gradient keeps the error naming the fix."""
    from lightning_hbm.adapters.lora.input_grads import watch_first_step

    manual = Model()
    manual.automatic_optimization = False
    watch_first_step(manual, list, print)
    assert "training_step" not in vars(manual)
    automatic = Model()
    watch_first_step(automatic, list, print)
    assert "training_step" in vars(automatic)


def test_a_fit_that_runs_no_training_step_leaves_no_wrapper() -> None:
    module = Model()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=4, target_modules=r"blocks\.\d\.0")])  # fmt: skip
    trainer.fit(module, DataLoader([tokens(1)], batch_size=None))
    assert "training_step" not in vars(module)  # removed by the first step
    stopped = Model()

    class Stop(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            raise RuntimeError("stopped before the first training step")

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, callbacks=[LoRA(r=4, target_modules=r"blocks\.\d\.0"), Stop()])  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped before"):
        trainer.fit(stopped, DataLoader([tokens(1)], batch_size=None))
    assert "training_step" not in vars(stopped)  # no step ran: removed when the fit stopped
