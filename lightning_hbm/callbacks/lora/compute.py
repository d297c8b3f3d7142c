"""Adapters computed in the narrower of their own dtype and their input's: fp32 weights, bf16 matmuls.

peft casts a LoRA layer's *input* to the adapter's dtype. With fp32 adapters (``LoRA(adapter_dtype="float32")``, the
default, for the optimizer's sake) on a bf16 model, that is an fp32 copy of every adapted layer's input, saved for
``lora_A``'s weight gradient, and fp32 matmuls: under full recompute the copies of one block are the largest thing
alive beside the block's own activations (24.9 MiB, 14 % of the QLoRA floor, at 100M in bf16: benchmarks/README.md).
Mixed precision, as ``torch.autocast`` does it, casts the *weights* instead: the rank-r ``A`` and ``B`` are cast to
bf16 at each forward (a few KiB), the saved input is the layer's own bf16 tensor (no copy), and the gradients come
back to the fp32 weights through the cast. Where the input is as wide as the weights (fp32 runs) nothing changes; where it is
wider (bf16 adapters on an fp32 model), the input is cast down, as peft does.

Only plain LoRA ``nn.Linear`` adapters: DoRA and peft's other variants compute their own terms from the weights
and keep peft's input cast.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat


class NarrowerDtypeLinear:
    """The ``forward`` of one adapter ``nn.Linear``: computed in the narrower of its weight's and its input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.linear.weight
        bias: Optional[torch.Tensor] = self.linear.bias
        if x.dtype != weight.dtype and x.element_size() < weight.element_size():
            weight = weight.to(x.dtype)  # differentiable: the gradient reaches the fp32 weight in fp32
            bias = None if bias is None else bias.to(x.dtype)
        else:
            x = x.to(weight.dtype)
        return F.linear(x, weight, bias)


def compute_in_input_dtype(layer: Any) -> bool:
    """Give a plain peft LoRA layer's adapters :class:`NarrowerDtypeLinear`; False (nothing changed) for variants
    (DoRA, ...) and adapters that are not ``nn.Linear`` (convolutions, embeddings)."""
    if getattr(layer, "lora_variant", None):
        return False
    adapters = [m for container in (layer.lora_A, layer.lora_B) for m in container.values()]
    if not adapters or any(type(m) is not nn.Linear for m in adapters):
        return False
    for linear in adapters:
        torch_compat.override_forward(linear, NarrowerDtypeLinear(linear))
    peft_compat.keep_input_dtype(layer)
    return True
