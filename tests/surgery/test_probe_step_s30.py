"""The probe step runs only where something asks for its answer, and says how to turn it off (issue 55, item 3).

The probe step calls the user's ``training_step`` once before the model is changed, to see which layers its code
reads directly: what quantization and LoRA need to know. A run that only checkpoints activations (or swaps kernels,
or the optimizer) under one of Lightning's casting precisions asks nothing of it: there the user's step now runs only
for the loop's steps. Where it runs, the info line at fit start names the switch that turns it off.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, MemoryEfficientOptimizer, QuantizedPrecision
from tests.surgery.test_surgery_rngs_s30 import WIDTH, Block  # the same residual MLP block


class Counting(pl.LightningModule):
    """Counts every call of its training_step (a user's counter, a file with one line per step, a logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.calls = 0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.calls += 1
        x = batch
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit(tmp_path: Path, steps: int, callbacks: list[pl.Callback], **kwargs: Any) -> Counting:
    torch.manual_seed(0)
    module = Counting()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=callbacks, **kwargs,
    )  # fmt: skip
    trainer.fit(module, DataLoader([torch.randn(2, WIDTH) for _ in range(steps)], batch_size=None))
    return module


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "once before changing the model" in r.getMessage()]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_run_that_asks_no_reader_never_calls_the_step_more_than_the_loop(
    precision: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Was: ``ActivationCheckpointing()`` (or any lightning_hbm callback) alone ran the probe step: 3 calls for 2 steps."""
    with caplog.at_level(logging.INFO):
        module = _fit(tmp_path, 2, [ActivationCheckpointing(), MemoryEfficientOptimizer()], precision=precision)
    assert module.calls == 2
    assert _said(caplog) == []


def test_where_the_probe_runs_it_is_said_once_with_the_switch_that_turns_it_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        module = _fit(tmp_path, 2, [LoRA(r=4, alpha=8), ActivationCheckpointing()], plugins=[QuantizedPrecision("nf4-dq", dtype="float32")])
    assert module.calls == 3  # the loop's two and the probe step's one, said:
    said = _said(caplog)
    assert len(said) == 1
    assert "LIGHTNING_HBM_PROBE_STEP=0 skips it" in said[0]
    assert "QuantizedPrecision(ignore_modules=[...]), LoRA(exclude_modules=[...])" in said[0]


def test_lora_alone_under_a_casting_precision_still_probes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """LoRA leaves out the layers whose weight the code reads directly: it asks for the probe's answer."""
    with caplog.at_level(logging.INFO):
        module = _fit(tmp_path, 1, [LoRA(r=4, alpha=8)])
    assert module.calls == 2 and len(_said(caplog)) == 1


def test_which_runs_ask_for_the_probe_step() -> None:
    from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

    from lightning_hbm.surgery import engine

    class Replacing(Precision):  # a plugin of the user's: it may replace layers (its quantized ones get guards)
        pass

    casting = [Precision(), HalfPrecision("bf16-true"), MixedPrecision("bf16-mixed", "cpu")]
    assert not any(engine._asks_readers(plugin, [ActivationCheckpointing()], plugin.convert_module) for plugin in casting)
    assert all(engine._asks_readers(plugin, [LoRA()], plugin.convert_module) for plugin in casting)
    assert engine._asks_readers(Replacing(), [], Replacing().convert_module)
    assert engine._asks_readers(QuantizedPrecision("nf4"), [], None)
    assert not engine._asks_readers(None, [ActivationCheckpointing()], None)
