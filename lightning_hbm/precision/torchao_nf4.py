"""``nf4-torchao``: the frozen base stored as torchao's ``NF4Tensor``, the format torchtune's QLoRA uses.

What it shrinks: the **parameters** term, like bitsandbytes' ``nf4-dq`` (4-bit NormalFloat codes in blocks of 64,
the block scales quantized again to int8), without bitsandbytes: the weight is a tensor subclass that
dequantizes inside ``F.linear`` (``torchao``'s ``linear_nf4``), so the layer stays a plain ``nn.Linear`` for peft,
``torch.compile`` and FSDP2 (torchao implements NF4's all-gather). Checkpoints of a QLoRA run hold adapters, not
this weight; a full ``state_dict`` saves it as an ``NF4Tensor`` (torchao registers it as safe for
``torch.load(weights_only=True)``).

Everything lightning_hbm needs to know about the format is in this file (the :class:`QuantFormat` protocol);
nothing else imports it: the package imports every module of :mod:`lightning_hbm.precision`.

Block sizes: codes in blocks of 64 weights (a layer whose weight count is not a multiple of 64 is refused before
anything is quantized); the block scales in blocks of 256 as torchao's default when the number of blocks allows,
else the largest divisor below it (torchao needs an exact fit; a smaller scaler block costs a few more bytes,
counted exactly by storage counting). Needs ``torchao`` (tested with 0.18 on CPU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch import nn
from typing_extensions import override

from lightning_hbm.precision.registry import QuantFormat, RoundingGrid, register_format

_BLOCK = 64  # weights per absmax block (QLoRA's and torchtune's)
_SCALER_BLOCK = 256  # absmax values per block of the second quantization (torchao's default)
_INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")  # NF4Tensor's storage


def _nf4_api() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ModuleNotFoundError(
            "lightning_hbm's precision mode 'nf4-torchao' needs torchao (tested with 0.18). Install it with "
            "`pip install torchao`, or use mode 'nf4-dq' (bitsandbytes)."
        ) from err
    return nf4_tensor


def scaler_block_size(numel: int) -> int:
    """The largest divisor of ``numel / 64`` (the number of absmax blocks) up to 256, what torchao needs."""
    blocks = numel // _BLOCK
    return next(size for size in range(min(_SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


class NF4Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose ``weight`` is a torchao ``NF4Tensor``; the bias is the original Parameter."""

    @override
    def reset_parameters(self) -> None:
        pass  # built from a loaded Linear, never initialized

    def __deepcopy__(self, memo: dict[int, Any]) -> NF4Linear:
        # torchao 0.18's NF4Tensor clone re-quantizes its dequantized weight with the default block sizes: lossy
        # (a second rounding), and an error for a layer whose number of blocks 256 does not divide. Copy the
        # inner tensors instead; everything else as deepcopy would.
        weight: Any = self._parameters["weight"]  # an NF4Tensor (torchao, untyped): a wrapper subclass's methods, not on Tensor
        names, meta = weight.__tensor_flatten__()
        inner = {name: getattr(weight, name).clone() for name in names}
        twin = nn.Parameter(type(weight).__tensor_unflatten__(inner, meta, weight.shape, weight.stride()), requires_grad=False)
        memo[id(weight)] = twin
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))  # the weight: the twin, through memo
        return new

    @override
    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        # the NF4Tensor's plain inner tensors (``weight.quantized_data``, ...), not the subclass itself: Lightning
        # loads checkpoints with a callable map_location, which torch cannot apply to a wrapper subclass
        # ("Callable map_location not supported with _rebuild_wrapper_subclass")
        for name in _INNER:
            inner = getattr(self.weight, name)
            if not keep_vars and inner.untyped_storage().nbytes() != inner.numel() * inner.element_size():
                # a view of a larger storage (torchao's one-block quantization_factor): save only its elements
                inner = inner.new_empty(inner.shape).copy_(inner)
            destination[f"{prefix}weight.{name}"] = inner if keep_vars else inner.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    @override
    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        # into the layer as quantized (same shape, same block sizes): the inner tensors are copied in place
        found = {name: state_dict.pop(f"{prefix}weight.{name}") for name in _INNER if f"{prefix}weight.{name}" in state_dict}
        if found and prefix + "weight" not in state_dict:
            state_dict[prefix + "weight"] = self.weight  # the default loader copies nothing for it (same tensor)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        with torch.no_grad():
            for name, tensor in found.items():
                getattr(self.weight, name).copy_(tensor)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _nf4_api().linear_nf4(x, self.weight)  # dequantizes in x's dtype, saves only the NF4 weight
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _quantize(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    api = _nf4_api()
    if linear.weight.is_meta:
        raise ValueError(
            f"Cannot quantize a Linear({linear.in_features}, {linear.out_features}) whose weight is on the meta "
            "device: load or initialize the weights before quantization (e.g. build them in configure_model)."
        )
    weight = linear.weight.detach().to(device or linear.weight.device, dtype)  # NF4 dequantizes to this dtype
    layer = NF4Linear(linear.in_features, linear.out_features, bias=False, device="meta")
    nf4 = api.to_nf4(weight.contiguous(), _BLOCK, scaler_block_size(weight.numel()))
    layer.weight = nn.Parameter(nf4, requires_grad=False)
    if linear.bias is not None:
        layer.bias = linear.bias  # same Parameter: stays trainable
    return layer


@dataclass(frozen=True)
class TorchaoNF4Format(QuantFormat):
    """torchao ``NF4Tensor`` weights in :class:`NF4Linear` layers."""

    dense_forward: bool = True  # linear_nf4 is F.linear of the dequantized weight
    ladder: tuple[str, ...] = ("int8-dynamic", "none")  # wider modes that need no other library
    state_marks: tuple[str, ...] = tuple(f".weight.{name}" for name in _INNER)  # see NF4Linear._save_to_state_dict

    @override
    def check(self, name: str, layer: nn.Module) -> None:
        numel = cast(torch.Tensor, layer.weight).numel()
        if numel % _BLOCK:
            raise ValueError(
                f"Precision mode {self.name!r} stores weights in blocks of {_BLOCK}, but {name} has {numel} weights "
                f"({tuple(cast(torch.Tensor, layer.weight).shape)}), not a multiple of {_BLOCK}. Keep it unquantized with "
                f"ignore_modules=[{name!r}], or use mode 'nf4-dq' (bitsandbytes pads the last block)."
            )

    @override
    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, NF4Linear)

    @override
    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        weight = cast(Any, module.weight).get_original_weight()  # an NF4Tensor (torchao, untyped)
        return weight if dtype is None else weight.to(dtype)

    @override
    def compute_dtype(self, module: nn.Module) -> Optional[torch.dtype]:
        return cast(torch.Tensor, module.weight).dtype

    @override
    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        # inside the NF4Tensor (storage counting already walks its inner tensors: listed for checksums and
        # anyone counting constants apart from the 4-bit codes)
        weight: Any = module.weight  # an NF4Tensor (torchao, untyped)
        return [weight.quantized_scalers, weight.quantization_factor, weight.scaler_mean, weight.nf4]

    @override
    def rounding_grid(self, module: nn.Module) -> Optional[RoundingGrid]:
        # torchao packs NF4 codes as bitsandbytes does (two per byte, high nibble first); the block scales as
        # get_original_weight reads them back (double quantization undone)
        weight: Any = module.weight  # an NF4Tensor (torchao, untyped)
        scales = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor, weight.scaler_block_size)
        return RoundingGrid(weight.nf4, scales, weight.block_size, weight.quantized_data)


register_format(TorchaoNF4Format(
    "nf4-torchao",
    _quantize,
    (torch.bfloat16, torch.float16, torch.float32),
    "torchao NF4Tensor (torchtune's QLoRA format): 4-bit NormalFloat in blocks of 64, int8 block scales",
))

__all__ = ["NF4Linear", "TorchaoNF4Format", "scaler_block_size"]
