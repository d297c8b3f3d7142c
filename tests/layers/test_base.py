"""The layer-kind protocol (``lightning_hbm/layers/kinds.py``): a kind is one registration, and everything generic
(quantization, LoRA names, coverage, the sensitivity byte prediction, the docs' kind table) follows it.

``layers/base.py``, where all of it lived, is split by job (issue 54): it stays a face that defines nothing."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from lightning_hbm import quantize_model, record
from lightning_hbm.layers import (
    CONV,
    LINEAR,
    MULTIHEAD_ATTENTION,
    LayerKind,
    adaptable_names,
    base,
    coverage,
    find_layers,
    format_coverage,
    kind_names,
    kind_table,
    kinds,
    layer_kinds,
    prepare_model,
    register_kind,
)
from lightning_hbm.precision.sensitivity import predict_parameter_bytes, weight_bytes

ADAPTERS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


class RawWeight(nn.Module):
    """A layer of no registered kind: ``x @ weight.T`` with a raw Parameter, its sizes under its own names."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.n_in, self.n_out = n_in, n_out
        self.weight = nn.Parameter(torch.randn(n_out, n_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _raw_as_linear(layer: nn.Module) -> nn.Linear:
    linear = nn.Linear(layer.n_in, layer.n_out, bias=False, device="meta")
    linear.weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
    return linear


def raw_kind(**changes: object) -> LayerKind:
    kind = LayerKind(
        name="RawWeight",
        matches=lambda m: isinstance(m, RawWeight),
        to_linear=_raw_as_linear,
        adaptable_names=lambda m: [],  # peft has no layer for it
        features=lambda m: (m.n_in, m.n_out),
        quantized_as="the mode's Linear holding the raw weight",
        adapted_as="not adapted",
        option="QuantizedPrecision(...)",
        modules="`RawWeight`",
        found_in="tests",
        planned_as="the mode's layer",
    )
    return dataclasses.replace(kind, **changes)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, LayerKind]]:
    """A copy of the registry for the test: a kind registered here is gone afterwards."""
    registered = dict(kinds._KINDS)
    monkeypatch.setattr(kinds, "_KINDS", registered)
    yield registered


@pytest.fixture
def raw_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), RawWeight(64, 128))


def test_the_docs_kind_table_is_the_registry() -> None:
    text = ADAPTERS_PAGE.read_text()
    found = re.search(r"<!-- kind-table[^>]*-->\n(.*?)\n<!-- /kind-table -->", text, re.DOTALL)
    assert found, "docs/adapters.md lost its <!-- kind-table --> markers"
    assert found.group(1) == kind_table(), (
        "docs/adapters.md's kind table differs from the registry: paste the output of "
        "python -c 'from lightning_hbm.layers import kind_table; print(kind_table())'"
    )
    assert len(kind_table().splitlines()) == 2 + len(layer_kinds()) == 9


def test_a_new_kind_is_one_registration(registry: dict[str, LayerKind], raw_model: nn.Module) -> None:
    x = torch.randn(4, 64)
    expected = raw_model(x)
    assert [name for name, _, _ in find_layers(raw_model)] == ["0"]  # unknown before its registration
    assert "RawWeight" not in kind_table()

    kind = register_kind(raw_kind())
    assert [(name, k.name) for name, _, k in find_layers(raw_model)] == [("0", "Linear"), ("2", "RawWeight")]
    assert "| `RawWeight` | tests |" in kind_table() and kind_names().endswith("RawWeight")
    assert adaptable_names(raw_model) == ["0"]  # its adaptable_names, not a hard-coded rule
    # the sensitivity plan's byte prediction asks the kind for the stored Linear's features
    dtype_bytes = 64 * 64 * 2 + 64 * 2  # the unplanned Linear (weight + bias) in bf16
    assert predict_parameter_bytes(raw_model, {"2": "nf4"}) == dtype_bytes + weight_bytes("nf4", 64, 128, torch.bfloat16)

    quantized = quantize_model(raw_model, "nf4", dtype="float32", ignore_modules=["0"])
    assert quantized == ["2"]
    new = raw_model[2]
    assert not new.weight.is_floating_point() and record.counted_as(new) == kind.name  # still counted as RawWeight
    rows = {r.kind: r for r in coverage(raw_model, quantizing=True, adapting=False)}
    assert rows["RawWeight"].quantized == rows["RawWeight"].params == 64 * 128
    assert rows["Linear"].quantized == 0 and "RawWeight" in format_coverage(list(rows.values()))
    error = (raw_model(x) - expected).norm() / expected.norm()
    assert 0 < error < 0.15  # the same map, nf4-rounded (relative error ~0.09, verified-facts.md)


