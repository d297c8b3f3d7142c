"""docs/extending.md's counts: a quantized format is one file, and so is a layer kind (issue 35).

Each toy below is one file, written under ``tmp_path`` and imported as the module it would be inside the package
(``lightning_hbm.precision.toy_format``, ``lightning_hbm.layers.toy_kind``): no other file is edited, yet the format
and the kind show up in quantization (``quantize_model``), in the coverage table and in the planner's parameter
bytes. (In the package a format's file is found by ``precision/__init__.py``'s ``pkgutil`` loop; a kind's file also
gets its import line in ``layers/__init__.py``, which fixes its place in the matching order: docs/extending.md.)
The memory term's count is proved in ``tests/memory/``.
"""

from __future__ import annotations

import copy
import importlib.util
import textwrap
from pathlib import Path
from types import ModuleType

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import coverage, find_layers, kind_of, kinds, layer_kinds
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import quantized_parameter_bytes
from lightning_hbm.precision import available_precisions, format_of, get_format, registry

TOY_FORMAT = '''
"""A toy quantized format: int8 weights with one float32 scale per output row (absmax), computed dequantized."""
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from lightning_hbm.precision import QuantFormat, register_format


class RowInt8Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype), self.bias)


class RowInt8Format(QuantFormat):
    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, RowInt8Linear)

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return (module.weight.float() * module.scale).to(dtype or torch.float32)

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        return [module.scale]


def quantize(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    weight = linear.weight.detach().to(device=device, dtype=torch.float32)
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
    layer = RowInt8Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    layer.weight = nn.Parameter((weight / scale).round().to(torch.int8), requires_grad=False)
    layer.register_buffer("scale", scale)
    layer.bias = linear.bias
    return layer


FORMAT = register_format(RowInt8Format("toy-int8", quantize, (torch.float32, torch.bfloat16), "int8, a scale per row (a toy)"))
'''

TOY_KIND = '''
"""A toy layer kind: a module multiplying by its ``weight`` [out, in] in its own code, which no other kind knows."""
import torch
from torch import nn

from lightning_hbm.layers import LayerKind, register_kind


class MyLayer(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def as_linear(m: MyLayer) -> nn.Linear:
    linear = nn.Linear(m.n_in, m.n_out, bias=False, device="meta")
    linear.weight = nn.Parameter(m.weight.detach(), requires_grad=False)
    return linear


KIND = register_kind(LayerKind(
    name="MyKind", matches=lambda m: isinstance(m, MyLayer), to_linear=as_linear,
    adaptable_names=lambda m: [], features=lambda m: (m.n_in, m.n_out),
    quantized_as="the mode's Linear holding its weight", adapted_as="not adapted", planned_as="the mode's layer",
    modules="`MyLayer`", found_in="tests", option="QuantizedPrecision(...)",
))
'''


class Wrapped(pl.LightningModule):
    """The planner plans LightningModules: the smallest one around ``model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def load(name: str, path: Path, source: str) -> ModuleType:
    """Write ``source`` to ``path`` and import it as module ``name`` (not put in ``sys.modules``: gone after the test)."""
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies of the format and kind registries for the test: what a toy registers is gone afterwards."""
    monkeypatch.setattr(registry, "_MODES", dict(registry._MODES))
    monkeypatch.setattr(kinds, "_KINDS", dict(kinds._KINDS))


@pytest.mark.parametrize("module_name", ["lightning_hbm.precision.toy_format", "my_project.toy_format"])
def test_a_format_is_one_file(tmp_path: Path, registries: None, module_name: str) -> None:
    """Inside the package, or in the user's own package (its layer is then not taken for a Linear subclass with a
    forward of its own: the format owns it)."""
    assert "toy-int8" not in available_precisions()
    toy = load(module_name, tmp_path / "toy_format.py", TOY_FORMAT)
    assert "toy-int8" in available_precisions() and get_format("toy-int8") is toy.FORMAT
    torch.manual_seed(0)
    model = Wrapped(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 8)))
    x = torch.randn(4, 32)
    expected = model(x)
    planned = quantized_parameter_bytes(copy.deepcopy(model), "toy-int8", "float32")  # the planner, on fake tensors

    # quantization: every Linear is stored in the toy format (8 outputs: no vocabulary head), close to before
    assert quantize_model(model, "toy-int8", dtype="float32") == ["model.0", "model.2", "model.4"]
    assert format_of(model.model[0]) is toy.FORMAT and model.model[0].weight.dtype == torch.int8
    torch.testing.assert_close(model(x), expected, atol=1e-2, rtol=1e-2)
    # coverage: counted as quantized Linear weights, at their stored size
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
    assert rows["Linear"].quantized == rows["Linear"].params == 2 * 32 * 64 + 32 * 8 + 64 + 32 + 8  # (with their biases)
    assert rows["Linear"].bytes == parameter_bytes(model)
    # the planner: the same bytes, predicted without allocating
    # int8 weights; an fp32 scale per row (its constants) and fp32 biases
    assert planned == parameter_bytes(model) == 2 * 32 * 64 + 32 * 8 + 2 * (64 + 32 + 8) * 4


def test_a_layer_kind_is_one_file(tmp_path: Path, registries: None) -> None:
    toy = load("lightning_hbm.layers.toy_kind", tmp_path / "toy_kind.py", TOY_KIND)
    assert layer_kinds()[-1] is toy.KIND  # registered last: it matches after the kinds imported before it
    torch.manual_seed(0)
    model = Wrapped(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), toy.MyLayer(64, 128), nn.ReLU(), nn.Linear(128, 8)))
    assert [(name, kind.name) for name, _, kind in find_layers(model)] == [("model.0", "Linear"), ("model.2", "MyKind"), ("model.4", "Linear")]
    h = torch.randn(4, 64)
    expected = model.model[2](h)
    planned = quantized_parameter_bytes(copy.deepcopy(model), "nf4", "float32")

    # quantization: the kind's weight is stored in the mode's layer, which computes what the layer did, nf4-rounded
    assert quantize_model(model, "nf4", dtype="float32") == ["model.0", "model.2", "model.4"]
    assert not model.model[2].weight.is_floating_point() and kind_of(model.model[2]) is toy.KIND  # still counted as MyKind
    error = (model.model[2](h) - expected).norm() / expected.norm()
    assert 0 < error < 0.15
    # coverage: its own row, quantized
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
    assert rows["MyKind"].quantized == rows["MyKind"].params == 64 * 128
    # the planner: its bytes exact, through the same quantize_model on fake tensors
    assert planned == parameter_bytes(model)
