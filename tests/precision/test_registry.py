"""The quantized-format protocol: every registered format answers for the layers it builds; consumers ask it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes
from lightning_hbm.planner import Candidate
from lightning_hbm.precision import QuantFormat, available_precisions, format_of, get_format, register_format, registry
from lightning_hbm.precision.registry import mode_table

PARAMETERS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "parameters.md"


@pytest.mark.parametrize("name", available_precisions())
def test_every_format_owns_dequantizes_and_counts_what_it_builds(name: str) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 64)
    weight = linear.weight.detach().clone()
    layer = get_format(name).replace(linear, torch.float32, torch.device("cpu"))
    fmt = format_of(layer)
    assert fmt is not None and fmt.owns(layer) and type(fmt) is type(get_format(name))
    assert format_of(nn.Linear(4, 4)) is None
    dense = fmt.dequantize(layer).float()
    assert dense.shape == weight.shape
    assert 0 < ((dense - weight).norm() / weight.norm()).item() < 0.15  # quantized, and close
    # its constants are counted with its parameters (torchao's live inside its weight tensor: counted with it)
    constants = quantization_tensors(layer)
    assert constants and parameter_bytes(layer) == unique_bytes([*layer.parameters(), *constants])
    inside = name == "nf4-torchao"
    assert (parameter_bytes(layer) > unique_bytes(layer.parameters())) != inside


@dataclass(frozen=True)
class _HalfFormat(QuantFormat):
    """A toy format: an fp16 weight whose scale sits in an attribute no counter could guess."""

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, _HalfLinear)

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return module.weight.float() * module.zz_unusual_name

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        return [module.zz_unusual_name]


class _HalfLinear(nn.Linear):
    pass


def _half(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    layer = _HalfLinear(linear.in_features, linear.out_features, bias=False)
    layer.weight = nn.Parameter(linear.weight.detach().half(), requires_grad=False)
    layer.zz_unusual_name = torch.ones(linear.out_features, 1)  # neither a parameter nor a buffer
    return layer


@pytest.fixture
def half_format() -> Iterator[QuantFormat]:
    fmt = register_format(_HalfFormat("test-half", _half, (torch.float32,), "fp16 weight, fp32 row scale", cost=0.1))
    try:
        yield fmt
    finally:
        del registry._MODES["test-half"]


def test_constants_under_any_name_are_counted(half_format: QuantFormat) -> None:
    layer = half_format.replace(nn.Linear(32, 16, bias=False), torch.float32, None)
    assert quantization_tensors(layer) == [layer.zz_unusual_name]
    assert parameter_bytes(layer) == 32 * 16 * 2 + 16 * 4  # fp16 weight + the fp32 scales
    assert parameter_bytes(nn.Sequential(layer)) == 32 * 16 * 2 + 16 * 4


def test_the_planner_and_the_ladder_ask_the_format(half_format: QuantFormat) -> None:
    assert Candidate("test-half").relative_cost() == 1.1
    assert Candidate("nf4-dq").relative_cost() == 1.25 and Candidate("int8-dynamic").relative_cost() == 1.5
    assert get_format("test-half").ladder == ("int8",)  # the default: a sensitive layer may take int8
    assert get_format("nf4-dq").ladder == ("nf4-dq-b32", "int8") and get_format("int8").ladder == ("none",)


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"takes the quantized layer \(an nn.Module\), got Parameter: pass the module"):
        quantization_tensors(nn.Linear(2, 2).weight)
    with pytest.raises(ValueError, match=r"Precision mode 'nf4' is already registered"):
        register_format(get_format("nf4"))
    with pytest.raises(TypeError, match=r"Precision mode 'x' cannot dequantize Linear"):
        QuantFormat("x", _half, (torch.float32,), "").dequantize(nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("name", "hint"),
    [
        ("NF4-DQ", r"Did you mean 'nf4-dq'\? Mode names are lower case\."),  # exact but for case: that name only
        ("Int8-Dynamic", r"Did you mean 'int8-dynamic'\? Mode names are lower case\."),
        ("NF4DQ", r"Did you mean 'nf4-dq'"),  # a typo in capitals: close matches of the lower-case spelling
    ],
)
def test_a_mode_name_in_capitals_suggests_the_lower_case_name(name: str, hint: str) -> None:
    from lightning_hbm import QuantizedPrecision

    with pytest.raises(ValueError, match=rf"Unknown lightning_hbm precision mode '{name}'\. {hint}.* Valid modes: fp4, "):
        QuantizedPrecision(name)
    with pytest.raises(ValueError, match=rf"Unknown lightning_hbm precision mode '{name}'\. {hint}"):
        get_format(name)


def test_the_docs_mode_table_is_the_registry() -> None:
    text = PARAMETERS_PAGE.read_text()
    found = re.search(r"<!-- mode-table[^>]*-->\n(.*?)\n<!-- /mode-table -->", text, re.DOTALL)
    assert found, "docs/parameters.md lost its <!-- mode-table --> markers"
    table = mode_table()
    assert found.group(1) == table, (
        "docs/parameters.md's mode table differs from the registry: paste the output of "
        "python -c 'from lightning_hbm.precision.registry import mode_table; print(mode_table())'"
    )
    rows = {line.split(" | ")[0].strip("| `"): line.split(" | ") for line in table.splitlines()[2:]}
    assert list(rows) == list(registry._MODES) and len(rows) == 11
    assert rows["int4-g32"][2] == "0.625"  # 4-bit codes + fp16 scale and minimum per 32 weights: 5 bits
    assert rows["nf4-dq"][2] == "0.516"  # QLoRA's NF4 + double quantization: 4.127 bits per weight
    assert rows["nf4-torchao"][3] == "yes" and rows["int8"][3] == "no"  # the formats' code grids (GPTQ)
