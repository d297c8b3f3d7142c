"""A frozen quantized head computed while the fused loss's chunks run: a vocabulary slice of its weight at a time
where its format can unpack rows, else dequantized once for all chunks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers.embedding import sliced_linear
from lightning_hbm.precision.registry import QuantFormat, format_of


def _sliced_forward(layer: nn.Module, fmt: QuantFormat, dtype: torch.dtype) -> Any:
    return lambda x: sliced_linear(x, layer, fmt, dtype, cast(Optional[torch.Tensor], layer.bias))


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
    times. A format that can unpack rows (bitsandbytes 4-bit) computes slice by slice (:func:`~lightning_hbm.layers.embedding.sliced_linear`:
    slices sized from the chunk's logits, ``slice_rows``); any other keeps one dequantized copy while the chunks run and
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
