"""``LoRA.merge`` of layers whose weight a parametrization or weight_norm computes (``adapters/lora/export.py``),
attacked from outside (session 25): weight_norm over dims 0, 1 and None in both of torch's forms, on a kept Linear and
on a quantized (folded) convolution, with and without ``base_state_dict``; chains; a right_inverse that raises.

Was: a weight_norm followed by another parametrization (its originals ``original0``/``original1``) raised a raw
``AttributeError: 'ParametrizationList' object has no attribute 'original'``; a user's right_inverse that raised
anything but RuntimeError/ValueError/NotImplementedError (an ``assert``) escaped raw, without the refusal's fixes.
``merge`` writes no file: a refusal is checked to leave the model as it was (state, modes, requires_grad).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.nn.utils import weight_norm as hook_weight_norm

from lightning_hbm import LoRA
from lightning_hbm.precision import quantize_model


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / self.s


class Positive(nn.Module):
    """Positive weights as ``exp`` of their logs; its right_inverse asserts (a user's own check)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        assert bool((w > 0).all()), "weights must be positive"
        return w.log()


def _normed(kind: str, dim: Optional[int]) -> Callable[[nn.Module], nn.Module]:
    return lambda layer: (parametrizations.weight_norm if kind == "parametrization" else hook_weight_norm)(layer, dim=dim)


def _weight_norm_then_scale(layer: nn.Module) -> nn.Module:
    parametrizations.weight_norm(layer)
    return parametrize.register_parametrization(layer, "weight", Scale())


def _positive(layer: nn.Module) -> nn.Module:
    with torch.no_grad():
        layer.weight.uniform_(1e-3, 1e-2)  # small: the adapters' update makes some negative
    return parametrize.register_parametrization(layer, "weight", Positive())


class Net(nn.Module):
    def __init__(self, wrap: Callable[[nn.Module], nn.Module], conv: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = conv
        self.p = wrap(nn.Conv1d(8, 8, 3, padding=1) if conv else nn.Linear(16, 16))
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.p(x)))


X = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(5))


def _adapted(wrap: Callable[[nn.Module], nn.Module], conv: bool = False) -> nn.Module:
    model = Net(wrap, conv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4, target_modules=["p", "lin"], modules_to_save=[]).transform_model(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(3))
    return model.eval()


def _merge(model: nn.Module, **kwargs: Any) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DEQUANTIZED: lin is quantized
        return LoRA.merge(model, dtype="float32", **kwargs)


@pytest.mark.parametrize("conv", [False, True], ids=["linear-kept", "conv-folded"])
@pytest.mark.parametrize("dim", [0, 1, None])
@pytest.mark.parametrize("kind", ["parametrization", "hook"])
def test_weight_norm_over_any_dim_merges_into_the_model_as_built(kind: str, dim: Optional[int], conv: bool) -> None:
    model = _adapted(_normed(kind, dim), conv)
    with torch.no_grad():
        want = model(X)
    plain = Net(_normed(kind, dim), conv).eval()
    plain.load_state_dict(_merge(model))  # strict: the factors the model as built holds
    with torch.no_grad():
        torch.testing.assert_close(plain(X), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, None])
@pytest.mark.parametrize("kind", ["parametrization", "hook"])
def test_weight_norm_over_any_dim_merges_onto_the_original_factors(kind: str, dim: Optional[int]) -> None:
    """The update onto the weight the original factors compute (not the 4-bit one)."""
    base = Net(_normed(kind, dim), conv=True).state_dict()
    model = _adapted(_normed(kind, dim), conv=True)
    keys = ("parametrizations.weight.original0", "parametrizations.weight.original1") if kind == "parametrization" else ("weight_g", "weight_v")
    norm_dim = -1 if dim is None else dim

    def weight(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch._weight_norm(state[f"p.{keys[1]}"], state[f"p.{keys[0]}"], norm_dim)

    update = weight(_merge(model)) - model.p.base_layer.weight.float()  # onto the dequantized weight
    torch.testing.assert_close(weight(_merge(model, base_state_dict=base)), weight(base) + update, rtol=1e-5, atol=1e-6)


def test_a_weight_norm_followed_by_another_parametrization_merges_through_the_chain() -> None:
    model = _adapted(_weight_norm_then_scale)
    with torch.no_grad():
        want = model(X)
    merged = _merge(model)
    assert {"p.parametrizations.weight.original0", "p.parametrizations.weight.original1", "p.parametrizations.weight.1.s"} <= set(merged)
    plain = Net(_weight_norm_then_scale).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(X), want, rtol=1e-5, atol=1e-5)


def _state(model: nn.Module) -> tuple:
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        [(n, m.training) for n, m in model.named_modules()],
        {n: p.requires_grad for n, p in model.named_parameters()},
    )


def test_a_right_inverse_that_raises_is_refused_clearly_and_the_model_is_left_as_it_was() -> None:
    model = _adapted(_positive).train()
    before = _state(model)
    with pytest.raises(ValueError, match=r"the weight of p is computed by the parametrization\(s\) \['Positive'\].*right_inverse failed \(AssertionError: weights must be positive\).*Nothing was merged.*exclude_modules=\['p'\]"):
        _merge(model)
    after = _state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:] == after[1:]
