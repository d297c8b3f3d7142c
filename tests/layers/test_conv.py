"""Quantized convolutions (issue 33): ``nn.Conv1d``/``2d``/``3d`` stored in every mode's format, dequantized per forward,
adapted by peft's Conv LoRA, resumed, planned. Was: bitsandbytes has no conv kernel, so ResNet18 stayed 0 % quantized."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable, cast

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conv_models import EfficientNetB0, ResNet18, YoloDetector, calibrate, images
from kind_models import Classifier, fit_cnn
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import QuantizedConv1d, QuantizedConv2d, QuantizedConv3d, coverage, stored_in
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.registry import format_of
from lightning_hbm.precision.sensitivity import CONV_TARGET_COSINE

MODES = ("nf4", "nf4-dq", "int8", "int8-dynamic")


def conv_linear_share(module: nn.Module) -> tuple[float, float]:
    """(share of the conv + linear parameters stored quantized, their bytes per parameter)."""
    rows = [r for r in coverage(module, quantizing=True, adapting=False) if r.kind in ("Conv", "Linear")]
    params = sum(r.params for r in rows)
    return sum(r.quantized for r in rows) / params, sum(r.bytes for r in rows) / params


@pytest.mark.slow
@pytest.mark.parametrize("factory", [ResNet18, EfficientNetB0])
@pytest.mark.parametrize("mode", ["nf4", "nf4-dq"])
def test_cnns_are_quantized_over_95_percent_at_under_0_6_bytes_per_parameter(factory: Callable[[], nn.Module], mode: str) -> None:
    """Measured (benchmarks/README.md): ResNet18 nf4 0.563 / nf4-dq 0.518 B/param, EfficientNet-B0 0.570 / 0.540."""
    torch.manual_seed(0)
    module = factory()
    quantize_model(module, mode, dtype="float32")
    share, per_param = conv_linear_share(module)
    assert share >= 0.95 and per_param <= 0.6, (share, per_param)
    assert isinstance(module.get_submodule("conv1" if factory is ResNet18 else "conv_stem"), QuantizedConv2d)


def test_resnet18_output_stays_close_to_fp32_in_every_mode() -> None:
    torch.manual_seed(0)
    reference = ResNet18().eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)
    for mode, floor in (("nf4-dq", 0.985), ("int8", 0.9999), ("int8-dynamic", 0.9999)):  # measured 0.9897, 0.99998
        module = copy.deepcopy(reference)
        quantize_model(module, mode, dtype="float32")
        with torch.no_grad():
            cosine = F.cosine_similarity(module(x).flatten(), want.flatten(), dim=0)
        assert cosine > floor, (mode, float(cosine))


def centred_cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    mean = want.mean()
    return float(F.cosine_similarity(got.flatten() - mean, want.flatten() - mean, dim=0))


@pytest.mark.slow
def test_calibrated_batchnorm_resnet_keeps_its_output_at_the_default_plan() -> None:
    """Issue 53: with BatchNorm statistics like a trained network's, uniform nf4-dq convolutions gave ResNet18 a centred
    output cosine of 0.91 (64 px, benchmarks/conv_accuracy.py); QuantizedPrecision's default plans the convolutions
    on the probe batch, widening the most sensitive to int8. Measured here (32 px): probe 0.816 -> 0.980, held-out
    centred 0.821 -> 0.975 at 0.616 bytes per conv weight."""
    torch.manual_seed(0)
    reference = calibrate(ResNet18(), images(8, seed=10, batches=2, size=32))
    x, probe = images(4, seed=1, size=32), images(4, seed=2, size=32)
    with torch.no_grad():
        want = reference(x)
    uniform = copy.deepcopy(reference)
    quantize_model(uniform, "nf4-dq", dtype="float32")
    planned = copy.deepcopy(reference)
    # planned to 0.98 on the probe (the default before session 25: CONV_TARGET_COSINE is 0.985 now, the test below)
    plan = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, min_cosine=0.98).quantization
    # the plan reaches its target on the probe (row cosine); the quantized model's own centred figure is under it: said
    # once at the quantization, with the figure and the fix (the plan's "held out measured under it" is then not said too)
    plan.check(planned, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.convert(planned, None)
    said = [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]
    assert len(said) == 1 and re.search(r"this model's output on the probe batch has a cosine of 0\.9[0-7]\d+ .*under 0\.98.*"
                                        r"Fix: QuantizedPrecision\(\.\.\., mode='int8', dtype='float32'\)", said[0]), said
    report = plan.conv_report
    assert report is not None and report.cosine >= 0.98 and report.uniform_cosine < 0.95, report
    # min_cosine given: the Linear head is planned too (it may stay in the mode)
    assert plan.layer_modes and {m for n, m in plan.layer_modes.items() if n != "fc"} <= {"nf4-dq-b32", "int8"}
    assert sum(isinstance(m, QuantizedConv2d) for m in planned.modules()) == 20  # every convolution stays stored
    with torch.no_grad():
        before, after = centred_cosine(uniform(x), want), centred_cosine(planned(x), want)
    _, per_param = conv_linear_share(planned)
    assert after >= 0.97 and after > before + 0.03 and per_param <= 0.65, (before, after, per_param)


def test_the_default_conv_plan_aims_above_the_threshold_the_probe_reads_high() -> None:
    """Session 25: planned to 0.98 on the probe, ResNet18 measured 0.977 held out (the plan stops at the first plan
    that measures its target on the probe it was chosen on); the default target is now ``CONV_TARGET_COSINE`` (0.985):
    0.982 held out on both seeds at 0.567 bytes per conv weight (``benchmarks/conv_default.py``). Here (32 px) the
    quantized model's own figure is then over the threshold 0.98, and the one warning is the plan's (held out may be
    lower), naming the threshold, not the target."""
    torch.manual_seed(0)
    reference = calibrate(ResNet18(), images(8, seed=10, batches=2, size=32))
    probe = images(4, seed=2, size=32)
    plan = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe).quantization
    planned = copy.deepcopy(reference)
    plan.check(planned, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan.convert(planned, None)
    said = [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]
    assert plan.conv_report is not None and plan.conv_report.cosine >= CONV_TARGET_COSINE == 0.985
    assert plan.conv_accuracy is not None and plan.conv_accuracy.cosine >= 0.98 and not plan.conv_accuracy.warned
    assert len(said) == 1 and re.search(r"planned to a probe output cosine of 0\.98[5-9]\d* .*around 0\.98\. Fix for at "
                                        r"least 0\.98 on new data", said[0]), said


@pytest.mark.slow
def test_a_conv_plan_that_misses_its_target_is_a_warning_naming_the_figure() -> None:
    torch.manual_seed(0)
    model = calibrate(YoloDetector(), images(8, seed=10, batches=2, size=32))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(2, seed=2, size=32), sensitive_mode="nf4-dq-b32")
    with pytest.warns(UserWarning, match=r"probe output cosine of 0\.\d+ < 0\.985 against the unquantized model"):
        plugin.quantization.check(model, None)
    assert plugin.quantization.conv_report is not None and plugin.quantization.conv_report.cosine < 0.98



class _Classify(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _trainer(tmp_path: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision()],
    )  # fmt: skip


def _validate_without_probe(model: nn.Module, tmp_path: Any) -> None:
    """A run with no train dataloader (``validate`` of a module without ``train_dataloader``): no probe batch."""
    class Validated(_Classify):
        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

    _trainer(tmp_path).validate(Validated(model), DataLoader([images(2, seed=3, size=32)], batch_size=None))


def test_a_batchnorm_conv_net_fit_with_a_loader_plans_its_convolutions_on_the_loaders_first_batch(tmp_path: Any) -> None:
    """``trainer.fit(model, train_dataloaders)`` with the default ``QuantizedPrecision()``: the probe batch is the
    loader's first (was: only a datamodule gave one, so the convolutions stayed uniform nf4-dq: held out ResNet18 0.91,
    a YOLO-style detector 0.10, benchmarks/conv_default.py). The loader is requested once."""
    torch.manual_seed(0)
    model = calibrate(ResNet18(), images(4, seed=10, size=32))
    trainer, requests = _trainer(tmp_path), []

    class Counted(_Classify):
        def train_dataloader(self) -> DataLoader:
            requests.append(1)
            return DataLoader([images(2, seed=3, size=32)], batch_size=None)

    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer.fit(Counted(model))
    assert not [w for w in warned if "without a measured plan" in str(w.message)]
    plugin = cast(QuantizedPrecision, trainer.precision_plugin)
    assert plugin.quantization.conv_report is not None and plugin.quantization.conv_report.cosine >= 0.98
    assert requests == [1]


def test_a_batchnorm_conv_net_without_a_probe_batch_is_warned_with_the_figure_and_the_fix(tmp_path: Any) -> None:
    """Issue 53: no probe batch (no ``probe_batch``, no train dataloader) left the convolutions uniform nf4-dq with a
    log line only. Now a warning names the figure and the fix."""
    torch.manual_seed(0)
    model = calibrate(ResNet18(), images(4, seed=10, size=32))
    with pytest.warns(UserWarning, match=r"20 convolutions of this BatchNorm conv net are stored in nf4-dq without a measured plan: no probe batch.*ResNet18 0\.91.*Fix: QuantizedPrecision\(probe_batch=.*mode='int8', dtype='float32'\)"):
        _validate_without_probe(model, tmp_path)


def test_a_conv_net_without_batchnorm_without_a_probe_batch_is_not_warned(tmp_path: Any) -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 28 * 28, 4))
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        _validate_without_probe(model, tmp_path)
    assert not [w for w in warned if "without a measured plan" in str(w.message)]


def test_the_held_out_gap_is_said_for_batchnorm_conv_nets_the_plan_widened_only() -> None:
    from lightning_hbm.precision.sensitivity import SensitivityReport, widened_convs_warning

    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    normed = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Conv2d(8, 8, 3))
    widened, uniform = SensitivityReport({}, 0.9, 0.981, 0.52, 0.6), SensitivityReport({}, 0.99, 0.99, 0.52, 0.52)
    assert widened_convs_warning(plain, widened, "nf4-dq", 0.98) is None
    assert widened_convs_warning(normed, uniform, "nf4-dq", 0.98) is None  # nothing widened: nothing the probe chose
    assert "0.9810 (uniform nf4-dq: 0.9000) at 0.600 bytes" in str(widened_convs_warning(normed, widened, "nf4-dq", 0.98))

def test_a_conv_net_without_linears_plans_to_a_cosine_target() -> None:
    """Was: ``ZeroDivisionError`` in the (empty) Linear plan of a model whose only layers are convolutions."""
    model = calibrate(YoloDetector(), images(4, seed=10, size=32))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(2, seed=2, size=32), min_cosine=0.9)
    plugin.quantization.check(model, None)
    report = plugin.quantization.conv_report
    assert report is not None and report.cosine >= 0.9

def test_int8_and_pinned_plans_measure_no_conv_plan() -> None:
    model = calibrate(YoloDetector(), images(4, seed=10, size=32))
    for plugin in (
        QuantizedPrecision("int8", dtype="float32", probe_batch=images(2, seed=2, size=32)),
        QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(2, seed=2, size=32), layer_modes={"stem.0.conv": "int8"}),
    ):
        plugin.quantization.check(model, None)
        assert plugin.quantization.conv_report is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "conv",
    [
        lambda: nn.Conv1d(16, 32, 5, stride=2, padding=2),
        lambda: nn.Conv2d(16, 32, 3, padding=1, dilation=2, bias=False),
        lambda: nn.Conv2d(32, 32, 3, padding=1, groups=32, padding_mode="reflect"),  # depthwise, reflect padding
        lambda: nn.Conv3d(8, 16, 3, padding=1),
    ],
)
def test_a_quantized_convolution_computes_with_its_dequantized_weight(mode: str, conv: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(conv())
    reference = copy.deepcopy(module)
    quantize_model(module, mode, dtype="float32")
    layer = module[0]
    assert isinstance(layer, (QuantizedConv1d, QuantizedConv2d, QuantizedConv3d)) and "weight" not in dict(layer.named_parameters())
    storage = stored_in(layer)
    assert format_of(storage) is not None and not any(p.requires_grad for p in storage.parameters())
    x = torch.randn(2, reference[0].in_channels, *([9] * (reference[0].weight.dim() - 2)))
    weight = layer.weight  # dequantized: the conv's shape, the compute dtype
    assert weight.shape == reference[0].weight.shape and weight.dtype == torch.float32
    torch.testing.assert_close(module(x), reference[0]._conv_forward(x, weight, reference[0].bias), rtol=0, atol=0)
    error = (weight - reference[0].weight).norm() / reference[0].weight.norm()
    assert error < (0.12 if mode.startswith("nf4") else 0.01), float(error)


def test_called_as_a_convolution_the_class_is_the_plain_one() -> None:
    """peft builds an adapter's lora_A/lora_B as ``type(base_layer)(...)``: they must be ordinary convolutions."""
    assert type(QuantizedConv2d(4, 8, 3)) is nn.Conv2d and type(QuantizedConv1d(4, 8, 3)) is nn.Conv1d


class CNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.conv, self.dw = nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.Conv2d(64, 64, 3, padding=1, groups=64)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        return self.head(self.dw(F.relu(self.conv(x))).mean((2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)) for _ in range(2)]


def test_lora_on_quantized_convolutions_trains_and_the_base_stays_as_stored(tmp_path: Any) -> None:
    torch.manual_seed(0)
    module = CNN()
    grads: dict[str, bool] = {}

    class Grads(pl.Callback):
        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            grads.update({n: p.grad is not None for n, p in pl_module.named_parameters() if ".lora_" in n})

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["stem", "conv"]), Grads()],
    )  # fmt: skip
    packed = None
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    assert isinstance(module.conv.base_layer, QuantizedConv2d) and type(module.conv.lora_A["default"]) is nn.Conv2d
    assert grads and all(grads.values()), grads
    packed = stored_in(module.conv.base_layer).weight
    assert not packed.is_floating_point() and not packed.requires_grad
    rows = {r.kind: r for r in coverage_of(module)}
    assert rows["Conv"].quantized == rows["Conv"].params and rows["Conv"].unhandled == 0
    assert parameter_bytes(module.conv) < 0.6 * 64 * 64 * 9 + parameter_bytes(module.conv, trainable=True)


def test_the_planner_counts_quantized_convolutions_exactly() -> None:
    from lightning_hbm.planner import quantized_parameter_bytes

    class Classifier(CNN):
        def __init__(self) -> None:
            super().__init__()
            self.net = EfficientNetB0(classes=10)

    torch.manual_seed(0)
    module = Classifier()
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "float32")
    quantize_model(module, "nf4-dq", dtype="float32")
    assert planned == parameter_bytes(module)


