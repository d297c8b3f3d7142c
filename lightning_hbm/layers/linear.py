"""``nn.Linear`` and its subclasses: the kind every precision mode and peft's LoRA were written for.

Subclasses included: ``nn.MultiheadAttention``'s ``out_proj`` is a ``NonDynamicallyQuantizableLinear`` (an exact
type check skips it), and a quantized layer (bitsandbytes ``Linear4bit``/``Linear8bitLt``, ``Int8DynamicLinear``)
is still a Linear, counted here unless ``quantize_model`` tagged it with the kind it came from (a Conv1D).

A Linear a model declares in ``_keep_in_fp32_modules`` (T5-v1.1 / UL2 / Flan-T5's ``wo``) is stored in the mode's
format like any other, but computes in fp32 (:class:`Fp32ComputeLinear`): the reason for fp32 is the range of its
activations, not the storage of its weight. Kept as an fp32 weight it was 4 bytes a weight: about 2.0 GB at
T5-v1.1-XL, more than all its 4-bit weights together (about 1.15 GB).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.layers.frozen_weight import FrozenWeight, InputGradient
from lightning_hbm.layers.kinds import LayerKind, register_kind
from lightning_hbm.layers.read_weight import ReadableLinear


def _linear_backward(asked: InputGradient) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``x @ W.T``'s input gradient (and a trained bias's, ``LoRA(bias="all")``), for
    :class:`~lightning_hbm.layers.frozen_weight.FrozenWeight`."""
    grad_x = asked.grad @ asked.weight if asked.needs_x else None
    grad_bias = asked.grad.reshape(-1, asked.grad.shape[-1]).sum(0) if asked.needs_bias else None
    return grad_x, grad_bias


class Fp32ComputeLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen weight a precision mode stores (the child ``quantized``) and which computes in
    fp32: the input is cast to fp32, multiplied with the weight dequantized straight into fp32, and the output is
    fp32, as the fp32 layer it replaces gave. Built by :meth:`from_quantized` only."""

    _dequantize: Callable[..., torch.Tensor]
    #: said in the coverage table's last column (a wider compute than its kind's other layers, issue 53)
    coverage_note = "stored quantized, computed in fp32 (the model's `_keep_in_fp32_modules`)"

    def storage(self) -> nn.Module:
        """The mode's layer holding the ``[out, in]`` weight."""
        return cast(nn.Module, self._modules["quantized"])

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # read by the model's code (T5 casts its hidden states to wo.weight.dtype: fp32 here, not the packed uint8)
        # and by peft for the shape, dtype and device of an adapter: dequantized on each read, never stored
        with torch.no_grad():
            return self._dequantize(self.storage(), torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # frozen: the dequantized weight needs no gradient; the input's flows through the matmul
        bias = None if self.bias is None else self.bias.float()
        # dequantized straight into fp32 in the forward and again in the backward, as bitsandbytes' 4-bit matmul
        # does: the fp32 weight is not kept for backward (F.linear kept it: T5 at width 256, nf4-dq, 14.6 -> 20.9 MB
        # saved by one training forward, ``benchmarks/layer_kinds.py --checkpointing``)
        def weight_of() -> torch.Tensor:
            return self._dequantize(self.storage(), torch.float32)

        return cast(torch.Tensor, FrozenWeight.apply(x.float(), bias, weight_of, F.linear, _linear_backward))

    @classmethod
    def from_quantized(cls, linear: nn.Linear, quantized: nn.Module, dequantize: Callable[..., torch.Tensor]) -> Fp32ComputeLinear:
        """``linear``'s replacement around ``quantized`` (the mode's layer built from ``linear``)."""
        new: Any = cls.__new__(cls)
        nn.Module.__init__(new)  # not nn.Linear's: it would allocate a weight the storage holds
        new.in_features, new.out_features = linear.in_features, linear.out_features
        # the same Parameter, kept in fp32 with the layer, and held here only (the mode's layer never runs): shared
        # with the mode's layer it was also the state dict's ``quantized.bias``, which no checkpoint holds (its frozen
        # base is omitted under ``bias``): Blip-2's Q-Former (``_keep_in_fp32_modules``, biased Linears) did not resume
        new.bias = linear.bias
        cast(Any, quantized).bias = None
        new.quantized = quantized
        new._dequantize = dequantize
        return cast(Fp32ComputeLinear, new)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _as_linear(module: nn.Module) -> nn.Linear:
    return module  # type: ignore[return-value]


def _stored_in(layer: nn.Module) -> Optional[nn.Module]:
    return layer.storage() if isinstance(layer, (Fp32ComputeLinear, ReadableLinear)) else None


LINEAR = register_kind(
    LayerKind(
        name="Linear",
        matches=_is_linear,
        to_linear=_as_linear,
        quantized_as="the mode's layer (bitsandbytes `Linear4bit` / `Linear8bitLt`, `Int8DynamicLinear`); a model's "
        "`_keep_in_fp32_modules` (T5's `wo`) stored the same way and computed in fp32",
        adapted_as="the Linear (peft's LoRA Linear around it)",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
        modules="`nn.Linear` (and subclasses)",
        found_in="Llama, BERT, T5, ViT heads, ...",
        planned_as="the mode's layer built from the fake weight (`QuantFormat.for_fake_tensors`)",
        as_built_keys=lambda layer: {"quantized.weight": "weight"} if _stored_in(layer) is not None else {},
        stored_in=_stored_in,
    )
)

__all__ = ["LINEAR", "Fp32ComputeLinear"]
