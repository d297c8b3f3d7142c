"""A convolution subclass with its own forward is no plain convolution (issue 53, session 30).

Was: transformers BiT's ``WeightStandardizedConv2d`` (it standardizes its weight and pads its input itself for
``padding="SAME"``) was quantized as a plain ``nn.Conv2d``, which dropped both: BiT stopped at its first step ("The
size of tensor a (2) must match the size of tensor b (3)" in the residual sum), and where the shapes happen to agree
the model silently computed something else. Now such a convolution is kept as built, with its reason in the coverage
table, and left out of LoRA's 'all-linear' (peft's Conv LoRA would add an unpadded adapter to a padded output), as an
``nn.Linear`` subclass with its own forward already was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import LoRA
from lightning_hbm.layers import QuantizedConv2d, coverage, weight_readers
from lightning_hbm.precision import quantize_model


class Standardized(nn.Conv2d):
    """Weight standardization, same padding: the shapes of a plain convolution, other values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding)


class Counted(nn.Conv2d):
    """Its own forward, the plain convolution's values: an ordinary convolution."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counted.calls += 1
        return super().forward(x)


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Standardized(3, 64, 3, padding=1), nn.ReLU(), Counted(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 8, 1))


def test_a_convolution_computing_something_else_is_kept_as_built() -> None:
    model, x = net(), torch.randn(2, 3, 8, 8)
    want = model(x)
    assert set(weight_readers(model)) == {"0"}
    assert weight_readers(model)["0"] == "Standardized.forward (an nn.Conv2d subclass with its own forward)"
    quantize_model(model, "nf4-dq", dtype="float32")
    assert type(model[0]) is Standardized and isinstance(model[2], QuantizedConv2d)  # was: model[0] a QuantizedConv2d too
    (row,) = [r for r in coverage(model, quantizing=True, adapting=False) if r.kind == "Conv"]
    assert any("Standardized.forward" in reason for reason in row.reasons), row.reasons
    got = model(x)
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.95  # was 0.81: no standardization


def test_lora_leaves_it_out_with_dropout() -> None:
    """Session 31: adapted by a delta of its weight (``tests/adapters/lora/test_weight_delta_s31.py``), except with
    dropout (it acts on the input, which a weight delta cannot)."""
    model = net()
    lora = LoRA(r=4, dropout=0.1)
    lora.transform_model(model)
    assert "0" not in lora.adapted_modules and "2" in lora.adapted_modules


def test_bit_trains_a_step() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, layer_type="preactivation",
                                    global_padding="SAME", num_groups=4)  # fmt: skip
    model = transformers.BitForImageClassification(config)
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    want = model(pixel_values=x).logits
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4).transform_model(model)
    out = model(pixel_values=x, labels=labels)  # was: RuntimeError (the dynamic SAME padding dropped)
    out.loss.backward()
    assert F.cosine_similarity(out.logits.flatten(), want.flatten(), dim=0) > 0.98  # every conv kept as built (the head quantized)


def test_a_model_of_such_convolutions_only_is_refused_by_lora_saying_why() -> None:
    """BiT's every convolution is a ``WeightStandardizedConv2d`` and its classifier is trained in full: with dropout
    (session 31: without, they are adapted by their weight) 'all-linear' finds nothing to adapt. Was: the error listed
    exactly those convolutions as "available"; now it says why they are not, and the fix."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, layer_type="preactivation",
                                    global_padding="SAME", num_groups=4)  # fmt: skip
    with pytest.raises(ValueError, match=r"selects no Linear layer of BitForImageClassification.* 9 are no target: .*own forward.*"
                       r"WeightStandardizedConv2d\.forward .*LoRA\(dropout=0\.0\) adapts 9 of them.*train it without the LoRA callback"):  # fmt: skip
        LoRA(r=4, dropout=0.1, modules_to_save=["classifier"]).transform_model(transformers.BitForImageClassification(config))