def hubert() -> nn.Module:
    from transformers import HubertConfig, HubertModel

    config = HubertConfig(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, conv_dim=(32, 32),
        conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        # no random numbers in training (SpecAugment draws from numpy, which a resume does not restore)
        mask_time_prob=0.0, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
    )  # fmt: skip
    return HubertModel(config)


def test_a_frozen_weight_norm_is_folded_into_one_weight_with_the_same_numbers() -> None:
    """Was: HuBERT's pos_conv_embed.conv (weight_norm, 29 % of this small HuBERT) kept in the compute dtype."""
    from lightning_hbm.planner import quantized_parameter_bytes

    speech = Speech()
    model = speech.model
    conv = model.encoder.pos_conv_embed.conv
    assert type(conv).__name__ == "ParametrizedConv1d"
    computed = conv.weight.detach().clone()
    planned = quantized_parameter_bytes(copy.deepcopy(speech), "nf4-dq", "float32")  # a copy: the model is untouched
    torch.testing.assert_close(model.encoder.pos_conv_embed.conv.weight, computed, rtol=0, atol=0)
    # quantized: the same storage as the plain conv holding that weight
    plain = nn.Sequential(nn.Conv1d(64, 64, 16, padding=8, groups=4))
    plain[0].weight.data.copy_(computed)
    quantize_model(plain, "nf4-dq", dtype="float32")
    quantize_model(model, "nf4-dq", dtype="float32")
    conv = model.encoder.pos_conv_embed.conv
    assert isinstance(conv, QuantizedConv1d) and not any("original" in n for n, _ in model.named_parameters())
    torch.testing.assert_close(conv.weight, plain[0].weight, rtol=0, atol=0)
    assert planned == parameter_bytes(speech) < 0.3 * 4 * sum(p.numel() for p in hubert().parameters())
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
    assert rows["Conv"].quantized == rows["Conv"].params and "parametrized weights" not in rows


