"""``LoRA.merge`` and ``save_adapter`` of a layer under ``weight_norm`` (issue 53 item 3): Wav2Vec2 / HuBERT's
positional convolution, whose weight_norm the quantization folds into one stored weight.

Was: the merged state_dict held one ``...pos_conv_embed.conv.weight``, a key the model as built does not have (its
factors are ``parametrizations.weight.original0``/``original1``): a strict load failed, a non-strict one silently kept
the model's own factors (the adapter's update and the trained weight lost); ``merge(base_state_dict=...)`` raised
"base_state_dict has no ...conv.weight". Real transformers classes from small configs, no download.
"""

from __future__ import annotations

import tempfile
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import QuantizedConv1d

SPEECH = dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, conv_dim=(32, 32),
    conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
    # no random numbers in training (SpecAugment, dropout): the adapted and the merged model see the same function
    mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
)  # fmt: skip


def hubert(groups: int) -> nn.Module:
    from transformers import HubertConfig, HubertModel

    torch.manual_seed(0)
    return HubertModel(HubertConfig(num_conv_pos_embedding_groups=groups, **SPEECH))


def wav2vec2(groups: int) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    torch.manual_seed(0)
    return Wav2Vec2Model(Wav2Vec2Config(num_conv_pos_embedding_groups=groups, **SPEECH))


class Speech(pl.LightningModule):
    def __init__(self, build: Callable[[int], nn.Module], groups: int) -> None:
        super().__init__()
        self.model = build(groups)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).last_hidden_state.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trained(build: Callable[[int], nn.Module], groups: int, quantized: bool = True) -> Speech:
    """Three QLoRA steps (``quantized=False``: plain LoRA); the positional conv adapted when it is not grouped
    (peft cannot adapt a grouped convolution: with groups=16, HuBERT's own, it is quantized and left frozen)."""
    module = Speech(build, groups)
    targets = ["conv", "q_proj"] if groups == 1 else ["q_proj"]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")] if quantized else [],
        callbacks=[LoRA(r=4, target_modules=targets)],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(2, 400, generator=generator) for _ in range(3)], batch_size=None))
    module.eval()
    return module


def as_built(merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in merged.items()}


def outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(x).last_hidden_state


@pytest.mark.slow
@pytest.mark.parametrize("build, groups", [(hubert, 1), (hubert, 4), (wav2vec2, 1)], ids=["hubert-adapted", "hubert-grouped", "wav2vec2-adapted"])
def test_merge_of_a_folded_weight_norm_loads_into_the_model_as_built_with_the_adapted_outputs(build: Any, groups: int) -> None:
    module = trained(build, groups)
    conv = module.model.encoder.pos_conv_embed.conv
    assert isinstance(conv.base_layer if groups == 1 else conv, QuantizedConv1d)
    x = torch.randn(1, 400, generator=torch.Generator().manual_seed(2))
    want = outputs(module.model, x)
    for dtype, tolerance in (("float32", 1e-4), ("bfloat16", 3e-2)):
        with pytest.warns(UserWarning, match="DEQUANTIZED"):
            merged = as_built(LoRA.merge(module, dtype=dtype))
        assert "encoder.pos_conv_embed.conv.weight" not in merged
        plain = build(groups)
        plain.load_state_dict(merged)  # strict: the parametrization's factors, as the model was built
        assert type(plain.encoder.pos_conv_embed.conv).__name__ == "ParametrizedConv1d"
        torch.testing.assert_close(outputs(plain, x), want, rtol=tolerance, atol=tolerance, msg=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 4])
