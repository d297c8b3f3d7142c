"""bitsandbytes modes: ``nf4``, ``nf4-dq``, ``fp4``, ``fp4-dq`` (4-bit), ``nf4-b32``, ``nf4-dq-b32`` (4-bit, smaller
blocks) and ``int8`` (LLM.int8, frozen).

Block size: bitsandbytes stores one absmax per block of 64 weights by default. ``-b32`` modes use blocks of
32: each weight is scaled by the largest of 31 neighbours instead of 63, so an outlier spoils fewer weights.
Measured on a 384x1536 Gaussian matrix with a few large columns (CPU, bitsandbytes 0.50.2), nf4-dq's relative
weight error falls from 0.1035 to 0.0918 (squared error -21 %) for 0.5177 -> 0.5336 bytes per parameter:
per byte, about six times what storing the same layer in int8 buys. The sensitivity-aware plan
(:mod:`lightning_hbm.precision.sensitivity`) chooses per layer between them.

bitsandbytes runs all of them on CPU (layers since 0.46, its optimizers since 0.50), so tests use the real
library. Each function builds the bitsandbytes layer on the meta device, hands it the *loaded* weight of the
user's Linear and moves it to the target device, which is when bitsandbytes quantizes (CPU included).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional, cast

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily

from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm.precision.registry import QuantFormat, RoundingGrid, register_format
from lightning_hbm.requirements import requirement

_BNB_AVAILABLE = RequirementCache(requirement("bitsandbytes"))
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def import_bnb() -> Any:
    """Import bitsandbytes or raise an error that says how to install it."""
    if not _BNB_AVAILABLE:
        raise ModuleNotFoundError(
            f"lightning_hbm's quantized precision modes need {requirement('bitsandbytes')} ({_BNB_AVAILABLE.message}). "
            f"Install it with `pip install '{requirement('bitsandbytes')}'` (it runs on CPU and CUDA)."
        )
    import bitsandbytes

    return bitsandbytes


def _target(linear: nn.Linear, device: Optional[torch.device]) -> torch.device:
    weight = linear.weight
    if weight.is_meta:
        raise ValueError(
            f"Cannot quantize a Linear({linear.in_features}, {linear.out_features}) whose weight is on the meta "
            "device: load or initialize the weights before quantization (e.g. build them in configure_model)."
        )
    return device if device is not None else weight.device


def _load_prequantized_hook(
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict[str, Any],
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Let a quantized ``Linear4bit`` load its own ``state_dict`` (bitsandbytes 0.50 does not).

    bitsandbytes writes the quantization state as ``weight.absmax``, ``weight.quant_map``, ...;
    its ``Linear4bit`` reports them as unexpected keys on load. We rebuild the ``QuantState``
    from them and let the default loader copy the packed ``weight`` bytes.
    """
    from bitsandbytes.functional import QuantState

    wkey = prefix + "weight"
    stats = {k[len(wkey) + 1 :]: state_dict.pop(k) for k in list(state_dict) if k.startswith(wkey + ".")}
    if not stats:
        return
    weight: Any = module.weight  # a bitsandbytes Params4bit: quant_state is its own attribute
    weight.quant_state = QuantState.from_dict(qs_dict=stats, device=weight.device)
    module.quant_state = weight.quant_state
    _unpack_in_compute_dtype(module)  # a checkpoint written before this rule says float32


def _layer4bit(linear: nn.Linear, dtype: torch.dtype, quant_type: str, double_quant: bool) -> nn.Module:
    """An empty ``Linear4bit`` shell on the meta device, shaped like ``linear`` (its block size is the weight's)."""
    return import_bnb().nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        compress_statistics=double_quant,
        quant_type=quant_type,
        device="meta",
    )