def test_registration_errors_change_nothing(registry: dict[str, LayerKind]) -> None:
    before = list(registry)
    with pytest.raises(ValueError, match=r"Layer kind 'Linear' is already registered\."):
        register_kind(raw_kind(name="Linear"))
    with pytest.raises(ValueError, match=r"Layer kind 'RawWeight': \{'found_in': 'a \| b'\} contain '\|' or a line break.*Reword"):
        register_kind(raw_kind(found_in="a | b"))
    with pytest.raises(ValueError, match=r"'planned_as': 'one\\nrow'"):
        register_kind(raw_kind(planned_as="one\nrow"))
    assert list(registry) == before


def test_each_kind_names_what_lora_adapts() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "fc": nn.Linear(8, 8),
        "attn": nn.MultiheadAttention(8, 2),
        "conv": nn.Conv2d(8, 8, 3),
        "depthwise": nn.Conv2d(8, 8, 3, groups=8),
    })
    # MultiheadAttention: the q/k/v projections it will get, plus its out_proj (a Linear); no grouped convolution
    assert sorted(adaptable_names(model)) == ["attn.k_proj", "attn.out_proj", "attn.q_proj", "attn.v_proj", "conv", "fc"]
    assert prepare_model(model) == ["attn"]
    assert sorted(adaptable_names(model)) == ["attn.k_proj", "attn.out_proj", "attn.q_proj", "attn.v_proj", "conv", "fc"]
    kinds = {name: kind for name, _, kind in find_layers(model)}
    assert {n: kinds[n] for n in ("fc", "conv", "attn.q_proj", "attn.out_proj")} == {
        "fc": LINEAR, "conv": CONV, "attn.q_proj": MULTIHEAD_ATTENTION, "attn.out_proj": MULTIHEAD_ATTENTION,
    }


def test_prepare_runs_the_kinds_after_prepare_once() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
    assert encoder.use_nested_tensor  # the fast path reading the raw in_proj weights
    assert prepare_model(encoder) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert not encoder.use_nested_tensor
    assert prepare_model(encoder) == []  # idempotent: the replacement's Linears are not prepared again


def test_sensitivity_bytes_ask_each_kind_for_its_features() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"c_fc": Conv1D(96, 32), "fc": nn.Linear(32, 48, bias=False)})  # Conv1D(nf=out, nx=in)
    biases = 96 * 2  # Conv1D's bias, unplanned, in bf16
    expected = weight_bytes("int8", 32, 96, torch.bfloat16) + weight_bytes("nf4", 32, 48, torch.bfloat16) + biases
    assert predict_parameter_bytes(model, {"c_fc": "int8", "fc": "nf4"}) == expected
    # int8 keeps one scale per output row: the Conv1D's [in, out] weight read the other way round would differ
    assert weight_bytes("int8", 32, 96, torch.bfloat16) != weight_bytes("int8", 96, 32, torch.bfloat16)


LAYERS = Path(__file__).resolve().parents[2] / "lightning_hbm" / "layers"
JOBS = ("kinds", "finding", "source_scan", "heads", "outside", "coverage_table")


def test_base_is_a_face_over_the_modules_split_by_job() -> None:
    """What ``from lightning_hbm.layers.base import X`` gave still comes, the same object, from the module of its job;
    ``base.py`` defines nothing, and nothing in the package imports it."""
    tree = ast.parse((LAYERS / "base.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    defined += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name) and t.id != "__all__"]
    assert defined == []
    homes = [importlib.import_module(f"lightning_hbm.layers.{job}") for job in JOBS]
    for name in base.__all__:
        assert any(getattr(home, name, None) is getattr(base, name) and name in home.__all__ for home in homes), name
    importers = [path.name for path in sorted(LAYERS.parent.rglob("*.py")) if _imports_base(ast.parse(path.read_text()))]
    assert importers == []


def _imports_base(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_hbm.layers.base":
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "lightning_hbm.layers" and any(a.name == "base" for a in node.names):
            return True
        if isinstance(node, ast.Import) and any(a.name == "lightning_hbm.layers.base" for a in node.names):
            return True
    return False
