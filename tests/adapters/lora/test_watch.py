"""The adapter watcher's all-zero-gradient warning says what it measured, with causes that fit the model running.

Was (sessions 32-33): every adapter whose gradient stayed all zeros was explained by "dropped by an indexing:
transformers SAM under multimask_output=False keeps the mask of output_hypernetworks_mlps.0 only", also on
transformers' Mimi as built, where 15 decoder adapters get all-zero gradients for another reason, the model's own:
a fresh ``MimiEuclideanCodebook`` holds ``embed_sum`` = zeros (a trained codec's are loaded), so every code decodes to
a zero vector; the quantizer's ``output_proj``, the decoder's transformer (no biases; LayerNorm of zeros is its zero
bias) and the first decoder convolution see an all-zero input, and a LoRA gradient is its input times its output's
gradient. Now the watcher measures each adapter's largest ``|input|`` in the first step and names those fed zeros
apart from those whose output is dropped; the encoder's adapters (cut by the codebooks' argmin) get the causes of a
cut graph.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA

FIELDS = dict(hidden_size=32, num_filters=8, upsampling_ratios=[2, 2], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=8, intermediate_size=64, codebook_size=32, codebook_dim=16, vector_quantization_hidden_dimension=16,
              num_quantizers=2, upsample_groups=32, sliding_window=16, max_position_embeddings=64, sampling_rate=64)  # fmt: skip


def _fit(module: pl.LightningModule, data: list[Any], lora: LoRA, tmp_path: Any) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=len(data), logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[lora],
    )  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        trainer.fit(module, DataLoader(data, batch_size=None))
    return [str(w.message) for w in caught if str(w.message).startswith("LoRA: ")]


def test_mimi_as_built_names_its_decoder_adapters_fed_zeros_by_the_empty_codebooks(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")

    class Codec(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.MimiModel(transformers.MimiConfig(**FIELDS))  # codebooks as built: all zeros

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return (self.model(input_values=batch).audio_values - batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    torch.manual_seed(0)
    data = [torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    lora = LoRA(r=4)
    warned = _fit(Codec(), data, lora, tmp_path)
    (zero,) = [w for w in warned if "gradient was all zeros" in w]
    (cut,) = [w for w in warned if "never reaches the loss" in w]
    decoder = [n for n in lora.unused_modules if ".decoder." in n or n.endswith("output_proj")]
    assert len(decoder) == 15 and zero.startswith("LoRA: 15 adapter(s) ran but their gradient was all zeros at each of the "
                                                  "first 3 backward pass(es)"), zero  # fmt: skip
    assert f"LoRA(exclude_modules={sorted(decoder)!r})" in zero, zero
    assert "Their input was all zeros in the first training step (measured)" in zero and "codebook" in zero, zero
    assert "SAM" not in zero and "output_hypernetworks" not in zero and "dropped by an indexing" not in zero, zero
    assert "argmin" in cut and "model.encoder.encoder_seanet.layers.0.conv" in cut, cut


def test_zero_input_and_dropped_output_are_told_apart(tmp_path: Any) -> None:
    """Two adapters with all-zero gradients for two reasons: one fed zeros (a layer initialised to zero before it),
    one whose output is scaled by zero; named apart, each with its cause."""

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(8, 8, bias=False)
            nn.init.zeros_(self.gate.weight)  # outputs zeros: the next layer is fed zeros
            self.fed = nn.Linear(8, 8, bias=False)
            self.heads = nn.Linear(8, 8)  # its output is scaled by zero
            self.trunk = nn.Linear(8, 8)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            unused = self.heads(batch).sum() * 0  # computed, then scaled by zero: its gradient is zeros, not None
            return (self.trunk(batch) + self.fed(self.gate(batch))).square().mean() + unused

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    lora = LoRA(r=2, target_modules=["fed", "heads", "trunk"])
    warned = _fit(Net(), [torch.randn(4, 8) for _ in range(3)], lora, tmp_path)
    (zero,) = [w for w in warned if "gradient was all zeros" in w]
    assert zero.startswith("LoRA: 2 adapter(s) ran but their gradient was all zeros"), zero
    assert "The input of 1 of them (fed) was all zeros in the first training step (measured)" in zero, zero
    assert "The others' output is computed but does not change the loss" in zero, zero
    assert lora.unused_modules == ["fed", "heads"]
