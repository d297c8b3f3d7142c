"""A fake tensor the probe step stored INTO a container the model already had (``self._cache[key] = ...``) is taken out.

Was (session 30): :func:`dropping_fake_leftovers` put back module attributes the step *replaced* with something
holding a fake tensor, but not a dict or list attribute the step *filled in place*: a model caching its position
table in a dict by sequence length got the fake table back at every real forward after the probe step (fake outputs
in the fit), the failure the module was written to prevent.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_hbm.layers import find_layers, readers
from lightning_hbm.layers.fake_leftovers import dropping_fake_leftovers, holds_fake


class DictCached(nn.Module):
    """A linear layer plus a bias cached in a dict (by batch size) and in a list (each one computed)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self._cache: dict[int, torch.Tensor] = {}
        self._seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n not in self._cache:
            self._cache[n] = torch.arange(8, dtype=torch.float32) * n
            self._seen.append(self._cache[n])
        return self.proj(x) + self._cache[n]


def test_a_fake_tensor_put_into_an_existing_dict_or_list_is_taken_out() -> None:
    model = DictCached()
    seen = readers.observe(model, torch.randn(2, 8), {n: m for n, m, _ in find_layers(model)})
    assert seen is not None and seen.ran.endswith("on fake tensors"), seen
    assert model._cache == {} and model._seen == []  # was: the fake bias cached under batch size 2
    out = model(torch.randn(2, 8))
    assert type(out) is torch.Tensor and not holds_fake(out)


def test_what_the_user_cached_before_stays() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = DictCached()
    model(torch.randn(3, 8))  # a real entry for batch size 3, cached before the step
    real = model._cache[3]
    with dropping_fake_leftovers(model), FakeTensorMode(allow_non_fake_inputs=True):
        model(torch.randn(2, 8))
    assert list(model._cache) == [3] and model._cache[3] is real and model._seen == [real]
