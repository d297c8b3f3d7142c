"""A frozen quantized head computed while the fused loss's chunks run: a vocabulary slice of its weight at a time
where its format can unpack rows, else dequantized once for all chunks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.precision.registry import QuantFormat, format_of

#: bytes of one dequantized slice of the head's weight (the transient a sliced head adds beside a chunk's logits)
SLICE_BYTES = 32 * 2**20


def slice_rows(in_features: int, dtype: torch.dtype) -> int:
    """Output rows (vocabulary entries) per dequantized slice: :data:`SLICE_BYTES` of weight in ``dtype``."""
    return max(1, SLICE_BYTES // (in_features * dtype.itemsize))


class _SlicedLinear(torch.autograd.Function):
    """``x @ W.T`` of a frozen quantized layer, ``W`` unpacked a slice of output rows at a time, in the forward and
    again in the backward (``QuantFormat.gather_rows``): never the whole ``[vocab, hidden]`` weight (1 GiB in bf16 for
    Llama-3-8B's head). Costs one more unpacking of the weight per chunk than dequantizing it once."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: nn.Module, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        vocab = fmt.weight_shape(layer)[0]
        rows = slice_rows(flat.shape[1], dtype)
        # returned as allocated, not as a view: FusedLoss writes the gradient into the logits' storage in place
        out = torch.empty(*x.shape[:-1], vocab, dtype=dtype, device=x.device)
        rows_of_out = out.view(-1, vocab)
        for start in range(0, vocab, rows):
            stop = min(vocab, start + rows)
            weight = fmt.gather_rows(layer, torch.arange(start, stop, device=x.device), dtype)
            rows_of_out[:, start:stop] = flat @ weight.t()
            del weight  # not beside the next slice's
        ctx.layer, ctx.fmt, ctx.dtype, ctx.rows, ctx.x_dtype, ctx.x_shape = layer, fmt, dtype, rows, x.dtype, x.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        flat = grad.reshape(-1, grad.shape[-1])
        vocab = flat.shape[1]
        # fp32 sum over slices: each slice's product is accumulated in fp32 by the matmul, rounded once to the
        # compute dtype, and the slices are added in fp32 (one bf16 sum would round once per slice)
        total = torch.zeros(flat.shape[0], ctx.x_shape[-1], dtype=torch.float32, device=grad.device)
        for start in range(0, vocab, ctx.rows):
            stop = min(vocab, start + ctx.rows)
            weight = ctx.fmt.gather_rows(ctx.layer, torch.arange(start, stop, device=grad.device), ctx.dtype)
            total += flat[:, start:stop].to(ctx.dtype) @ weight
            del weight
        return total.to(ctx.x_dtype).view(ctx.x_shape), None, None, None


def _sliced_forward(layer: nn.Module, fmt: QuantFormat, dtype: torch.dtype) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        out = _SlicedLinear.apply(x, layer, fmt, dtype)
        if layer.bias is not None:
            out = out + cast(torch.Tensor, layer.bias).to(dtype)
        return cast(torch.Tensor, out).to(x.dtype)

    return forward


def _once_forward(layer: nn.Module, fmt: QuantFormat, dtype: torch.dtype) -> Any:
    weight = fmt.dequantize(layer, dtype)

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else cast(torch.Tensor, layer.bias).to(weight.dtype)
        return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

    return forward


def gathers_rows(fmt: QuantFormat) -> bool:
    """Whether ``fmt`` unpacks single rows of a weight (its own ``gather_rows``), not only the whole weight."""
    return type(fmt).gather_rows is not QuantFormat.gather_rows


@contextmanager
def _dequantized_once(head: Optional[nn.Module]) -> Iterator[None]:
    """Frozen quantized layers inside ``head`` compute with their weight unpacked a vocabulary slice at a time, or
    dequantized once for all chunks, instead of the whole weight twice per chunk.

    A 4-bit layer (bitsandbytes' ``Linear4bit``, any format with ``dense_forward``) dequantizes the whole
    ``[vocab, hidden]`` weight in every forward and again in every backward: per chunk, that transient is as
    large as the bf16 logits of ``hidden`` tokens (1 GiB for an 8B Llama's head), and it would be paid 2 x chunks
    times. A format that can unpack rows (bitsandbytes 4-bit) computes slice by slice (:class:`_SlicedLinear`:
    :data:`SLICE_BYTES` of weight at a time); any other keeps one dequantized copy while the chunks run and
    computes ``F.linear`` with it, exactly what its forward does after dequantizing.
    """
    modules = head.modules() if head is not None else ()
    owned = [(m, format_of(m)) for m in modules]
    layers = [(m, cast(QuantFormat, fmt)) for m, fmt in owned if fmt is not None and fmt.dense_forward and not m.weight.requires_grad]
    previous_forwards = [torch_compat.forward_override(layer) for layer, _ in layers]
    for layer, fmt in layers:
        # Straight into the compute dtype: a model quantized from fp32 weights stores fp32 constants,
        # and an fp32 copy of the head (2 GiB at 8B) next to its bf16 cast would be the step's peak.
        dtype = cast(torch.dtype, fmt.compute_dtype(layer))
        build = _sliced_forward if gathers_rows(fmt) else _once_forward
        torch_compat.override_forward(layer, build(layer, fmt, dtype))
    try:
        yield
    finally:
        for (layer, _), previous in zip(layers, previous_forwards):
            torch_compat.override_forward(layer, previous)  # the class's, or e.g. FusedLoss's own wrapper on a 4-bit head
