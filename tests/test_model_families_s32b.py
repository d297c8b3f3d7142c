"""Issue 53, "What must show", checked again on current main (session 32): what failed, fixed, each a test here.

A LightningModule without ``forward`` (Lightning trains through ``training_step``, which calls ``self.model``: the most
common way to write one) got no convolution plan at all: every convolution uniform nf4-dq, and a warning naming a
figure of another model and a fix that does not help ("pass QuantizedPrecision(probe_batch=...) the model's forward
takes": there is no forward). transformers' ResNetForImageClassification (ResNet18 layout, BatchNorm calibrated on 4
batches of 64 px images) so measured 0.78 output cosine held out against fp32 in the library's default
(``QuantizedPrecision()`` + LoRA + checkpointing). Now the training_step runs once on the probe batch and the submodule
it calls that holds every layer measured is planned and measured on the inputs the step gave it: 0.971 held out at
0.620 bytes per conv weight, and the plan's warning with the figure and the fix (measured from outside in session 32,
figures in its report).
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import QuantizedPrecision
from tests.layers.conv_models import calibrate, images

transformers = pytest.importorskip("transformers")


def resnet() -> nn.Module:
    config = transformers.ResNetConfig(layer_type="basic", depths=[1, 1], hidden_sizes=[16, 32], embedding_size=16, num_labels=5)
    torch.manual_seed(0)
    return calibrate(transformers.ResNetForImageClassification(config), images(8, seed=10, batches=2, size=32))


class Classify(pl.LightningModule):
    """No forward: the training_step calls the model (and logs), as most LightningModules do."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        pixels, labels = batch
        loss = self.model(pixel_values=pixels, labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)


class TwoParts(Classify):
    """No forward, and the step calls two submodules that both hold convolutions: no one submodule to measure."""

    def __init__(self) -> None:
        super().__init__(resnet())
        self.head = nn.Conv2d(3, 3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(pixel_values=self.head(batch[0])).logits, batch[1])


def fit(module: pl.LightningModule, plugin: QuantizedPrecision) -> list[str]:
    batch = (images(4, seed=2, size=32), torch.tensor([0, 1, 2, 3]))
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[plugin],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([batch], batch_size=None))
    assert trainer.global_step == 1
    return [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]


def test_a_lightning_module_without_forward_gets_its_convolutions_planned_and_measured() -> None:
    module = Classify(resnet())
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")
    said = fit(module, plugin)
    assert not [s for s in said if "without a measured plan" in s], said  # was: uniform nf4-dq, "Classify defines no forward"
    report, accuracy = plugin.quantization.conv_report, plugin.quantization.conv_accuracy
    assert report is not None and report.cosine >= 0.985 > report.uniform_cosine, report  # planned on model(pixel_values=...)
    assert accuracy is not None and accuracy.cosine == accuracy.cosine  # measured after the quantization too
    assert "forward" not in vars(module) and "log" not in vars(module)  # nothing left on the user's module
    assert "train_loss" in module.trainer.callback_metrics  # its self.log works again after the probe


def test_a_step_calling_two_submodules_that_hold_convolutions_is_said_with_the_fix() -> None:
    module = TwoParts()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")
    said = fit(module, plugin)
    assert plugin.quantization.conv_report is None
    why = "without a measured plan (TwoParts defines no forward for the probe batch, and no one of its submodules holds every layer"
    assert any(why in s and "define TwoParts.forward" in s for s in said), said
    assert "forward" not in vars(module)


def test_mobilenet_v2_same_padding_reads_its_conv_attributes_during_the_plan() -> None:
    """Was: ``AttributeError: '_SameDtype' object has no attribute 'stride'`` at fit start (transformers MobileNetV2's
    "SAME" padding reads the conv's stride, kernel_size and dilation; the plan's quantized copy did not have them), and,
    once it ran, a plan "to a probe output cosine of nan" (its 32 px output is [N, 1280, 1, 1]: rows of one value)."""
    torch.manual_seed(0)
    model = calibrate(transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.35)),
                      images(8, seed=10, batches=2, size=32))  # fmt: skip
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch={"pixel_values": images(4, seed=2, size=32)})
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        plugin.quantization.check(model, None)
    report = plugin.quantization.conv_report
    assert report is not None and 0 < report.uniform_cosine < report.cosine <= 1, report


def test_qwen2_vl_patch_embedding_conv_is_stored_quantized_and_adapted(tmp_path: Any) -> None:
    """Was: kept in the compute dtype, "weight read directly by PatchEmbed.forward" (it reads ``proj.weight.dtype``
    only, and a quantized convolution's weight reads as its dequantized weight in the compute dtype)."""
    from lightning_hbm import ActivationCheckpointing, LoRA
    from lightning_hbm.layers import base_layer, coverage, stored_in
    from tests.planner.test_plan_fallbacks import TinyQwen2VL, qwen2_vl_batch

    torch.manual_seed(0)
    module, batch = TinyQwen2VL(), qwen2_vl_batch()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision()],
        callbacks=[LoRA(r=8, alpha=16), ActivationCheckpointing()],
    )  # fmt: skip
    trainer.fit(module, DataLoader([batch, batch], batch_size=None))
    assert trainer.global_step == 2
    proj = module.get_submodule("model.model.visual.patch_embed.proj")
    assert stored_in(base_layer(proj)) is not None and hasattr(proj, "lora_A")
    assert proj.lora_B["default"].weight.abs().sum() > 0  # trained
    (conv,) = [r for r in coverage(module, quantizing=True, adapting=True) if r.kind == "Conv"]
    assert conv.quantized == conv.params and conv.reasons == {}, conv


@pytest.mark.slow
def test_recurrent_gemma_trains_resumes_bit_exact_and_plans(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53 item 1's second model (its ``conv_1d`` stored quantized: ``tests/layers/test_readers.py``), through the
    default recipe end to end: trains, resumes bit-exact from the mid-run checkpoint, plans with no fallback."""
    from tests import test_model_families_s29 as s29

    family = s29.Family(s29.transformers_model("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", **s29.IDS, hidden_size=s29.WIDTH,
                                               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, lru_width=s29.WIDTH,
                                               attention_window_size=16, conv1d_width=4, block_types=["recurrent", "attention"]),
                        s29.lm_loss, s29.tokens, causal=True)  # fmt: skip
    monkeypatch.setitem(s29.FAMILIES, "recurrent_gemma", family)
    s29.test_family_trains_resumes_and_plans_with_the_default_recipe("recurrent_gemma", tmp_path)


class Manual(Classify):
    """No forward, manual optimization: its step needs the optimizers, which the probe batch's measurement has not."""

    def __init__(self) -> None:
        super().__init__(resnet())
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        loss = self.model(pixel_values=batch[0], labels=batch[1]).loss
        self.manual_backward(loss)
        optimizer.step()


def test_a_step_that_cannot_run_to_its_end_before_the_fit_is_measured_on_the_calls_it_made() -> None:
    """Its manual_backward fails on the measurement's no-grad run: the model's call before it is measured, the fit runs."""
    module, plugin = Manual(), QuantizedPrecision("nf4-dq", dtype="float32")
    said = fit(module, plugin)
    assert plugin.quantization.conv_report is not None and not [s for s in said if "without a measured plan" in s], said
    assert "forward" not in vars(module)