def test_the_hook_based_weight_norm_is_folded_from_its_loaded_factors() -> None:
    """torch.nn.utils.weight_norm (older transformers, encodec, HiFi-GAN): its weight attribute is stale after a load."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.utils.weight_norm(nn.Conv1d(16, 16, 3, padding=1)), nn.Conv1d(16, 16, 3))
    module.load_state_dict({k: v * 2 if k == "0.weight_g" else v for k, v in module.state_dict().items()})
    with torch.no_grad():
        want = module(torch.randn(2, 16, 9))  # recomputes the weight from the loaded factors
    reference = nn.Conv1d(16, 16, 3, padding=1)
    reference.load_state_dict({"weight": module[0].weight.detach(), "bias": module[0].bias.detach()})
    quantize_model(module, "nf4-dq", dtype="float32")
    assert isinstance(module[0], QuantizedConv1d) and want.isfinite().all()
    plain = nn.Sequential(reference)
    quantize_model(plain, "nf4-dq", dtype="float32")
    torch.testing.assert_close(module[0].weight, plain[0].weight, rtol=0, atol=0)


def test_other_parametrizations_are_left_alone_and_named() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.utils.parametrizations.spectral_norm(nn.Conv1d(16, 16, 3, padding=1)), nn.Conv1d(16, 16, 3))
    quantize_model(module, "nf4-dq", dtype="float32")
    assert type(module[0]).__name__ == "ParametrizedConv1d" and isinstance(module[1], QuantizedConv1d)
    rows = {r.kind: r for r in coverage(module, quantizing=True, adapting=False)}
    # the reason names the parametrization and why it is not folded (session 24)
    assert "weight computed by a parametrization (_SpectralNorm): spectral_norm's power iteration (its buffers u, v) changes the weight at each training forward; kept in the compute dtype" in rows["Conv"].reasons


class Speech(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = hubert()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).last_hidden_state.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit_speech(tmp_path: Any, epochs: int, ckpt_path: Any = None, save: bool = False) -> Speech:
    module = Speech()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4)],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(2, 400, generator=generator) for _ in range(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return module


@pytest.mark.slow
def test_hubert_with_its_weight_norm_folded_trains_and_resumes_exactly(tmp_path: Any) -> None:
    straight = fit_speech(tmp_path, 2)
    assert isinstance(straight.model.encoder.pos_conv_embed.conv, QuantizedConv1d)
    rows = {r.kind: r for r in coverage_of(straight)}
    assert "parametrized weights" not in rows and rows["Conv"].quantized == rows["Conv"].params
    fit_speech(tmp_path, 1, save=True)
    resumed = fit_speech(tmp_path, 2, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_diffusers_unet_attention_is_adapted_and_95_percent_quantized(tmp_path: Any) -> None:
    """Was: all to_q/to_k/to_v unadapted (``Attention.fuse_projections``, never called in training, reads them) and
    17.5 % of the UNet quantized (convolutions never)."""
    diffusers = pytest.importorskip("diffusers")

    class Denoiser(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.unet = diffusers.UNet2DConditionModel(
                sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
            )  # fmt: skip

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            noisy, steps, text = batch
            return F.mse_loss(self.unet(noisy, steps, encoder_hidden_states=text).sample, noisy)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 4, 16, 16, generator=generator), torch.tensor([10, 20]), torch.randn(2, 5, 32, generator=generator))]
    module = Denoiser()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"])],
    )  # fmt: skip
    trainer.fit(module, DataLoader(data * 2, batch_size=None))
    attention = module.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    for name in ("to_q", "to_k", "to_v"):
        assert hasattr(getattr(attention, name), "lora_A"), name
    rows = [r for r in coverage_of(module) if r.kind in ("Conv", "Linear")]
    assert sum(r.quantized for r in rows) >= 0.95 * sum(r.params for r in rows)


@pytest.mark.slow
def test_whisper_and_wav2vec2_front_ends_are_quantized() -> None:
    from transformers import Wav2Vec2Config, Wav2Vec2Model, WhisperConfig, WhisperModel

    torch.manual_seed(0)
    whisper = WhisperModel(WhisperConfig(d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16))
    quantize_model(whisper, "nf4-dq", dtype="float32")
    assert isinstance(whisper.encoder.conv1, QuantizedConv1d) and isinstance(whisper.encoder.conv2, QuantizedConv1d)
    assert whisper.encoder.conv2(whisper.encoder.conv1(torch.randn(1, 16, 40))).isfinite().all()
    wav2vec2 = Wav2Vec2Model(Wav2Vec2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
                                            conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16))
    quantize_model(wav2vec2, "nf4-dq", dtype="float32")
    assert all(isinstance(layer.conv, QuantizedConv1d) for layer in wav2vec2.feature_extractor.conv_layers)
    with torch.no_grad():
        assert wav2vec2(torch.randn(1, 400)).last_hidden_state.isfinite().all()


def test_merge_folds_conv_adapters_into_the_dequantized_or_the_original_weights(tmp_path: Any) -> None:
    torch.manual_seed(0)
    module = CNN()
    original = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["stem", "conv"])],
    )  # fmt: skip
    trainer.fit(module, DataLoader(batches(), batch_size=None))
    x = batches()[0][0]
    with torch.no_grad():
        want = module(x)
    with pytest.warns(UserWarning, match=r"merged into their DEQUANTIZED base weights"):
        merged = LoRA.merge(module, dtype="float32")
    plain = CNN()
    plain.load_state_dict(merged)  # the model as the user built it: conv weights in their own shape
    with torch.no_grad():
        torch.testing.assert_close(plain(x), want, rtol=1e-4, atol=1e-5)
    onto = LoRA.merge(module, dtype="float32", base_state_dict=original)
    delta = module.conv.get_delta_weight("default")
    torch.testing.assert_close(onto["conv.weight"], original["conv.weight"] + delta, rtol=0, atol=1e-6)


# -------- BatchNorm CNNs in bf16, grouped convolutions


def test_batchnorm_cnn_trains_in_bf16_with_convolutions_quantized_and_adapted(tmp_path: Any) -> None:
    """Was: "expected scalar type BFloat16 but found Float" at the first batch; then (issue 33) every convolution
    kept at full size: bitsandbytes has no convolution kernel, so lightning_hbm stores their weight matrices."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        module, recorder = fit_cnn(3, tmp_path)
    assert not [w for w in warned if "Conv layers" in str(w.message)]
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    bn = module.model.layer1[0].bn1
    # as Lightning's mixed precision: BatchNorm weights and statistics in fp32 (batch_norm takes a bf16 input)
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32 and module.model.layer1[0].conv1.base_layer.weight.dtype == torch.bfloat16
    rows = {r.kind: r for r in coverage_of(module)}
    assert rows["Conv"].adapted == rows["Conv"].quantized == rows["Conv"].params > 0.8 * sum(r.params for r in rows.values() if not r.kind.startswith("LoRA"))
    # nf4-dq: 4.127 bits a weight plus ~1 KiB of nested code book per layer, a lot for these 9k-weight convolutions
    # (0.65 B/weight here; ResNet18's sizes: tests/layers/test_conv.py)
    assert rows["Conv"].bytes < 0.7 * rows["Conv"].params
    assert any(".conv1.lora_A" in n for n in LoRA.adapter_state_dict(module))