class _FlatInput:
    """Forward hooks of a 4-bit layer: a 2-D input in, the output reshaped back after the layer.

    bitsandbytes' ``MatMul4Bit`` returns a view for a 3-D input, and autograd forbids editing a view a custom Function
    made: Wav2Vec2's SpecAugment (``hidden_states[mask] = ...`` in training mode) on an unadapted ``feature_projection``
    failed with "Output 0 of MatMul4Bit is a view and is being modified inplace". A view made here, outside the
    Function, may be edited. No copy for a contiguous input; two Python calls per forward.
    """

    def __init__(self) -> None:
        self.shapes: list[Optional[torch.Size]] = []  # a stack: one entry per call in flight (recompute included)

    def flatten(self, module: nn.Module, args: tuple) -> Optional[tuple]:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or x.dim() <= 2:
            self.shapes.append(None)
            return None
        self.shapes.append(x.shape[:-1])
        return (x.reshape(-1, x.shape[-1]), *args[1:])

    def restore(self, module: nn.Module, args: tuple, output: Any) -> Any:
        shape = self.shapes.pop() if self.shapes else None
        if shape is None or not isinstance(output, torch.Tensor):
            return None
        return output.reshape(*shape, output.shape[-1])


def _unpack_in_compute_dtype(layer: nn.Module) -> None:
    """Make a 16-bit run's 4-bit weight unpack straight into its compute dtype.

    Why: bitsandbytes' 4-bit backward (``MatMul4Bit``) dequantizes the weight into its ``QuantState``'s dtype and then
    casts it to the gradient's. A weight quantized from fp32 for a bf16 run was unpacked to fp32 first, beside the bf16
    copy: 3x a bf16 copy of the largest projection alive at once (0.33 GiB for Llama-3-8B's MLP, 1.3 GiB at 70B). The
    values are the same either way: one rounding of the same fp32 products (tests/precision/test_bnb.py).
    """
    dtype = layer.compute_dtype
    if dtype in (torch.bfloat16, torch.float16):
        cast(Any, layer.weight).quant_state.dtype = dtype  # the layer's own quant_state is the same object


def _finish4bit(layer: nn.Module, linear: nn.Linear) -> nn.Module:
    _unpack_in_compute_dtype(layer)
    flat = _FlatInput()
    layer.register_forward_pre_hook(flat.flatten)
    layer.register_forward_hook(flat.restore, always_call=True)
    if linear.bias is not None:
        layer.bias = linear.bias  # same Parameter: stays trainable, cast to dtype by the plugin
    # Trap (seen with bitsandbytes 0.50): on CPUs with AVX512-BF16 the first no-grad eval
    # forward repacks the weight for a fast kernel that bypasses autograd, after which training
    # silently produces no input gradients. Never take that path for a training base.
    bnb_compat.disable_cpu_repack(layer)
    layer.register_load_state_dict_pre_hook(_load_prequantized_hook)
    return layer


def _linear4bit(
    linear: nn.Linear,
    dtype: torch.dtype,
    device: Optional[torch.device],
    quant_type: str,
    double_quant: bool,
    blocksize: int = 64,
) -> nn.Module:
    bnb = import_bnb()
    target = _target(linear, device)
    layer = _layer4bit(linear, dtype, quant_type, double_quant)
    weight = bnb.nn.Params4bit(
        linear.weight.data.detach(),
        requires_grad=False,
        quant_type=quant_type,
        compress_statistics=double_quant,
        blocksize=blocksize,  # Linear4bit takes none: the Params4bit and its quant_state carry it
        module=layer,
    )
    with bnb_compat.fast_cpu_quantize_4bit() if torch.device(target).type == "cpu" else contextlib.nullcontext():  # the same bytes, ~2x faster
        layer.weight = weight.to(target)  # bitsandbytes quantizes here, on CPU or CUDA
    return _finish4bit(layer, linear)


