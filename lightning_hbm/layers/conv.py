"""Convolutions (``nn.Conv1d``/``2d``/``3d``): stored in the precision mode's format, adapted by peft's Conv LoRA.

bitsandbytes (and int8-dynamic) have no convolution kernel, so a convolution is quantized the way bitsandbytes'
4-bit Linear trains anyway: the weight, seen as the ``[out, in / groups * kernel]`` matrix it is, is stored by the
mode's own Linear layer (every mode, its constants, resume and planner included), and each forward dequantizes it to
the compute dtype and convolves (:class:`QuantizedConv2d` and its 1-d/3-d siblings). What it shrinks: the
**parameters** term; it costs one dequantization per forward (and per recompute), and one more per backward: the
dequantized weight is not kept for backward, the backward dequantizes it again (:class:`~lightning_hbm.layers.frozen_weight.FrozenWeight`, as
bitsandbytes' 4-bit matmul does).

A convolution under ``weight_norm`` (Wav2Vec2 / HuBERT's positional convolution, HiFi-GAN) is quantized as the one
weight its factors compute (the same numbers; the factors only differ from it while trained, and a stored weight is
frozen); resume maps the storage's keys to the factor ``v`` (:attr:`_Quantized.as_built_weight`).

Grouped and depthwise convolutions are quantized too (the same matrix, ``in / groups`` wide; a 3x3 depthwise one has
9 weights per output channel, within one 64-value block), but they are not LoRA targets: peft needs ``r`` divisible
by ``groups`` and cannot merge them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, NamedTuple, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.layers.correction import correction_of
from lightning_hbm.layers.frozen_weight import Backward, FrozenWeight, InputGradient
from lightning_hbm.layers.kinds import LayerKind, itself, register_kind
from lightning_hbm.layers.weight_norm import WeightNorm, floating_weight, weight_norm_of


class Geometry(NamedTuple):
    """What ``aten.convolution_backward`` needs of a convolution besides its tensors (integer paddings only)."""

    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int


def convolution_backward(geometry: Geometry, bias: Optional[torch.Tensor]) -> Backward:
    """The input's (and a trained bias's) gradient of the convolution ``geometry`` describes, for
    :class:`~lightning_hbm.layers.frozen_weight.FrozenWeight`. Tested on CPU; the input-shaped stand-in is what
    ``torch.nn.grad.conv2d_input`` passes, not yet run with cuDNN."""
    bias_sizes = None if bias is None else list(bias.shape)

    def backward(asked: InputGradient) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        g = geometry
        # the input's values are not read for its own gradient: a stride-0 stand-in of its shape
        stand_in = asked.grad.new_empty(1).expand(asked.x_shape)
        grad_x, _, grad_bias = torch.ops.aten.convolution_backward(
            asked.grad, stand_in, asked.weight, bias_sizes, g.stride, g.padding, g.dilation, g.transposed,
            g.output_padding, g.groups, [asked.needs_x, False, asked.needs_bias],
        )  # fmt: skip
        return grad_x, grad_bias

    return backward


#: inside :func:`repeated_reads_dequantize_once`: the last quantized convolution whose ``weight`` was read (layer,
#: storage, weight), or None
_LAST_READ: list[Optional[tuple[object, nn.Module, torch.Tensor]]] = []


@contextmanager
def repeated_reads_dequantize_once() -> Iterator[None]:
    """Inside, reading a quantized convolution's ``weight`` again, with no other one's read in between, returns the
    tensor the previous read dequantized (the same values) instead of dequantizing anew.

    peft reads ``base_layer.weight`` about ten times per layer while it builds the layer's adapter (its device, its
    dtype); each read of a quantized convolution's weight dequantizes it. At most one weight is held past its read.
    """
    _LAST_READ.append(None)
    try:
        yield
    finally:
        _LAST_READ.pop()


class _Quantized:
    """What the quantized 1-d/2-d/3-d convolutions share. Only :meth:`from_quantized` builds one: called like a
    convolution (peft builds its adapters' ``lora_A``/``lora_B`` with ``type(base_layer)(...)``), the class gives
    the plain ``nn.Conv2d`` (1-d, 3-d) it stands for."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:  # copy / pickle: the object is rebuilt from its state
            return object.__new__(cls)
        return _PLAIN[cls](*args, **kwargs)  # not an instance of cls: Python does not call __init__ again

    # set by :meth:`from_quantized` (plain attributes; ``quantized`` is a registered child module)
    _dequantize: Optional[Callable[..., torch.Tensor]]
    compute_dtype: torch.dtype
    #: the as-built key of the weight the storage holds (local): ``weight``, or a folded weight_norm's direction ``v``
    as_built_weight: str = "weight"
    #: a folded weight_norm's factors (keys, dim): ``LoRA.merge`` writes a merged weight back as them; ``None``: none
    weight_norm: Optional[WeightNorm] = None

    def storage(self) -> Optional[nn.Module]:
        """The mode's layer holding the weight as a ``[out, in / groups * kernel]`` matrix (``None``: not quantized)."""
        return self._modules.get("quantized")  # type: ignore[attr-defined]

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # the weight as the convolution multiplies with it: peft reads its shape, dtype and device (not its values)
        # when it builds an adapter; dequantized on each read, never stored
        param = self._parameters.get("weight")  # type: ignore[attr-defined]
        if param is not None:
            return param
        storage = self.storage()
        if storage is None:
            raise AttributeError("weight")
        last = _LAST_READ[-1] if _LAST_READ else None
        if last is not None and last[0] is self and last[1] is storage:
            return last[2]
        with torch.no_grad():
            weight = self.dequantized(storage)
        if _LAST_READ:
            _LAST_READ[-1] = (self, storage, weight)
        return weight

    def dequantized(self, storage: nn.Module) -> torch.Tensor:
        shape = (self.out_channels, self.in_channels // self.groups, *self.kernel_size)  # type: ignore[attr-defined]
        weight = self._dequantize(storage, self.compute_dtype)  # type: ignore[misc]
        correction = correction_of(cast(nn.Module, self))  # QuantizedPrecision(correction_rank=r): B A added to the weight
        if correction is not None:
            weight = weight + (correction.left @ correction.right).to(weight.dtype)
        return weight.reshape(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        storage = self.storage()
        if storage is None:
            return super().forward(x)  # type: ignore[misc]
        # frozen: the dequantized weight needs no gradient; the input's flows through the convolution
        conv: Any = self
        x, padding = _padded(conv, x.to(self.compute_dtype))
        spatial = len(conv.kernel_size)
        geometry = Geometry(conv.stride, padding, conv.dilation, False, (0,) * spatial, conv.groups)
        convolve = _CONVOLVE[spatial]

        def run(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
            return convolve(x, weight, bias, conv.stride, padding, conv.dilation, conv.groups)

        return cast(
            torch.Tensor,
            FrozenWeight.apply(x, conv.bias, lambda: self.dequantized(storage), run, convolution_backward(geometry, conv.bias)),
        )

    @classmethod
    def from_quantized(cls, conv: nn.Module, quantized: nn.Module, dequantize: Callable[..., torch.Tensor], dtype: torch.dtype) -> nn.Module:
        """``conv``'s replacement around ``quantized`` (the mode's layer built from :func:`_as_linear`)."""
        new: Any = object.__new__(cls)  # set up below as the plain convolution: nn.Module's attributes, which _Quantized does not declare
        _PLAIN[cls].__init__(
            new, conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=conv.padding,
            dilation=conv.dilation, groups=conv.groups, bias=False, padding_mode=conv.padding_mode, device="meta",
        )  # fmt: skip
        del new._parameters["weight"]  # the storage holds it
        new.bias = conv.bias  # the same Parameter, as a quantized Linear keeps its bias
        new.quantized = quantized
        new._dequantize, new.compute_dtype = dequantize, dtype
        new.weight_norm = weight_norm_of(conv)
        new.as_built_weight = "weight" if new.weight_norm is None else new.weight_norm.v
        return new


_CONVOLVE: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _padded(conv: Any, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` and the integer padding the convolution then takes, as ``nn.Conv2d._conv_forward`` pads: a padding mode
    other than zeros, or an uneven ``padding='same'``, pads ``x`` itself (the backward needs integer paddings)."""
    pads = conv._reversed_padding_repeated_twice  # (last dim left, right, ...)
    if conv.padding_mode == "zeros" and all(pads[i] == pads[i + 1] for i in range(0, len(pads), 2)):
        return x, tuple(pads[::-2])  # the (even) pads, first dim first
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    return F.pad(x, pads, mode=mode), (0,) * len(conv.kernel_size)


class QuantizedConv1d(_Quantized, nn.Conv1d):  # type: ignore[override]  # weight: _Quantized's read-only property over the convolution's attribute, on purpose
    """An ``nn.Conv1d`` whose frozen weight a precision mode stores (see the module docstring)."""


class QuantizedConv2d(_Quantized, nn.Conv2d):  # type: ignore[override]  # weight: _Quantized's read-only property over the convolution's attribute, on purpose
    """An ``nn.Conv2d`` whose frozen weight a precision mode stores (see the module docstring)."""


class QuantizedConv3d(_Quantized, nn.Conv3d):  # type: ignore[override]  # weight: _Quantized's read-only property over the convolution's attribute, on purpose
    """An ``nn.Conv3d`` whose frozen weight a precision mode stores (see the module docstring)."""


_QUANTIZED: dict[type[nn.Module], type[_Quantized]] = {nn.Conv1d: QuantizedConv1d, nn.Conv2d: QuantizedConv2d, nn.Conv3d: QuantizedConv3d}
_PLAIN = {quantized: plain for plain, quantized in _QUANTIZED.items()}


def _is_conv(module: nn.Module) -> bool:
    if isinstance(module, _Quantized):
        return True
    return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and floating_weight(module)


def _adaptable(conv: nn.Module) -> list[str]:
    return [] if cast(int, conv.groups) > 1 else itself(conv)  # grouped/depthwise: see the module docstring


def _as_linear(conv: nn.Module) -> nn.Linear:
    # the weight as the matrix it is: out_channels rows of in/groups * kernel values (a view, not a copy)
    weight = cast(torch.Tensor, conv.weight).detach().reshape(cast(int, conv.out_channels), -1)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _wrap(conv: nn.Module, quantized: nn.Module, dequantize: Callable[..., torch.Tensor], dtype: torch.dtype) -> nn.Module:
    base = next(c for c in (nn.Conv3d, nn.Conv2d, nn.Conv1d) if isinstance(conv, c))
    return _QUANTIZED[base].from_quantized(conv, quantized, dequantize, dtype)


def _stored_in(layer: nn.Module) -> Optional[nn.Module]:
    return layer.storage() if isinstance(layer, _Quantized) else None


def _features(conv: nn.Module) -> tuple[int, int]:
    return cast(int, conv.in_channels) // cast(int, conv.groups) * math.prod(cast(tuple[int, ...], conv.kernel_size)), cast(int, conv.out_channels)


def _as_built_keys(conv: nn.Module) -> dict[str, Any]:
    return {"quantized.weight": cast(_Quantized, conv).as_built_weight} if _stored_in(conv) is not None else {}


CONV = register_kind(
    LayerKind(
        name="Conv",
        matches=_is_conv,
        to_linear=_as_linear,
        quantized_as="the weight as its [out, in/groups x kernel] matrix in the mode's Linear layer, dequantized to "
        "the compute dtype at each forward (bitsandbytes has no convolution kernel); a weight_norm (Wav2Vec2/HuBERT "
        "positional conv) folded into the one frozen weight it computes",
        adapted_as="peft LoRA Conv layer (not grouped/depthwise convolutions: peft needs r divisible by groups and "
        "cannot merge them)",
        option="QuantizedPrecision(...) quantizes them; LoRA(target_modules='all-linear') adapts them",
        modules="`nn.Conv1d`/`2d`/`3d`",
        found_in="ResNet, ConvNeXt, EfficientNet, UNets, ViT/SigLIP patch embeddings, Whisper/Wav2Vec2 front ends, Mamba",
        planned_as="the mode's layer built from the fake weight's matrix",
        adaptable_names=_adaptable,
        features=_features,
        as_built_keys=_as_built_keys,
        wrap=_wrap,
        stored_in=_stored_in,
        not_adapted="not adapted: LoRA skips grouped/depthwise convolutions (peft needs r divisible by groups and "
        "cannot merge them). To train them: LoRA(modules_to_save=[their names]) trains them fully; else they stay "
        "frozen",
    )
)

__all__ = ["CONV", "QuantizedConv1d", "QuantizedConv2d", "QuantizedConv3d"]