def test_batchnorm_cnn_adapter_checkpoint_resumes_exactly(tmp_path: Any) -> None:
    straight, _ = fit_cnn(2, tmp_path)
    fit_cnn(1, tmp_path, save=True)
    resumed, _ = fit_cnn(2, tmp_path, ckpt_path=tmp_path / "cnn.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(resumed.model.bn1.running_var, straight.model.bn1.running_var, rtol=0, atol=0)



def test_planner_agrees_on_a_batchnorm_cnn_in_bf16() -> None:
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import quantized_parameter_bytes

    torch.manual_seed(0)
    module = Classifier()
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "bfloat16")
    quantize_model(module, "nf4-dq", dtype="bfloat16")
    assert planned == parameter_bytes(module)
    assert module.model.bn1.weight.dtype == torch.float32 and module.model.conv1.weight.dtype == torch.bfloat16



def test_grouped_convolutions_are_not_all_linear_targets() -> None:
    from lightning_hbm.layers import adaptable_names

    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Conv1d(8, 8, 3), nn.ConvTranspose2d(8, 8, 2), nn.Linear(8, 8))
    assert adaptable_names(model) == ["1", "3"]



class DepthwiseCNN(nn.Module):
    """timm ConvNeXt's block in miniature: a depthwise convolution (groups = channels) then a pointwise MLP."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 2, stride=2)
        self.conv_dw = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_dw(self.stem(x)).permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))



@pytest.mark.parametrize("quantizing", [True, False])
def test_grouped_convolutions_left_by_lora_are_named_with_the_reason_and_fix(quantizing: bool) -> None:
    from lightning_hbm.layers import report_coverage

    torch.manual_seed(0)
    module = DepthwiseCNN()
    if quantizing:
        quantize_model(module, "nf4-dq", dtype="float32")
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert "stem" in lora.adapted_modules and "conv_dw" not in lora.adapted_modules
    why = r"not adapted: LoRA skips grouped/depthwise convolutions \(peft needs r divisible by groups and cannot merge them\)\. To train them: LoRA\(modules_to_save=\[their names\]\)"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        rows = {r.kind: r for r in report_coverage(module, quantizing=quantizing)}
    conv = rows["Conv"]
    if quantizing:  # quantized like every convolution (issue 33), frozen and not adapted, as a Linear LoRA skips
        assert conv.quantized == conv.params and conv.left_alone == 0 and not conv.undeliberate
        assert not [w for w in warned if "Conv layers" in str(w.message)]
        return
    assert conv.left_alone == module.conv_dw.weight.numel() + module.conv_dw.bias.numel()
    [reason] = [r for r in conv.reasons if "grouped" in r]
    assert re.search(why, reason) and conv.reasons[reason] == conv.left_alone
    assert reason.startswith("frozen in full precision (no QuantizedPrecision);")



class Detector(pl.LightningModule):
    """A calibrated YOLO-style detector trained through its forward (the probe batch goes through it)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = calibrate(YoloDetector(), images(8, seed=10 + seed, batches=2, size=32)).train()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[0]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def fit_detector(tmp_path: Any, seed: int, ckpt_path: Any = None) -> QuantizedPrecision:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(2, seed=2, size=32))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1 if ckpt_path is None else 2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, plugins=[plugin],
    )  # fmt: skip
    trainer.fit(Detector(seed), DataLoader([images(2, seed=3, size=32)] * 2, batch_size=None), ckpt_path=ckpt_path)
    if ckpt_path is None:
        trainer.save_checkpoint(tmp_path / "detector.ckpt")
    return plugin


