"""The probe step that reads which layers' weights the model's code reads (``readers.observe``) leaves the model's
buffers as it found them: the buffers a forward creates or replaces too, not only those it writes in place
(session 30 review of session 29's buffer restore)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hbm.layers import readers


class _Created(nn.Module):
    """Registers its statistic as None and creates it on its first forward (a norm started on the first batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mean", None)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            self.mean = x.mean(0).detach()
        self.steps = self.steps + 1  # replaced, not written in place
        return self.fc(x - self.mean)


def test_a_buffer_the_probe_creates_or_replaces_is_put_back() -> None:
    """Was: on fake tensors, the forward's ``self.mean = ...`` left a FakeTensor in the model as its buffer (every
    later forward computed on it), and ``self.steps = self.steps + 1`` left a fake count in place of the real one."""
    torch.manual_seed(0)
    module = _Created()
    steps = module.steps
    seen = readers.observe(module, torch.randn(3, 4), {"fc": module.fc})
    assert seen is not None and seen.ran.endswith("on fake tensors")
    assert module.mean is None and "mean" in module._buffers
    assert module.steps is steps and int(steps) == 0
    assert not any(isinstance(b, torch._subclasses.fake_tensor.FakeTensor) for b in module.buffers())


class _Registered(nn.Module):
    """Registers a new, non-persistent buffer on its first forward (a cache of the first batch's width)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "scale"):
            self.register_buffer("scale", torch.ones(x.shape[-1]), persistent=False)
        return self.fc(x * self.scale)


def test_a_buffer_the_probe_registers_is_removed() -> None:
    """Was: a buffer registered by the probe's forward stayed, a FakeTensor, and not persistent-listed as it was."""
    module = _Registered()
    readers.observe(module, torch.randn(3, 4), {"fc": module.fc})
    assert "scale" not in module._buffers and "scale" not in module._non_persistent_buffers_set
    out = module(torch.randn(3, 4))  # the model's own first forward creates it, real
    assert type(module.scale) is torch.Tensor and type(out) is torch.Tensor


class _Lazy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.head = nn.Linear(4, 4), nn.LazyLinear(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def test_a_model_with_lazy_layers_is_not_probed_and_still_builds_them_itself() -> None:
    """Was: the fake-tensor attempt built the lazy layer's weight as a fake tensor (the layer became a Linear), the
    real attempts then failed, and so did every later forward of the model: "Cannot copy out of meta tensor"."""
    module = _Lazy()
    with pytest.warns(UserWarning, match=r"has lazy layers whose parameters are not built yet \(head\).*run one forward"):
        assert readers.observe(module, torch.randn(3, 4), {"fc": module.fc}) is None
    assert isinstance(module.head, nn.LazyLinear)
    assert type(module(torch.randn(2, 4))) is torch.Tensor and module.head.weight.shape == (3, 4)
