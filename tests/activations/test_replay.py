"""A checkpointed block's recompute starts from the buffers its forward started from (``lightning_hbm.activations.replay``).

Was: the recompute updated a BatchNorm's running statistics a second time (momentum applied twice per step,
``num_batches_tracked`` counting each batch twice), so a checkpointed Conv-BN net's eval-mode model was not the one
trained without checkpointing. The spectral_norm case: ``tests/adapters/lora/test_merge_parametrized.py``.
"""

from __future__ import annotations

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
