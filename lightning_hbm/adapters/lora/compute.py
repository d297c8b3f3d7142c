"""fp32 adapters on a bf16 model compute in bf16: the weights are cast, not the inputs.

peft casts a LoRA layer's *input* to the adapter's dtype. With fp32 adapters (``LoRA(adapter_dtype="float32")``, the
default, for the optimizer's sake) on a bf16 model, that is an fp32 copy of every adapted layer's input, saved for
``lora_A``'s weight gradient, and fp32 matmuls: under full recompute the copies of one block are the largest thing
alive beside the block's own activations (24.9 MiB, 14 % of the QLoRA floor, at 100M in bf16: benchmarks/README.md).
Mixed precision, as ``torch.autocast`` does it, casts the *weights* instead: the rank-r ``A`` and ``B`` are cast to
bf16 at each forward (a few KiB), the saved input is the layer's own bf16 tensor (no copy), and the gradients come
back to the fp32 weights through the cast.

Only a bf16 input narrows fp32 weights: bf16 keeps fp32's exponent range. An fp16 input (``16-true``) is still cast
to fp32, as peft does, because fp16 adapter gradients without a loss scaler can underflow to zero. Every other case
is peft's rule too: an fp32 run is unchanged, bf16 adapters on an fp32 model compute on the input cast down.

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


class Bf16ComputeLinear:
    """The ``forward`` of one adapter ``nn.Linear``: fp32 weights on a bf16 input compute in bf16, else in the weight's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(*self.operands(x))

    def operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The input, weight and bias this forward multiplies (``LoRAForward`` fuses ``lora_B``'s into an addmm)."""
        weight: torch.Tensor = self.linear.weight
        bias: Optional[torch.Tensor] = self.linear.bias
        if x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
            weight = weight.to(x.dtype)  # differentiable: the gradient reaches the fp32 weight in fp32
            bias = None if bias is None else bias.to(x.dtype)
        else:
            x = x.to(weight.dtype)
        return x, weight, bias


def compute_in_input_dtype(layer: Any) -> bool:
    """Give a plain peft LoRA layer's adapters :class:`Bf16ComputeLinear`; False (nothing changed) for variants
    (DoRA, ...) and adapters that are not ``nn.Linear`` (convolutions, embeddings)."""
    if getattr(layer, "lora_variant", None):
        return False
    adapters = [m for container in (layer.lora_A, layer.lora_B) for m in container.values()]
    if not adapters or any(type(m) is not nn.Linear for m in adapters):
        return False
    for linear in adapters:
        torch_compat.override_forward(linear, Bf16ComputeLinear(linear))
    peft_compat.keep_input_dtype(layer)
    return True
