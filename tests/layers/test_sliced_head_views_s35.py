"""A head's vocabulary slices read as views of the stored rows (session 35): ``QuantFormat.gather_range`` gives rows
``start:stop`` as ``gather_rows`` gives them, bit for bit, and bitsandbytes' int8 and 4-bit formats read them without an
index gather (SmolLM2's tied int8 head: 0.08 -> 0.06 s a forward on a CPU, benchmarks/README.md)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm.layers.embedding import sliced_linear
from lightning_hbm.precision.registry import get_format

MODES = ["int8", "nf4", "nf4-dq", "fp4-dq", "nf4-dq-b32", "int4-g32"]


@pytest.mark.parametrize("width", [256, 72])  # 72: a row's values share 4-bit blocks with the next row's
@pytest.mark.parametrize("mode", MODES)
def test_a_range_of_rows_equals_the_gathered_rows(mode: str, width: int) -> None:
    torch.manual_seed(0)
    fmt = get_format(mode)
    layer = fmt.replace(nn.Linear(width, 1000, bias=False), torch.bfloat16, None)
    for start, stop in ((0, 1000), (0, 1), (5, 377), (640, 1000), (999, 1000)):
        rows = fmt.gather_range(layer, start, stop, torch.bfloat16, torch.device("cpu"))
        assert rows.dtype == torch.bfloat16 and rows.shape == (stop - start, width)
        assert torch.equal(rows, fmt.gather_rows(layer, torch.arange(start, stop), torch.bfloat16)), (start, stop)


@pytest.mark.parametrize("mode", ["int8", "nf4-dq"])
def test_the_sliced_head_reads_views_and_computes_as_before(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward and backward of a head unpacked by vocabulary slices (a tied head, a 4-bit head under FusedLoss):
    the same logits and input gradient as by indexed rows, and no indexed gather (before: one per slice, twice)."""
    torch.manual_seed(0)
    fmt = get_format(mode)
    layer = fmt.replace(nn.Linear(256, 4000, bias=False), torch.bfloat16, None)
    x = torch.randn(3, 40, 256, requires_grad=True)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        out = sliced_linear(x, layer, fmt, torch.bfloat16, None)
        (grad,) = torch.autograd.grad(out.float().square().sum(), x)
        return out.detach(), grad

    calls: list[int] = []
    gather_rows = type(fmt).gather_rows

    def counted(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return gather_rows(self, *args, **kwargs)

    monkeypatch.setattr(type(fmt), "gather_rows", counted)
    out, grad = step()
    assert calls == []  # was: one gather_rows per slice, forward and backward
    monkeypatch.setattr(type(fmt), "gather_range", lambda self, layer, start, stop, dtype, device: gather_rows(
        self, layer, torch.arange(start, stop, device=device), dtype))
    indexed_out, indexed_grad = step()
    assert calls == [] and torch.equal(out, indexed_out) and torch.equal(grad, indexed_grad)
