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

import logging
import warnings
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


# ---------------------------------------------------------------- session 39 (issue 53): zero-initialised residual scales
# timm RegNetX-200MF, Swin-V2 and LeViT built from their configs (session 38): 26, 6 and 16 adapters with all-zero
# gradients, explained by "dropped by an indexing or a mask, ...". Measured: each sits in a residual branch closed by a
# norm whose weight timm initialises to zero (RegNet's zero_init_last on conv3.bn, Swin-V2's res-post-norms norm1/norm2,
# LeViT's bn_weight_init=0 on attn.proj.ln.bn and mlp.ln2.bn); LoRA freezes it, so it stays zero and the adapters never
# train. Filling those weights with 0.1, or training them (LoRA(modules_to_save=[...])), ends the warning.


class _Residual(pl.LightningModule):
    """Two residual blocks, conv1 -> conv2 -> bn, the bn's weight initialised to zero (timm's ``zero_init_last``)."""

    def __init__(self, zero: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"conv1": nn.Conv2d(4, 4, 1), "conv2": nn.Conv2d(4, 4, 3, padding=1), "bn": nn.BatchNorm2d(4)}) for _ in range(2)
        )  # fmt: skip
        self.head = nn.Linear(4, 3)
        if zero:
            for block in self.blocks:
                nn.init.zeros_(block["bn"].weight)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = batch
        for block in self.blocks:
            x = x + block["bn"](block["conv2"](torch.relu(block["conv1"](x))))
        return self.head(x.mean((2, 3))).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _fit_all(module: pl.LightningModule, steps: int, lora: LoRA, tmp_path: Any) -> list[str]:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[lora],
    )  # fmt: skip
    data = [torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(i)) for i in range(steps)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=None))
    return [str(w.message) for w in caught if str(w.message).startswith("LoRA: ")]


def test_zero_initialised_frozen_norm_is_named_with_the_fix(tmp_path: Any) -> None:
    torch.manual_seed(0)
    lora = LoRA(r=2, target_modules=["conv1", "conv2"])
    (zero,) = [w for w in _fit_all(_Residual(), 2, lora, tmp_path) if "gradient was all zeros" in w]
    assert zero.startswith("LoRA: 4 adapter(s) ran but their gradient was all zeros at each of the first 2"), zero
    assert "They sit in a block with a scale that is all zeros and frozen: blocks.0.bn.weight, blocks.1.bn.weight:" in zero, zero
    assert "LoRA(modules_to_save=['blocks.0.bn', 'blocks.1.bn'])" in zero and "load trained weights" in zero, zero
    assert "dropped by an indexing" not in zero, zero
    assert sorted(lora.unused_modules) == ["blocks.0.conv1", "blocks.0.conv2", "blocks.1.conv1", "blocks.1.conv2"]


def test_the_fix_it_names_trains_the_adapters(tmp_path: Any) -> None:
    """The fix the warning gives: the zero scales trained in full move at the first step, the adapters get gradients."""
    torch.manual_seed(0)
    module = _Residual()
    lora = LoRA(r=2, target_modules=["conv1", "conv2"], modules_to_save=["blocks.0.bn", "blocks.1.bn"])
    assert not [w for w in _fit_all(module, 3, lora, tmp_path) if "zero" in w]
    assert lora.unused_modules == []
    assert all(float(p.abs().max()) > 0 for n, p in module.named_parameters() if "lora_B" in n), "the adapters did not move"


def test_a_trained_zero_scale_is_expected_not_warned(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A fit shorter than the watch (one step): the adapters behind a zero scale that is trained get gradients after the
    first optimizer step moves it; said as expected (info), not warned, not counted unused."""
    torch.manual_seed(0)
    lora = LoRA(r=2, target_modules=["conv1", "conv2"], modules_to_save=["blocks.0.bn", "blocks.1.bn"])
    with caplog.at_level(logging.INFO):
        warned = _fit_all(_Residual(), 1, lora, tmp_path)
    assert not [w for w in warned if "zero" in w], warned
    said = [r.getMessage() for r in caplog.records if "all-zero gradients" in r.getMessage()]
    assert len(said) == 1 and "still all zeros, as initialised: blocks.0.bn" in said[0] and "(expected)" in said[0], said
    assert lora.unused_modules == []


def test_a_healthy_residual_model_is_not_warned(tmp_path: Any) -> None:
    torch.manual_seed(0)
    assert not [w for w in _fit_all(_Residual(zero=False), 2, LoRA(r=2, target_modules=["conv1", "conv2"]), tmp_path) if "zero" in w]


@pytest.mark.parametrize(
    ("build", "size", "count", "scale", "owner"),
    [
        ("levit", 64, 16, "model.stages.0.blocks.0.attn.proj.ln.bn.weight", "model.stages.0.blocks.0.mlp.ln2.bn"),
        ("swinv2", 32, 6, "model.layers.0.blocks.0.norm1.weight", "model.layers.1.blocks.0.norm2"),
    ],
)
def test_timm_zero_initialised_branches_are_named(build: str, size: int, count: int, scale: str, owner: str, tmp_path: Any) -> None:
    """timm LeViT and Swin-V2 from their configs (session 38's runs, without quantization: the cause is the model's)."""
    timm = pytest.importorskip("timm")
    tm = timm.models
    make = {
        "levit": lambda: tm.levit.Levit(img_size=64, embed_dim=(32, 48, 64), key_dim=16, depth=(1, 1, 1), num_heads=(2, 3, 4), num_classes=10),
        "swinv2": lambda: tm.swin_transformer_v2.SwinTransformerV2(img_size=32, patch_size=4, window_size=4, embed_dim=24, depths=(1, 1), num_heads=(2, 4), num_classes=10),
    }[build]  # fmt: skip

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    torch.manual_seed(0)
    data = [(torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(i)), torch.tensor([1, 2])) for i in range(2)]
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LoRA()])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Classifier(), DataLoader(data, batch_size=None))
    (zero,) = [str(w.message) for w in caught if "gradient was all zeros" in str(w.message)]
    assert zero.startswith(f"LoRA: {count} adapter(s) ran but their gradient was all zeros"), zero
    assert f"They sit in a block with a scale that is all zeros and frozen: {scale}" in zero, zero
    assert f"'{owner}'" in zero.partition("modules_to_save=")[2], zero
