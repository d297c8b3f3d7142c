"""Transposed convolutions (issue 53 item 3): ``nn.ConvTranspose1d``/``2d``/``3d`` stored in the mode's format, dequantized
per forward, not adapted (peft's LoRA has none), resumed, planned. Was: no layer kind, kept at full size (SAM's mask
upscaler)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import QuantizedConvTranspose1d, QuantizedConvTranspose2d, QuantizedConvTranspose3d, coverage, stored_in
from lightning_hbm.layers.conv_transpose import NOT_ADAPTED
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.registry import format_of


@pytest.mark.parametrize("mode", ["nf4-dq", "int8", "int8-dynamic"])
@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.ConvTranspose2d(16, 32, 2, stride=2),  # SAM's upscale_conv1
        lambda: nn.ConvTranspose1d(16, 8, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1),
        lambda: nn.ConvTranspose3d(8, 16, 2, stride=2, bias=False),
    ],
)
def test_a_quantized_transposed_convolution_computes_with_its_dequantized_weight(mode: str, conv: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(conv())
    reference = copy.deepcopy(module[0])
    quantize_model(module, mode, dtype="float32")
    layer = module[0]
    assert isinstance(layer, (QuantizedConvTranspose1d, QuantizedConvTranspose2d, QuantizedConvTranspose3d))
    assert "weight" not in dict(layer.named_parameters()) and format_of(stored_in(layer)) is not None
    weight = layer.weight  # dequantized, in the [in, out / groups, *kernel] layout
    assert weight.shape == reference.weight.shape and weight.dtype == torch.float32
    x = torch.randn(2, reference.in_channels, *([5] * (weight.dim() - 2)))
    plain = copy.deepcopy(reference)
    plain.weight.data.copy_(weight)
    torch.testing.assert_close(module(x), plain(x), rtol=0, atol=0)
    error = (weight - reference.weight).norm() / reference.weight.norm()
    assert error < (0.12 if mode.startswith("nf4") else 0.01), float(error)


def sam() -> nn.Module:
    from transformers import SamConfig, SamMaskDecoderConfig, SamModel, SamPromptEncoderConfig, SamVisionConfig

    vision = SamVisionConfig(
        hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
        mlp_dim=64, global_attn_indexes=[0], num_pos_feats=8,
    )  # fmt: skip
    prompt = SamPromptEncoderConfig(hidden_size=16, image_size=64, patch_size=16, mask_input_channels=4)
    decoder = SamMaskDecoderConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_dim=32, iou_head_hidden_dim=16)
    return SamModel(SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder))


def test_sam_mask_upscaler_is_quantized_and_not_adapted_with_the_reason() -> None:
    torch.manual_seed(0)
    model = sam()
    quantize_model(model, "nf4-dq", dtype="float32")
    assert isinstance(model.mask_decoder.upscale_conv1, QuantizedConvTranspose2d)
    with torch.no_grad():
        masks = model(pixel_values=torch.randn(1, 3, 64, 64), input_points=torch.tensor([[[[10.0, 20.0]]]])).pred_masks
    assert masks.shape == (1, 1, 3, 16, 16) and masks.isfinite().all()
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
    assert rows["ConvTranspose"].quantized == rows["ConvTranspose"].params == (16 * 4 * 2 * 2 + 4) + (4 * 2 * 2 * 2 + 2)
    plain = sam()
    LoRA(r=2).transform_model(plain)  # LoRA alone: the transposed convolutions are left, said why
    rows = {r.kind: r for r in coverage(plain, quantizing=False, adapting=True)}
    assert rows["ConvTranspose"].adapted == 0 and any(NOT_ADAPTED in why for why in rows["ConvTranspose"].reasons)


class Upscaler(pl.LightningModule):
    """A mask upscaler as SAM's: a Linear to a 4x4 map, two transposed convolutions (x2 each), a 1x1 conv."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 64 * 16)
        self.up1, self.up2 = nn.ConvTranspose2d(64, 32, 2, stride=2), nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.head = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.up2(F.gelu(self.up1(self.proj(x).view(-1, 64, 4, 4))))))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(self(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_upscaler(tmp_path: Any, epochs: int, ckpt_path: Any = None, save: bool = False) -> tuple[Upscaler, list[float]]:
    module, losses = Upscaler(), []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")], callbacks=[LoRA(r=4, target_modules=["proj", "head"]), Losses()],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=generator), (torch.rand(4, 1, 16, 16, generator=generator) > 0.5).float()) for _ in range(2)]
    trainer.fit(module, DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return module, losses


def test_an_upscaler_trains_in_bf16_with_its_transposed_convolutions_quantized_and_resumes_exactly(tmp_path: Any) -> None:
    straight, losses = fit_upscaler(tmp_path, 3)
    assert losses[-1] < losses[0] and isinstance(straight.up1, QuantizedConvTranspose2d)
    assert not stored_in(straight.up1).weight.is_floating_point() and straight.up1.bias.dtype == torch.bfloat16
    rows = {r.kind: r for r in coverage_of(straight)}
    assert rows["ConvTranspose"].quantized == rows["ConvTranspose"].params and rows["ConvTranspose"].unhandled == 0
    # a third of its bf16 size (4.1 bits a weight plus nf4-dq's ~1 KiB nested code book, a lot for 8k weights)
    assert parameter_bytes(straight.up1) < 0.4 * 2 * 64 * 32 * 4
    fit_upscaler(tmp_path, 1, save=True)
    resumed, _ = fit_upscaler(tmp_path, 3, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(resumed.up1.bias, straight.up1.bias, rtol=0, atol=0)


def test_the_planner_counts_quantized_transposed_convolutions_exactly() -> None:
    from lightning_hbm.planner import quantized_parameter_bytes

    module = Upscaler()
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "bfloat16")
    quantize_model(module, "nf4-dq", dtype="bfloat16")
    assert planned == parameter_bytes(module) and isinstance(module.up2, QuantizedConvTranspose2d)
