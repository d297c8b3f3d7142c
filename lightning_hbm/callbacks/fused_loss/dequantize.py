"""A frozen quantized head dequantized once while the fused loss's chunks run."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.precision.registry import format_of


@contextmanager
def _dequantized_once(head: Optional[nn.Module]) -> Iterator[None]:
    """Frozen quantized layers inside ``head`` dequantize their weight once for all chunks, not twice per chunk.

    A 4-bit layer (bitsandbytes' ``Linear4bit``, any format with ``dense_forward``) dequantizes the whole
    ``[vocab, hidden]`` weight in every forward and again in every backward: per chunk, that transient is as
    large as the bf16 logits of ``hidden`` tokens (1 GiB for an 8B Llama's head), and it would be paid 2 x chunks
    times. Here one copy lives while the chunks run and the layer computes ``F.linear`` with it, exactly what
    its forward does after dequantizing.
    """
    modules = head.modules() if head is not None else ()
    owned = [(m, format_of(m)) for m in modules]
    layers = [(m, fmt) for m, fmt in owned if fmt is not None and fmt.dense_forward and not m.weight.requires_grad]
    previous_forwards = [torch_compat.forward_override(layer) for layer, _ in layers]
    for layer, fmt in layers:
        # Straight into the compute dtype: a model quantized from fp32 weights stores fp32 constants,
        # and an fp32 copy of the head (2 GiB at 8B) next to its bf16 cast would be the step's peak.
        def forward(x: torch.Tensor, layer: nn.Module = layer,
                    weight: torch.Tensor = fmt.dequantize(layer, fmt.compute_dtype(layer))) -> torch.Tensor:
            bias = None if layer.bias is None else cast(torch.Tensor, layer.bias).to(weight.dtype)
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

        torch_compat.override_forward(layer, forward)
    try:
        yield
    finally:
        for (layer, _), previous in zip(layers, previous_forwards):
            torch_compat.override_forward(layer, previous)  # the class's, or e.g. FusedLoss's own wrapper on a 4-bit head