@pytest.mark.slow
def test_the_conv_plan_is_saved_and_taken_back_on_resume(tmp_path: Any) -> None:
    first = fit_detector(tmp_path, seed=0)
    assert first.quantization.conv_report is not None and first.quantization.layer_modes, "the plan widens some convs"
    resumed = fit_detector(tmp_path, seed=1, ckpt_path=tmp_path / "detector.ckpt")  # another init: measured, it would differ
    assert resumed.quantization.conv_report is None  # not measured: the checkpoint's plan
    assert resumed.quantization.layer_modes == first.quantization.layer_modes


def test_a_model_the_probe_cannot_run_keeps_uniform_convolutions_with_a_warning() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch={"pixel_values": torch.randn(2, 3, 8, 8)})
    with pytest.warns(UserWarning, match="without a measured plan"):
        plugin.quantization.check(model, None)
    assert plugin.quantization.layer_modes is None


def test_the_plans_held_out_warning_is_said_at_the_quantization_when_the_measured_figure_is_not() -> None:
    """The plan's warning that held out such plans measured under the target comes at the quantization, and only when the
    quantized model's own probe figure did not already warn (one warning per fit start, the measured one first)."""
    torch.manual_seed(0)
    model = calibrate(ResNet18(), images(8, seed=10, batches=2, size=32))
    plan = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(4, seed=2, size=32), min_cosine=0.95).quantization
    plan.check(model, None)
    with pytest.warns(UserWarning, match=r"planned to a probe output cosine of 0\.9[5-9]\d+ .*On images the probe never saw"):
        plan.convert(model, None)
    assert plan.conv_accuracy is not None and plan.conv_accuracy.cosine >= 0.95
