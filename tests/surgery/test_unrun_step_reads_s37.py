"""Session 37, h4: a ``training_step`` that reads a layer's weight only on a path the probe step does not take.

The probe step runs the model as built (float32); the fit computes in bfloat16. A step reading ``self.head.weight``
only under bfloat16 got the packed 4-bit weight, and the nf4 fit stopped at its first step on "mat1 and mat2 shapes
cannot be multiplied (64x64 and 1x2048)": no layer named, no fix. The guards of unrun paths watch a reader's
``forward``, and a LightningModule's ``training_step`` runs outside any forward."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers as tf
from torch.utils.data import DataLoader, TensorDataset

from lightning_hbm import QuantizedPrecision, coverage_of
from lightning_hbm.layers.read_weight import ReadableLinear


class _BfloatOnly(pl.LightningModule):
    """A transformers Llama with a head of its own whose weight ``training_step`` reads only under bfloat16 (a
    feature-matching term; ``conv``: a convolution's weight, read the same way)."""

    def __init__(self, conv: bool = False) -> None:
        super().__init__()
        config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        self.model = tf.LlamaForCausalLM(config)
        self.head = torch.nn.Conv1d(64, 64, 1) if conv else torch.nn.Linear(64, 64)
        self.as_built = self.head.weight.detach().clone().reshape(64, 64)
        self.read: list[float] = []  # the cosine of the weight read in the step with the weight as built

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        hidden, loss = out.hidden_states[-1], out.loss
        if hidden.dtype == torch.bfloat16:
            weight = self.head.weight
            self.read.append(float(torch.nn.functional.cosine_similarity(weight.float().reshape(-1), self.as_built.reshape(-1), dim=0)))
            loss = loss + (hidden @ weight.reshape(64, 64).t()).float().square().mean() * 1e-3
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _fit(module: pl.LightningModule, tmp_path: Any) -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader(TensorDataset(torch.randint(0, 128, (8, 16))), batch_size=4))


def _reasons(module: pl.LightningModule, kind: str) -> list[str]:
    rows = {row.kind: row for row in coverage_of(module) or []}
    return list(rows[kind].reasons)


def test_a_linear_read_only_under_bfloat16_is_stored_quantized_and_serves_the_read(tmp_path: Any) -> None:
    """Stored quantized, its weight computed from the storage where the step reads it (a ``ReadableLinear``); the
    step's read gets the weight as built to nf4's error; the coverage table names the reader and the path."""
    module = _BfloatOnly()
    _fit(module, tmp_path)
    assert len(module.read) == 2 and min(module.read) > 0.99
    assert isinstance(module.head, ReadableLinear)
    assert any("read directly by _BfloatOnly.training_step (its source, on a path the probe step did not take)" in why for why in _reasons(module, "Linear"))


def test_a_convolution_read_only_under_bfloat16_stays_quantized(tmp_path: Any) -> None:
    """A quantized convolution's weight reads as its dequantized weight: it stays stored quantized (not widened)."""
    module = _BfloatOnly(conv=True)
    _fit(module, tmp_path)
    assert len(module.read) == 2 and min(module.read) > 0.99
    assert type(module.head).__name__ == "QuantizedConv1d"


@pytest.mark.parametrize("switch", ["0"])
def test_with_the_probe_step_off_the_source_decides_as_before(switch: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", switch)
    module = _BfloatOnly()
    _fit(module, tmp_path)
    assert len(module.read) == 2 and min(module.read) > 0.99
    assert type(module.head) is torch.nn.Linear  # kept in the compute dtype, as the source scan decides
