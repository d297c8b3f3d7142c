"""Issue 53 item 2 (session 36): a BatchNorm conv net whose fit-start check measured 32 samples and was quiet is not
cautioned again by ``widened_convs_warning`` (its modes reached the target on the first batch only by widening some
convolutions within ``sensitive_mode``: "on images the probe never saw, such plans measured 0.976-0.982").

Measured over 40 runs (10 conv nets x 4 seeds, ``benchmarks/conv_probe_samples.py --widened``, benchmarks/README.md):
where the check on 32 was quiet the caution fired on 14, 12 of them accurate on 64 held-out images and 2 under 0.98 by
0.0002-0.0003: noise on accurate models. Here transformers' ResNet (10 classes) seed 2 of that table: uniform nf4-dq
0.835 on the first batch, widened to 0.986; the check on the first 32 images 0.986 (held out 0.985): warned on main,
quiet now. With a ``probe_batch`` of 4 images the user gives (the check measures those 4) the caution stays.
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
import transformers as tf
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import CHECK_SAMPLES

sys.path.insert(0, str(Path(__file__).resolve().parent / "layers"))
from conv_models import Pixels, calibrate, images, lightning_net  # noqa: E402

SEED = 2
CAUTION = r"planned to a probe output cosine of 0\.98\d\d \(uniform nf4-dq: 0\.8\d+\)"


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    """The benchmark's transformers ResNet, BatchNorm calibrated on 4 batches of 8 images of 64 px."""
    torch.manual_seed(SEED)
    config = tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)
    return calibrate(Pixels(tf.ResNetForImageClassification(config)), images(8, seed=10 + SEED, batches=4, size=64))


def _batches() -> list[torch.Tensor]:
    """The benchmark's first 8 training batches of 4 images (``probe_images``)."""
    return [images(4, seed=2 + 10 * SEED)] + [images(4, seed=300 + 10 * SEED + j) for j in range(1, 8)]


def _fit(model: nn.Module, plugin: QuantizedPrecision, tmp_path: Any) -> QuantizedPrecision:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[plugin],
    )  # fmt: skip
    trainer.fit(lightning_net(model), DataLoader(_batches(), batch_size=None))
    return cast(QuantizedPrecision, trainer.precision_plugin)


def test_a_widened_plan_whose_check_on_32_samples_is_quiet_is_not_cautioned(resnet: nn.Module, tmp_path: Any) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = _fit(copy.deepcopy(resnet), QuantizedPrecision(), tmp_path)
    report = plugin.quantization.conv_report
    assert report is not None and report.uniform_cosine < 0.9 and report.cosine >= 0.985  # widened to the target
    assert any(mode != "nf4-dq" for mode in report.modes.values())
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.samples == CHECK_SAMPLES and not measured.warned
    assert measured.cosine == pytest.approx(0.986, abs=2e-3)
    said = [str(w.message) for w in caught]
    assert not [m for m in said if "planned to a probe output cosine" in m], said


def test_a_widened_plan_checked_on_the_4_images_the_user_gives_is_still_cautioned(resnet: nn.Module, tmp_path: Any) -> None:
    with pytest.warns(UserWarning, match=CAUTION):
        plugin = _fit(copy.deepcopy(resnet), QuantizedPrecision(probe_batch=_batches()[0]), tmp_path)
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.samples == 4 and not measured.warned
