"""The fit-start accuracy check of a model with quantized convolutions, in any mode (``precision/accuracy.py``), and
the sensitivity plan on layers whose weight the model's code reads directly (``precision/read_layers.py``), session 24.

Was: ``QuantizedPrecision(mode="int8")`` computing in bf16 gave the MobileNetV3-FPN backbone a held-out output cosine
of 0.974-0.979 (benchmarks/README.md, session 23) with no word at fit start; and a plan with a target failed on a
Swin-like model (``'_SameDtype' object has no attribute 'weight'``), its read attention layers never measured.
"""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers.read_weight import ReadableLinear
from lightning_hbm.surgery import run_surgery

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
from conv_models import MobileNetV3FPN, calibrate, images  # noqa: E402
from swin_models import SmallSwin, batch, read_layers  # noqa: E402

WARNED = r"with its 66 convolutions stored quantized \(66 in int8; mode .int8.; its other quantized layers as planned\) and computing in bfloat16, this model's output on the probe batch has a cosine of 0\.97\d\d against the model as built \(centred, every output\), under 0\.98 .*Fix: QuantizedPrecision\(\.\.\., dtype='float32'\)"


@pytest.fixture(scope="module")
def backbone() -> nn.Module:
    """torchvision's Faster R-CNN MobileNetV3-FPN backbone layout, BatchNorm statistics calibrated on images (as
    benchmarks/conv_default.py, seed 0)."""
    torch.manual_seed(0)
    return calibrate(MobileNetV3FPN(), images(8, seed=10, batches=4))


def _convert(model: nn.Module, plugin: QuantizedPrecision) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(copy.deepcopy(model))
    return [str(w.message) for w in seen if "convolutions stored quantized" in str(w.message)]


def test_int8_in_bf16_on_a_batchnorm_conv_net_is_warned_with_the_figure_and_the_fix(backbone: nn.Module) -> None:
    plugin = QuantizedPrecision("int8", probe_batch=images(4, seed=2))
    with pytest.warns(UserWarning, match=WARNED):
        plugin.convert_module(copy.deepcopy(backbone))
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and 0.97 < measured.cosine < 0.98 and measured.threshold == 0.98


class _Backbone(pl.LightningModule):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.model(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return sum(level.float().square().mean() for level in self(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_a_fit_measures_on_the_loaders_first_batch_and_warns_at_fit_start(backbone: nn.Module, tmp_path: Any) -> None:
    """The Trainer's own path: the probe is the train loader's first batch; the RNGs are as they were after it."""
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("int8")],
    )  # fmt: skip
    with pytest.warns(UserWarning, match=WARNED):
        trainer.fit(_Backbone(copy.deepcopy(backbone)), DataLoader([images(4, seed=2)], batch_size=None))
    measured = cast(QuantizedPrecision, trainer.precision_plugin).quantization.conv_accuracy
    assert measured is not None and measured.cosine < 0.98


def test_the_fix_named_is_quiet_and_measured_above_the_threshold(backbone: nn.Module) -> None:
    plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=images(4, seed=2))
    assert not _convert(backbone, plugin)
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.cosine >= 0.99


def test_a_model_without_convolutions_is_measured_too_and_quiet_above_the_threshold() -> None:
    """Since session 32 every quantized model is measured (was: not measured, ``conv_accuracy`` None)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))
    plugin = QuantizedPrecision("int8", probe_batch=torch.randn(4, 16))
    assert not _convert(model, plugin)
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.cosine >= 0.98 and not measured.warned


def test_the_4bit_plan_reference_is_reused_not_run_again(backbone: nn.Module) -> None:
    """The convolutions' plan runs the model as built first: that forward is the check's reference (no forward more)."""
    calls = []
    model = copy.deepcopy(backbone)
    model.register_forward_hook(lambda m, args, out: calls.append(m.outer[0].__class__.__name__))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=images(4, seed=2), sensitive_mode="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.quantization.check(model, None)
        before = len(calls)
        plugin.quantization.convert(model, None)
    assert plugin.quantization.conv_report is not None and plugin.quantization.conv_accuracy is not None
    assert len(calls) == before + 1  # the quantized model, once


def test_the_plan_measures_and_widens_layers_whose_weight_is_read_directly() -> None:
    """Swin's attention passes ``qkv.weight`` / ``proj.weight`` to ``F.linear``: the plan swapped in a copy without
    a ``weight`` (AttributeError) and its forward hooks never saw those layers' inputs."""
    torch.manual_seed(0)
    module = SmallSwin()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", min_cosine=0.999, probe_batch=batch(5, size=16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_surgery(module, plugin, [], batch=batch())
    report, read = plugin.sensitivity_report, read_layers(module)
    assert report is not None and report.cosine >= 0.999 > report.uniform_cosine
    assert all(report.solo_error[name] > 0 for name in read)
    widened = [name for name in read if report.modes[name] != "nf4-dq"]
    assert widened and all(isinstance(module.get_submodule(name), ReadableLinear) for name in widened)
    assert torch.isfinite(module.training_step(batch(7), 0))  # the widened read layers serve the attention's reads


def test_the_figure_keeps_a_bounded_strided_subset_of_large_outputs() -> None:
    """A language model with a convolution (Mamba's conv1d) gives logits of hundreds of millions of values."""
    from lightning_hbm.precision.accuracy import KEPT_VALUES, outputs

    big = {"logits": torch.arange(3 * KEPT_VALUES + 5, dtype=torch.float32), "steps": torch.arange(4)}
    kept = outputs(big)
    assert kept.numel() <= KEPT_VALUES and torch.equal(kept[:3], torch.tensor([0.0, 4.0, 8.0]))
    assert outputs([torch.ones(2, 3), torch.zeros(4, dtype=torch.bfloat16)]).tolist() == [1.0] * 6 + [0.0] * 4