def _fake_linear4bit(
    linear: nn.Linear,
    dtype: torch.dtype,
    device: Optional[torch.device],
    quant_type: str,
    double_quant: bool,
    blocksize: int = 64,
) -> nn.Module:
    """``_linear4bit`` for a FakeTensor weight: bitsandbytes' own ``quantize_4bit`` (its registered fake
    kernel) gives the exact packed shape, absmax and nested constants; ``Params4bit`` cannot wrap a fake
    tensor, so the packed weight is a plain Parameter carrying the attributes bitsandbytes and peft read."""
    bnb = import_bnb()
    with unset_fake_temporarily():  # the shell lives on the meta device, outside the fake mode
        layer = _layer4bit(linear, dtype, quant_type, double_quant)
        if double_quant:
            # the nested quantization's code book is built (and cached module-wide) from Python floats
            # at bitsandbytes' first real call: build it for real, as that call would.
            bnb_compat.ensure_nested_code()
    packed, quant_state = bnb.functional.quantize_4bit(
        linear.weight.detach().contiguous(), blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    weight = nn.Parameter(packed, requires_grad=False)
    attributes = {"quant_state": quant_state, "quant_type": quant_type, "blocksize": blocksize,
                  "compress_statistics": double_quant, "quant_storage": packed.dtype, "bnb_quantized": True}
    for attr, value in attributes.items():
        setattr(weight, attr, value)
    layer.weight = weight
    layer.quant_state = quant_state
    return _finish4bit(layer, linear)


def _layer8bit(linear: nn.Linear) -> nn.Module:
    # has_fp16_weights=False: frozen int8 storage (has_fp16_weights=True fails backward on 3-D inputs).
    # threshold=6.0: LLM.int8's outlier decomposition (columns above it run in 16-bit).
    return import_bnb().nn.Linear8bitLt(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        has_fp16_weights=False,
        threshold=6.0,
        device="meta",
    )


def _linear8bit(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    bnb = import_bnb()
    target = _target(linear, device)
    layer = _layer8bit(linear)
    layer.weight = bnb.nn.Int8Params(
        linear.weight.data.detach().to(dtype), requires_grad=False, has_fp16_weights=False
    ).to(target)
    return _finish8bit(layer, linear)


def _finish8bit(layer: nn.Module, linear: nn.Linear) -> nn.Module:
    if linear.bias is not None:
        layer.bias = linear.bias
    # the row scales on the layer too (bitsandbytes moves them there at the first forward): the only copy once FSDP2
    # has swapped the weight for a DTensor shard (an int8 embedding table, gathered for the lookup, needs them)
    cast(Any, layer).state.SCB = getattr(layer.weight, "SCB", None)
    bnb_compat.drop_kept_inputs(layer)  # else checkpointing keeps every input (see there)
    return layer


def _fake_linear8bit(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    """``_linear8bit`` for a FakeTensor weight: int8 rows and fp32 row scales from bitsandbytes' own
    ``int8_vectorwise_quant`` (what ``Int8Params`` runs when moved to a device), as a plain Parameter."""
    bnb = import_bnb()
    with unset_fake_temporarily():
        layer = _layer8bit(linear)
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(linear.weight.detach().to(dtype).contiguous().to(torch.float16))
    weight: Any = nn.Parameter(cb, requires_grad=False)  # given the attributes of bitsandbytes' Int8Params below
    weight.CB, weight.SCB, weight.has_fp16_weights = cb, scb, False
    layer.weight = weight
    return _finish8bit(layer, linear)


def _fake4(quant_type: str, double_quant: bool, blocksize: int = 64) -> Any:
    return partial(_fake_linear4bit, quant_type=quant_type, double_quant=double_quant, blocksize=blocksize)


def _bnb_layer(module: nn.Module, cls_name: str) -> bool:
    # bitsandbytes not imported yet: no module can be one of its layers (and counting must not load it)
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, getattr(bnb.nn, cls_name))


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors of a bitsandbytes ``QuantState`` (absmax, code book, offset), its nested state's included."""
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            yield value
        elif type(value) is type(state):  # state2: the double quantization of absmax
            yield from _state_tensors(value)


@dataclass(frozen=True)
class Bnb4bitFormat(QuantFormat):
    """bitsandbytes ``Linear4bit``: packed 4-bit codes, constants in its ``QuantState`` (absmax, code book,
    nested absmax), kept on the weight and on the layer (the only copy once FSDP2 shards the weight)."""

    peft_kind: Optional[str] = "4bit"
    dense_forward: bool = True  # Linear4bit dequantizes the whole weight and runs F.linear
    state_marks: tuple[str, ...] = (".absmax", ".quant_map", ".quant_state.", ".nested_absmax")
    matmul_ops: tuple[str, ...] = ("bitsandbytes::gemm_4bit",)  # MatMul4Bit's forward (bitsandbytes 0.50), CPU and CUDA

    def owns(self, module: nn.Module) -> bool:
        return _bnb_layer(module, "Linear4bit")

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        from bitsandbytes.functional import dequantize_4bit

        state: Any = copy.copy(getattr(module.weight, "quant_state", None) or module.quant_state)  # a bitsandbytes QuantState
        state.dtype = dtype or state.dtype  # straight into dtype: no full-size copy in the stored dtype first
        return dequantize_4bit(cast(torch.Tensor, module.weight).data, state)

    def compute_dtype(self, module: nn.Module) -> Optional[torch.dtype]:
        return cast(Optional[torch.dtype], module.compute_dtype)  # a Linear4bit's plain attribute

    def gather_rows(self, module: nn.Module, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Only the rows asked for are unpacked: their packed bytes and their blocks' absmax are gathered, then
        # bitsandbytes dequantizes that small tensor. bitsandbytes' own Embedding4bit does this too, but only without
        # double quantization and with no state_dict; here the nested absmax (8-bit codes, one fp32 scale per 256)
        # is decoded for the gathered blocks alone, so nf4-dq works and the storage stays the Linear4bit's.
        state: Any = getattr(module.weight, "quant_state", None) or module.quant_state
        rows, cols = (int(d) for d in state.shape)
        if cols % state.blocksize:  # a row's values share blocks with the next row's: no row-wise unpacking
            return super().gather_rows(module, index, dtype)
        per_row = cols // state.blocksize
        packed = cast(torch.Tensor, module.weight).data.view(torch.uint8).view(rows, cols // 2)[index]
        blocks = (index[:, None] * per_row + torch.arange(per_row, device=index.device)).reshape(-1)
        return self._unpacked(state, packed, blocks, state.absmax[blocks], dtype)

    def gather_range(self, module: nn.Module, start: int, stop: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # gather_rows on views: the packed rows start:stop and their blocks' absmax are contiguous (the same values)
        state: Any = getattr(module.weight, "quant_state", None) or module.quant_state
        rows, cols = (int(d) for d in state.shape)
        if cols % state.blocksize:
            return super().gather_range(module, start, stop, dtype, device)
        per_row = cols // state.blocksize
        packed = cast(torch.Tensor, module.weight).data.view(torch.uint8).view(rows, cols // 2)[start:stop]
        blocks = torch.arange(start * per_row, stop * per_row, device=device)
        return self._unpacked(state, packed, blocks, state.absmax[start * per_row:stop * per_row], dtype)

    @staticmethod
    def _unpacked(state: Any, packed: torch.Tensor, blocks: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The ``[len(packed), in]`` rows of ``packed`` (4-bit pairs), whose ``blocks`` have ``absmax`` (as stored)."""
        from bitsandbytes.functional import QuantState, dequantize_4bit

        if state.nested:  # dequantize_blockwise(absmax, state2) + offset, for these blocks only
            nested = state.state2
            absmax = nested.code[absmax.long()] * nested.absmax[blocks // nested.blocksize] + state.offset
        part = QuantState(absmax=absmax.float(), shape=torch.Size((packed.shape[0], int(state.shape[1]))), code=state.code,
                          blocksize=state.blocksize, quant_type=state.quant_type, dtype=dtype)
        return dequantize_4bit(packed.reshape(-1, 1), part)

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        states = (getattr(module.weight, "quant_state", None), getattr(module, "quant_state", None))
        return [t for state in states if state is not None for t in _state_tensors(state)]

    def weight_shape(self, module: nn.Module) -> torch.Size:
        # the QuantState keeps the unpacked shape: on the weight, and on the layer (the only copy once FSDP2 has
        # swapped the weight for a DTensor shard); an empty shell (meta, not quantized yet) has none
        state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        return torch.Size(state.shape) if state is not None else cast(torch.Tensor, module.weight).shape

    def rounding_grid(self, module: nn.Module) -> Optional[RoundingGrid]:
        state = cast(Any, module.weight).quant_state  # a bitsandbytes Params4bit's QuantState
        absmax = state.absmax
        if state.nested:  # the absmax each block is scaled by, as the dequantization uses it
            from bitsandbytes.functional import dequantize_blockwise

            absmax = dequantize_blockwise(state.absmax, state.state2) + state.offset
        return RoundingGrid(state.code, absmax, state.blocksize, cast(torch.Tensor, module.weight).data)


@dataclass(frozen=True)
class Bnb8bitFormat(QuantFormat):
    """bitsandbytes ``Linear8bitLt`` (LLM.int8): int8 rows and fp32 row scales ``SCB``, which the layer moves
    from its weight into ``layer.state`` at its first forward."""

    peft_kind: Optional[str] = "8bit"
    ladder: tuple[str, ...] = ("none",)
    cost: float = 0.5
    state_marks: tuple[str, ...] = (".SCB",)
    # MatMul8bitLt's forward (bitsandbytes 0.50): with outlier columns (threshold 6.0) and without
    matmul_ops: tuple[str, ...] = ("bitsandbytes::int8_mixed_scaled_mm", "bitsandbytes::int8_scaled_mm")

    def owns(self, module: nn.Module) -> bool:
        return _bnb_layer(module, "Linear8bitLt")

    def _row_scales(self, module: nn.Module) -> Optional[torch.Tensor]:
        scales = getattr(module.weight, "SCB", None)
        return scales if scales is not None else getattr(getattr(module, "state", None), "SCB", None)

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        # read directly: peft's dequantize_module_weight re-moves an 8-bit weight on CPU, which drops its row
        # scales and breaks the layer's next forward. int8 rows scaled by absmax / 127.
        weight = cast(torch.Tensor, module.weight).data.float() * (cast(torch.Tensor, self._row_scales(module)).float()[:, None] / 127.0)  # a quantized layer has row scales
        return weight if dtype is None else weight.to(dtype)

    def gather_rows(self, module: nn.Module, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # int8 rows with one scale each: gathered, then scaled (absmax / 127) as dequantize does for the whole weight;
        # scaled in place in the fresh fp32 copy (a product beside it doubled a head slice's transient)
        scales = cast(torch.Tensor, self._row_scales(module)).float()[index, None] / 127.0
        return cast(torch.Tensor, module.weight).data[index].float().mul_(scales).to(dtype)

    def gather_range(self, module: nn.Module, start: int, stop: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # gather_rows' arithmetic on views of the rows and their scales: the same values, no index gather
        scales = cast(torch.Tensor, self._row_scales(module))[start:stop, None].float() / 127.0
        return cast(torch.Tensor, module.weight).data[start:stop].float().mul_(scales).to(dtype)

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        state = getattr(module, "state", None)
        found = [self._row_scales(module), getattr(state, "SCB", None), getattr(state, "CB", None)]
        return [t for t in found if isinstance(t, torch.Tensor)]


# name -> (quant_type, double quantization, block size, description, wider modes for sensitive layers)
_FOUR_BIT = {
    "nf4": ("nf4", False, 64, "4-bit NormalFloat, fp32 absmax per 64 values", ("nf4-b32", "int8")),
    "nf4-dq": ("nf4", True, 64, "4-bit NormalFloat, the absmax per 64 values quantized again to 8 bits (QLoRA)", ("nf4-dq-b32", "int8")),
    "nf4-b32": ("nf4", False, 32, "as `nf4`, one absmax per 32 values: an outlier spoils fewer weights", ("int8",)),
    "nf4-dq-b32": ("nf4", True, 32, "as `nf4-dq`, one absmax per 32 values", ("int8",)),
    "fp4": ("fp4", False, 64, "4-bit float, fp32 absmax per 64 values", ("int8",)),
    "fp4-dq": ("fp4", True, 64, "4-bit float, the absmax quantized again to 8 bits", ("int8",)),
}
for _name, (_quant_type, _double_quant, _blocksize, _description, _ladder) in _FOUR_BIT.items():
    register_format(Bnb4bitFormat(
        _name,
        partial(_linear4bit, quant_type=_quant_type, double_quant=_double_quant, blocksize=_blocksize),
        _FLOAT_DTYPES,
        _description,
        fake=_fake4(_quant_type, _double_quant, _blocksize),
        ladder=_ladder,
    ))


def _int8(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    return _linear8bit(linear, dtype, device)


register_format(Bnb8bitFormat(
    "int8", _int8, _FLOAT_DTYPES, "LLM.int8: int8 rows + fp32 row scales, outlier columns in 16-bit", fake=_fake_linear8bit
))
