"""Transposed convolutions (``nn.ConvTranspose1d``/``2d``/``3d``): stored in the precision mode's format, not adapted.

SAM's mask decoder upscales with two ``ConvTranspose2d``; UNet and GAN decoders, vocoders upsample with them. As a
convolution (:mod:`lightning_hbm.layers.conv`), the weight is stored by the mode's own Linear layer as a matrix and
dequantized to the compute dtype at each forward and again in the backward (:class:`QuantizedConvTranspose2d` and its
1-d/3-d siblings; the dequantized weight is not kept for backward). The weight's layout is ``[in, out / groups,
*kernel]`` (not ``[out, in / groups, *kernel]``): the matrix is ``[in, out / groups * kernel]``, ``in`` rows. What it
shrinks: the **parameters** term.

peft's LoRA has no transposed-convolution layer (0.21: Linear, Embedding, Conv1d/2d/3d, MultiheadAttention), so these
layers are not LoRA targets; ``LoRA(modules_to_save=[...])`` trains one fully instead.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.layers.conv import Geometry, convolution_backward
from lightning_hbm.layers.frozen_weight import FrozenWeight
from lightning_hbm.layers.kinds import LayerKind, no_names, register_kind
from lightning_hbm.layers.weight_norm import WeightNorm, floating_weight, weight_norm_of

_PLAIN = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_FUNCTIONS: dict[int, Callable[..., torch.Tensor]] = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _QuantizedTranspose:
    """What the quantized 1-d/2-d/3-d transposed convolutions share; built by :meth:`from_quantized` only."""

    _dequantize: Callable[..., torch.Tensor]
    compute_dtype: torch.dtype
    #: a folded weight_norm (HiFi-GAN's upsamplers): resume maps the storage to its ``v``, ``LoRA.merge`` writes its factors
    weight_norm: Optional[WeightNorm] = None

    def storage(self) -> nn.Module:
        """The mode's layer holding the weight as an ``[in, out / groups * kernel]`` matrix."""
        return cast(nn.Module, self._modules["quantized"])  # type: ignore[attr-defined]

    @property
    def weight(self) -> torch.Tensor:
        # the weight as the convolution multiplies with it, for code that reads its shape, dtype or device:
        # dequantized on each read, never stored
        with torch.no_grad():
            return self.dequantized()

    def dequantized(self) -> torch.Tensor:
        shape = (self.in_channels, self.out_channels // self.groups, *self.kernel_size)  # type: ignore[attr-defined]
        return self._dequantize(self.storage(), self.compute_dtype).reshape(shape)

    def forward(self, x: torch.Tensor, output_size: Optional[list[int]] = None) -> torch.Tensor:
        # nn.ConvTranspose{1,2,3}d.forward with the dequantized weight (frozen: no gradient; the input's flows)
        conv: Any = self
        spatial = len(conv.kernel_size)
        output_padding = conv._output_padding(x, output_size, conv.stride, conv.padding, conv.kernel_size, spatial, conv.dilation)
        geometry = Geometry(conv.stride, conv.padding, conv.dilation, True, tuple(output_padding), conv.groups)
        convolve = _FUNCTIONS[spatial]

        def run(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            return convolve(x, weight, bias, conv.stride, conv.padding, output_padding, conv.groups, conv.dilation)

        # the dequantized weight is not saved for backward (FrozenWeight): dequantized again there
        backward = convolution_backward(geometry, conv.bias)
        return cast(torch.Tensor, FrozenWeight.apply(x.to(self.compute_dtype), conv.bias, self.dequantized, run, backward))

    @classmethod
    def from_quantized(cls, conv: nn.Module, quantized: nn.Module, dequantize: Callable[..., torch.Tensor], dtype: torch.dtype) -> nn.Module:
        """``conv``'s replacement around ``quantized`` (the mode's layer built from :func:`_as_linear`)."""
        new: Any = object.__new__(cls)
        plain: Any = next(c for c in _PLAIN if isinstance(conv, c))
        plain.__init__(
            new, conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            output_padding=conv.output_padding, groups=conv.groups, bias=False, dilation=conv.dilation, device="meta",
        )  # fmt: skip
        del new._parameters["weight"]  # the storage holds it
        new.bias = conv.bias  # the same Parameter, as a quantized Linear keeps its bias
        new.quantized = quantized
        new._dequantize, new.compute_dtype = dequantize, dtype
        new.weight_norm = weight_norm_of(conv)
        return cast(nn.Module, new)


class QuantizedConvTranspose1d(_QuantizedTranspose, nn.ConvTranspose1d):  # type: ignore[override]  # weight: a read-only property on purpose
    """An ``nn.ConvTranspose1d`` whose frozen weight a precision mode stores (see the module docstring)."""


class QuantizedConvTranspose2d(_QuantizedTranspose, nn.ConvTranspose2d):  # type: ignore[override]  # weight: a read-only property on purpose
    """An ``nn.ConvTranspose2d`` whose frozen weight a precision mode stores (see the module docstring)."""


class QuantizedConvTranspose3d(_QuantizedTranspose, nn.ConvTranspose3d):  # type: ignore[override]  # weight: a read-only property on purpose
    """An ``nn.ConvTranspose3d`` whose frozen weight a precision mode stores (see the module docstring)."""


_QUANTIZED: dict[type[nn.Module], type[_QuantizedTranspose]] = {nn.ConvTranspose1d: QuantizedConvTranspose1d, nn.ConvTranspose2d: QuantizedConvTranspose2d, nn.ConvTranspose3d: QuantizedConvTranspose3d}


def _is_transpose(module: nn.Module) -> bool:
    if isinstance(module, _QuantizedTranspose):
        return True
    return isinstance(module, _PLAIN) and floating_weight(module)


def _as_linear(conv: nn.Module) -> nn.Linear:
    # [in, out/groups, *kernel] as the matrix of in rows (a view, not a copy)
    weight = cast(torch.Tensor, conv.weight).detach().reshape(cast(int, conv.in_channels), -1)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _wrap(conv: nn.Module, quantized: nn.Module, dequantize: Callable[..., torch.Tensor], dtype: torch.dtype) -> nn.Module:
    plain = next(c for c in _PLAIN if isinstance(conv, c))
    return _QUANTIZED[plain].from_quantized(conv, quantized, dequantize, dtype)


def _stored_in(layer: nn.Module) -> Optional[nn.Module]:
    return layer.storage() if isinstance(layer, _QuantizedTranspose) else None


def _features(conv: nn.Module) -> tuple[int, int]:
    width = cast(int, conv.out_channels) // cast(int, conv.groups) * math.prod(cast(tuple[int, ...], conv.kernel_size))
    return width, cast(int, conv.in_channels)


def _as_built_keys(layer: nn.Module) -> dict[str, Any]:
    if _stored_in(layer) is None:
        return {}
    norm = cast(_QuantizedTranspose, layer).weight_norm
    return {"quantized.weight": "weight" if norm is None else norm.v}  # a folded weight_norm's direction v


NOT_ADAPTED = (
    "not adapted: peft's LoRA has no transposed-convolution layer. To train them: LoRA(modules_to_save=[their names]) "
    "trains them fully; else they stay frozen"
)

CONV_TRANSPOSE = register_kind(
    LayerKind(
        name="ConvTranspose",
        matches=_is_transpose,
        to_linear=_as_linear,
        quantized_as="the weight as its [in, out/groups x kernel] matrix in the mode's Linear layer, dequantized to "
        "the compute dtype at each forward",
        adapted_as="not adapted (peft's LoRA has no transposed-convolution layer; LoRA(modules_to_save=...) trains one "
        "fully)",
        option="QuantizedPrecision(...) quantizes them; LoRA(modules_to_save=[their names]) trains them fully",
        modules="`nn.ConvTranspose1d`/`2d`/`3d`",
        found_in="SAM's mask upscaler, UNet and GAN decoders, vocoders",
        planned_as="the mode's layer built from the fake weight's matrix",
        adaptable_names=no_names,
        features=_features,
        as_built_keys=_as_built_keys,
        wrap=_wrap,
        stored_in=_stored_in,
        not_adapted=NOT_ADAPTED,
    )
)

__all__ = ["CONV_TRANSPOSE", "QuantizedConvTranspose1d", "QuantizedConvTranspose2d", "QuantizedConvTranspose3d"]
