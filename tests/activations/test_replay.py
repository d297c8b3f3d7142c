"""A checkpointed block's recompute starts from the buffers its forward started from (``lightning_hbm.activations.replay``).

Was: the recompute updated a BatchNorm's running statistics a second time (momentum applied twice per step,
``num_batches_tracked`` counting each batch twice), so a checkpointed Conv-BN net's eval-mode model was not the one
trained without checkpointing. The spectral_norm case: ``tests/adapters/lora/test_merge_parametrized.py``.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class ConvBN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        for block in self.blocks:
            batch = block(batch)
        return batch.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(checkpointing: bool, policy: str) -> ConvBN:
    module = ConvBN()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["conv"], modules_to_save=[]), *([ActivationCheckpointing(policy=policy)] if checkpointing else [])],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(4, 8, 4, 4, generator=generator) for _ in range(4)], batch_size=None))
    return module


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_checkpointed_batchnorm_updates_its_statistics_once_per_step(policy: str) -> None:
    plain, checkpointed = _fit(False, policy), _fit(True, policy)
    buffers = dict(checkpointed.named_buffers())
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0, msg=name)
    want, got = LoRA.adapter_state_dict(plain), LoRA.adapter_state_dict(checkpointed)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_the_surgery_leaves_batchnorm_statistics_as_they_were() -> None:
    """Was: the probe step (``layers.readers.observe``, on fake tensors) counted one batch in ``num_batches_tracked``."""
    module = ConvBN()
    before = {name: buffer.clone() for name, buffer in module.named_buffers()}
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["conv"], modules_to_save=[]), ActivationCheckpointing()],
    )  # fmt: skip
    trainer.fit(module, DataLoader([torch.randn(4, 8, 4, 4)], batch_size=None))
    for name, buffer in module.named_buffers():
        torch.testing.assert_close(buffer, before[name], rtol=0, atol=0, msg=name)


class Stack(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module] = lambda: nn.BatchNorm2d(8)) -> None:
        super().__init__()
        torch.manual_seed(0)
        # a layer after the norm saves a tensor for backward: the recompute does not stop before the norm's update
        self.blocks = nn.ModuleList([nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), norm(), nn.SiLU()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _spectral_norm(model: nn.Module) -> None:
    torch.manual_seed(2)  # its power iteration's first u, v
    nn.utils.parametrizations.spectral_norm(model.blocks[1][0])  # type: ignore[index]


def _train(change: Callable[[nn.Module], object], checkpointed: bool, model: Optional[nn.Module] = None) -> nn.Module:
    model = model or Stack()
    if checkpointed:
        ActivationCheckpointing().transform_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:
            change(model)
        x = torch.randn(4, 8, 4, 4, generator=generator).to(next(model.parameters()).dtype)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return model


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.double(), id="buffers-replaced-by-a-conversion"),
        pytest.param(lambda m: m.blocks[0].insert(1, nn.BatchNorm2d(8)), id="batchnorm-inserted"),
        pytest.param(lambda m: m.blocks[1].append(nn.BatchNorm2d(8)), id="batchnorm-appended"),
        pytest.param(_spectral_norm, id="spectral-norm-registered"),
    ],
)
def test_a_block_changed_after_its_first_forward_still_replays_its_own_buffers(change: Callable[[nn.Module], object]) -> None:
    """The buffers to replay are looked up at each forward (``ForwardState``): after the first step a conversion
    replaces every buffer, ``Sequential.insert`` adds a BatchNorm without calling torch's module registration hooks
    (so a list kept from an earlier forward and dropped on those hooks would miss it), ``append`` and spectral_norm
    through them. The checkpointed run stays the plain one, bit for bit."""
    plain, checkpointed = _train(change, False), _train(change, True)
    got = dict(checkpointed.state_dict())
    assert list(got) == list(plain.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


class Renorm(nn.BatchNorm2d):
    """A BatchNorm subclass whose training output reads its running statistics, as Batch Renormalization's
    corrections do: its recompute must start from the forward's statistics, not only leave them as they were."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = self.running_mean.view(1, -1, 1, 1).clone()
        return super().forward(x) + shift


@pytest.mark.parametrize(
    "norm",
    [
        pytest.param(lambda: nn.InstanceNorm2d(8, affine=True, track_running_stats=True), id="instance-norm"),
        pytest.param(lambda: Renorm(8), id="batchnorm-subclass-reading-its-statistics"),
        pytest.param(lambda: nn.SyncBatchNorm(8), id="sync-batchnorm"),
    ],
)
def test_norms_with_running_statistics_replay_bit_for_bit(norm: Callable[[], nn.Module]) -> None:
    """Was: an InstanceNorm tracking its statistics was not replayed (only BatchNorm was looked for): its recompute
    updated them a second time. A subclass of torch's BatchNorm is replayed from its forward's statistics."""
    plain, checkpointed = _train(lambda m: None, False, Stack(norm)), _train(lambda m: None, True, Stack(norm))
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(checkpointed.state_dict()[name], value, rtol=0, atol=0, msg=name)


class _RunningNorm(nn.Module):
    """A norm from another library (or the user's): running statistics in buffers it updates in its training forward,
    in place (``replace``: assigned anew, which cannot be replayed)."""

    def __init__(self, width: int, replace: bool = False) -> None:
        super().__init__()
        self.replace = replace
        self.register_buffer("running_mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.replace:
            self.steps = self.steps + 1
        elif self.training:
            self.running_mean.mul_(0.9).add_(0.1 * x.detach().mean((0, 1)))
            self.steps.add_(1)
        return x - self.running_mean


class _UserBlock(nn.Module):
    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), _RunningNorm(8, replace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.lin(x)) * self.norm.running_mean.sum()  # the statistics also reach the loss


def _user_run(checkpointing: bool, replace: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(_UserBlock(replace), _UserBlock(replace))
    if checkpointing:
        callback = ActivationCheckpointing(blocks=["_UserBlock"])
        callback.check_model(model)
        callback.transform_model(model)
    for step in range(3):
        model(torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
    return model


def test_buffers_a_foreign_norm_writes_in_its_forward_are_replayed_found_by_running() -> None:
    # Only torch's norms and parametrizations were replayed: a norm keeping running statistics in its own buffers had
    # them updated twice per step under checkpointing (steps 6 instead of 3) and its recompute read the updated
    # statistics (the Linear's gradient 8.6 away from the run without checkpointing).
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # in place: replayed, nothing to warn about
        checkpointed = _user_run(True)
    plain = _user_run(False)
    for a, b in zip(plain.modules(), checkpointed.modules()):
        if isinstance(a, _RunningNorm):
            assert int(b.steps) == int(a.steps) == 3
            assert torch.equal(b.running_mean, a.running_mean)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad), name


def test_a_buffer_the_forward_replaces_is_warned_about_by_name() -> None:
    with pytest.warns(UserWarning, match=r"_UserBlock's training forward replaces its buffer\(s\) norm\.steps.*in place.*blocks="):
        _user_run(True, replace=True)
