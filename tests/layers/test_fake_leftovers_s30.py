"""What the probe step on fake tensors left in a real model (issue 53, session 30): nothing fake stays cached.

Was: transformers BEiT (and Data2Vec-Vision, DINOv3, DETR, RT-DETR, Mask2Former, SAM 2, ...: 26 model folders of
transformers 5.25) caches its relative-position index with ``compile_compatible_method_lru_cache``, keyed by the
module; the probe step computed it on fake tensors, and every real forward after got the fake index back: the fit's
gradients were fake tensors, and the first read of one stopped it (``DataDependentOutputException``).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_hbm.layers import find_layers, readers
from lightning_hbm.layers.fake_leftovers import dropping_fake_leftovers, holds_fake, model_caches


class Cached(nn.Module):
    """A linear layer plus a position bias the module caches twice: an lru_cache on a method, and an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    @functools.lru_cache(maxsize=2)  # noqa: B019 - the model's own cache, as transformers' BEiT has it
    def index(self, size: int) -> torch.Tensor:
        return torch.arange(size, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "mask"):
            self.mask = torch.ones(x.shape[-1])  # a plain attribute set by the first forward
        return self.proj(x) + self.index(x.shape[-1]) * self.mask


def test_the_probe_step_leaves_no_fake_tensor_cached() -> None:
    Cached.index.cache_clear()
    model = Cached()
    real = Cached()  # another instance's cached entry, computed before the probe: its results stay correct
    real(torch.randn(2, 8))
    assert Cached.__dict__["index"] in model_caches(model)
    seen = readers.observe(model, torch.randn(2, 8), {n: m for n, m, _ in find_layers(model)})
    assert seen is not None and seen.ran.endswith("on fake tensors"), seen
    assert not hasattr(model, "mask")  # set by the fake step only: removed
    out = model(torch.randn(2, 8))
    assert type(out) is torch.Tensor and not holds_fake(out)  # was: a FakeTensor (the cached fake index)
    assert type(real(torch.randn(2, 8))) is torch.Tensor


def test_an_attribute_the_step_replaced_with_a_fake_one_is_put_back() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = Cached()
    model.mask = torch.ones(8)
    model.other = {"scale": 2.0}
    before = model.mask
    with dropping_fake_leftovers(model), FakeTensorMode(allow_non_fake_inputs=True):
        model.mask = torch.zeros(8)  # fake
        model.other = {"scale": torch.zeros(1)}  # a fake tensor inside a dict
        model.kept = 3  # no tensor: stays
    assert model.mask is before and model.other == {"scale": 2.0} and model.kept == 3


def test_beit_trains_after_the_probe_step() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BeitConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=16,
                                     patch_size=8, num_labels=3, use_relative_position_bias=True)  # fmt: skip
    model = transformers.BeitForImageClassification(config)
    x = torch.randn(2, 3, 16, 16)
    readers.observe(model, x, {n: m for n, m, _ in find_layers(model)})
    out = model(pixel_values=x).logits
    assert type(out) is torch.Tensor and torch.isfinite(out).all()


@functools.lru_cache(maxsize=4)
def centers(size: int) -> torch.Tensor:  # a function of the model's Python module, cached by its arguments (DINOv3)
    return torch.arange(size, dtype=torch.float32) / size


class Centered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + centers(x.shape[-1])


def test_a_cached_function_of_the_models_python_module_is_emptied_too() -> None:
    """Was: DINOv3's ``get_patches_center_coordinates`` (cached by sizes, dtype and device) kept the probe's fake
    result, and every real forward of that shape got it back."""
    centers.cache_clear()
    model = Centered()
    readers.observe(model, torch.randn(2, 8), {n: m for n, m, _ in find_layers(model)})
    assert type(model(torch.randn(2, 8))) is torch.Tensor