def test_merge_onto_the_original_factors_equals_the_peft_reload_of_the_saved_adapter(groups: int) -> None:
    from peft import PeftModel

    original = hubert(groups).state_dict()
    module = trained(hubert, groups)
    merged = as_built(LoRA.merge(module, dtype="float32", base_state_dict=original))
    onto = hubert(groups)
    onto.load_state_dict(merged)
    with tempfile.TemporaryDirectory() as folder:
        LoRA.save_adapter(module, folder)
        reloaded = PeftModel.from_pretrained(hubert(groups), folder)
        x = torch.randn(1, 400, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(outputs(onto, x), outputs(reloaded, x), rtol=1e-4, atol=1e-4)
    if groups == 4:  # not adapted: the original factors come back as they were
        for key in ("parametrizations.weight.original0", "parametrizations.weight.original1"):
            key = "encoder.pos_conv_embed.conv." + key
            torch.testing.assert_close(merged[key], original[key], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_plain_lora_merge_of_a_live_weight_norm_keeps_its_factors() -> None:
    """No quantization: the weight_norm still computes the weight, peft adapts the parametrized conv."""
    module = trained(hubert, 1, quantized=False)
    x = torch.randn(1, 400, generator=torch.Generator().manual_seed(2))
    plain = hubert(1)
    plain.load_state_dict(as_built(LoRA.merge(module, dtype="float32")))
    torch.testing.assert_close(outputs(plain, x), outputs(module.model, x), rtol=1e-4, atol=1e-4)


def test_the_hook_based_weight_norm_merges_into_weight_g_and_weight_v() -> None:
    """torch.nn.utils.weight_norm (older transformers, HiFi-GAN): quantized, folded from its factors, merged back."""
    from lightning_hbm.precision import quantize_model

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        with pytest.warns(FutureWarning):  # torch deprecates the hook-based weight_norm, models still use it
            return nn.Sequential(nn.utils.weight_norm(nn.Conv1d(16, 16, 3, padding=1), dim=None), nn.Conv1d(16, 16, 3))

    module = build()
    quantize_model(module, "nf4-dq", dtype="float32")
    assert isinstance(module[0], QuantizedConv1d)
    LoRA(r=4, target_modules=["0", "1"]).transform_model(module)
    with torch.no_grad():
        for layer in module:
            layer.lora_B["default"].weight.normal_()  # an update to merge
    x = torch.randn(2, 16, 9, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = module(x)
    with pytest.warns(UserWarning, match="DEQUANTIZED"):
        merged = LoRA.merge(module, dtype="float32")
    assert {"0.weight_g", "0.weight_v"} <= set(merged) and "0.weight" not in merged
    plain = build()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, rtol=1e-4, atol=1e-4)


class Vocoder(pl.LightningModule):
    """HiFi-GAN's shape: a weight_norm on every convolution, the upsampler a transposed one (not adaptable by peft)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with pytest.warns(FutureWarning):  # the hook-based weight_norm, as transformers' SpeechT5HifiGan applies it
            self.up = nn.utils.weight_norm(nn.ConvTranspose1d(16, 16, 4, stride=2, padding=1))
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(16, 16, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.tanh(self.up(x)))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_vocoder(tmp_path: Any, epochs: int, ckpt_path: Any = None, save: bool = False) -> Vocoder:
    module = Vocoder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, target_modules=["conv"])],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(2, 16, 8, generator=generator) for _ in range(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return module.eval()


@pytest.mark.slow
def test_a_weight_normed_transposed_conv_resumes_and_merges_into_its_factors(tmp_path: Any) -> None:
    """Was: its storage mapped to an as-built ``weight`` the model does not have (resume), merged as ``up.weight``."""
    from lightning_hbm.layers import QuantizedConvTranspose1d

    straight = fit_vocoder(tmp_path, 2)
    assert isinstance(straight.up, QuantizedConvTranspose1d)
    fit_vocoder(tmp_path, 1, save=True)
    resumed = fit_vocoder(tmp_path, 2, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    x = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(2))
    with pytest.warns(UserWarning, match="DEQUANTIZED"):
        merged = LoRA.merge(straight, dtype="float32")
    assert {"up.weight_g", "up.weight_v", "conv.parametrizations.weight.original0"} <= set(merged)
    plain = Vocoder()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(x), straight(x), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_weight_norm_trained_in_full_is_saved_as_its_layer_and_reloads_in_peft(tmp_path: Any) -> None:
    """``modules_to_save``: the factors train (no folding); was: ``modules_to_save`` also named the
    ``parametrizations.weight`` list inside the layer."""
    import json

    from peft import PeftModel

    module = Speech(hubert, 4)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["q_proj"], modules_to_save=["pos_conv_embed.conv"])],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(2, 400, generator=generator) for _ in range(2)], batch_size=None))
    assert type(module.model.encoder.pos_conv_embed.conv).__name__ == "ParametrizedConv1d"
    LoRA.save_adapter(module, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"] == ["encoder.pos_conv_embed.conv"]
    reloaded = PeftModel.from_pretrained(hubert(4), tmp_path)
    onto = hubert(4)
    onto.load_state_dict(as_built(LoRA.merge(module.eval(), dtype="float32", base_state_dict=hubert(4).state_dict())))
    x = torch.randn(1, 400, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(outputs(reloaded, x), outputs(onto, x), rtol=1e-4, atol=1e-4)
