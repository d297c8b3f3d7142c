"""A quantized Linear whose weight the model's code reads directly: the weight it reads computes from the storage.

torchvision's Swin never calls its attention's ``qkv`` and ``proj``: ``ShiftedWindowAttention.forward`` passes
``self.qkv.weight`` and ``self.proj.weight`` to ``shifted_window_attention``, which runs ``F.linear(x, qkv_weight,
qkv_bias)``; transformers' Mamba computes ``self.dt_proj.weight @ time_step``. Such a layer was kept in the compute
dtype (27 % of a small Swin, issue 53): a packed 4-bit weight handed to ``F.linear`` computes nothing sensible, and
an adapter around a layer nobody calls is never run.

:class:`ReadableLinear` holds the mode's layer (a bitsandbytes ``Linear4bit``, ...) as its child ``quantized``, as
:class:`~lightning_hbm.layers.linear.Fp32ComputeLinear` does, and its ``weight`` is a :class:`ReadWeight`: a tensor
of the weight's shape and compute dtype with no storage of its own (as torchao's ``NF4Tensor`` is for ``F.linear``).
``F.linear(x, w, b)``, ``x @ w.T``, ``torch.matmul(x, w.t())`` and ``w @ y`` on it call the layer, or the LoRA layer
around it: the same bitsandbytes kernel as a called layer (no dense weight kept for the backward), and the adapter
runs and trains. ``w.t()``, ``.T``, ``.detach()``, ``.data`` and a ``.to()`` of dtype only give another such tensor;
any other op gets the dequantized weight (plus the adapter's ``B @ A``, so its gradient still flows). That is the
weight read through the LoRA layer, as the model reads it; the base layer's own ``weight`` (``LoRA.merge``) is the base
weight alone. Writing to it is an error (the storage is frozen and packed).

Which layers: a plain ``nn.Linear`` the probe step (:mod:`lightning_hbm.layers.readers`) saw used directly (not its
dtype or shape alone) and never written, in a bitsandbytes (4-bit, int8), ``nf4-torchao``, ``int8-dynamic`` or
``int4-g32`` mode. The guard and the compute dtype stay where this cannot work: a path the probe did not run (the layer
was quantized as any other: a read there raises ``UnobservedRead``), an in-place write to the weight, a convolution,
embedding or experts layer (no such tensor for them), a Linear subclass with its own forward, a layer whose dtype or
shape alone is read (as before: T5's ``wo`` shows an fp32 weight), and a run without ``QuantizedPrecision`` (LoRA alone
leaves the layer as built: an adapter around it would be skipped, so it is no target).

GPTQ rounding and the calibrated correction (``rounding="gptq"``, ``correction_rank``) work on the mode's layer before
it is wrapped (``precision/quantize.py``), from the inputs the probe forward saw the model's code multiply the weight
with (:func:`lightning_hbm.precision.gptq.input_statistics`): such a layer is rounded and corrected like any Linear.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional, cast

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from lightning_hbm import record
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers.correction import correction_weight
from lightning_hbm.memory.storage import quantized_format

# ops a ReadWeight answers from its own metadata (its shape, dtype, device are the weight's)
_METADATA = frozenset({
    "dtype", "shape", "size", "ndim", "dim", "numel", "element_size", "nbytes", "itemsize", "is_floating_point",
    "is_complex", "device", "requires_grad", "is_cuda", "is_meta", "is_sparse", "layout", "grad", "is_leaf", "names",
    "is_contiguous", "grad_fn", "is_nested", "is_quantized", "is_mkldnn", "__len__", "__hash__", "_version",
})
_MATMUL = frozenset({"linear", "matmul", "__matmul__"})
_TRANSPOSE = frozenset({"t", "T", "mT", "transpose", "permute"})
_SAME = frozenset({"contiguous", "requires_grad_"})


def writes(op: str) -> bool:
    """Whether ``op`` writes to the tensor it is called on (``add_``, ``copy_``, ``w[i] = ...``, ``w.data = ...``):
    what a weight computed from frozen packed storage cannot take (the layer is then kept as it is)."""
    return op.endswith("_") and not op.startswith("__") and op != "requires_grad_" or op in ("__setitem__", "__set__") or op.startswith("__i")


def op_name(func: Any) -> str:
    """The name of the op ``func`` as ``__torch_function__`` gets it (a property's name for its descriptor)."""
    # properties (.T, .data, .shape) reach __torch_function__ as their descriptor's __get__ (or __set__)
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        return cast(str, getattr(getattr(func, "__self__", None), "__name__", name))
    return cast(str, name)


class ReadWeight(torch.Tensor):
    """The ``[out, in]`` weight of a :class:`ReadableLinear` (``[in, out]`` once transposed), computed from its
    storage when used. ``adapted``: include the LoRA adapter around the layer (not after ``.detach()``/``.data``)."""

    _layer: ReadableLinear
    _transposed: bool
    _adapted: bool

    @staticmethod
    def __new__(cls, layer: ReadableLinear, transposed: bool = False, adapted: bool = True, dtype: Optional[torch.dtype] = None) -> ReadWeight:
        shape = (layer.in_features, layer.out_features) if transposed else (layer.out_features, layer.in_features)
        made = torch_compat.wrapper_tensor(cls, shape, dtype or layer.weight_dtype(), layer.storage_device())  # no storage
        made._layer, made._transposed, made._adapted = layer, transposed, adapted
        return cast(ReadWeight, made)

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # __new__ did everything
        super().__init__()

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ReadWeight(shape={tuple(self.shape)}, dtype={self.dtype}, stored in {type(self._layer.storage()).__name__})"

    def _like(self, transposed: Optional[bool] = None, adapted: Optional[bool] = None, dtype: Optional[torch.dtype] = None) -> ReadWeight:
        return ReadWeight(
            self._layer, self._transposed if transposed is None else transposed, self._adapted if adapted is None else adapted,
            dtype or self.dtype,
        )

    def dense(self, adapted: Optional[bool] = None) -> torch.Tensor:
        """The weight as a plain tensor: dequantized (plus the adapter's ``B @ A``, differentiable, when adapted)."""
        weight = self._layer.dense(self._adapted if adapted is None else adapted).to(self.dtype)
        return weight.t() if self._transposed else weight

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = op_name(func)
        first = args[0] if args else None
        if op in _METADATA or op in _SAME and isinstance(first, ReadWeight) and not (op == "requires_grad_" and _wants_grad(args, kwargs)):
            with torch_compat.subclass_functions_off():
                result = func(*args, **kwargs)
            return first if op in _SAME else result
        if writes(op):
            layer = first._layer if isinstance(first, ReadWeight) else None
            reader, name = _SERVED.get(layer, ("", "")) if layer is not None else ("", "")
            raise RuntimeError(
                f"lightning_hbm: {op} would write to {f'the weight of {name!r}' if name else 'a weight'} stored quantized ({first!r}"
                f"{f', read directly by {reader}' if reader else ''}), which cannot be written (frozen packed storage). Keep "
                f"this layer as built: QuantizedPrecision(ignore_modules=[{repr(name) if name else '<its name>'}])."
            )
        served = _serve(op, args, kwargs)
        if served is not NotImplemented:
            return served
        # any other op: on the dequantized weight (no ReadWeight left: the op runs as on any tensor; the storage's own
        # tensor subclasses, torchao's NF4Tensor, keep their __torch_function__ while dequantizing)
        dense_args, dense_kwargs = tree_map_only(ReadWeight, ReadWeight.dense, args), tree_map_only(ReadWeight, ReadWeight.dense, kwargs)
        return func(*dense_args, **dense_kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:  # type: ignore[override]  # torch declares a plain function
        # below autograd (an op __torch_function__ did not see): the dequantized weight, with no adapter
        def plain(w: ReadWeight) -> torch.Tensor:
            return w.dense(adapted=False)

        return func(*tree_map_only(ReadWeight, plain, args), **tree_map_only(ReadWeight, plain, kwargs or {}))


def _wants_grad(args: tuple, kwargs: dict) -> bool:
    return bool(kwargs.get("requires_grad", args[1] if len(args) > 1 else True))


def _serve(op: str, args: tuple, kwargs: dict) -> Any:
    """The ops computed by calling the layer, and those that give another :class:`ReadWeight`; else NotImplemented."""
    weights = [a for a in args if isinstance(a, ReadWeight)]
    if len(weights) != 1 or not args:
        return NotImplemented
    weight = weights[0]
    if op in _MATMUL:
        return _serve_matmul(op, weight, args, kwargs)
    if args[0] is not weight:
        return NotImplemented
    if op in ("detach", "data"):
        return weight._like(adapted=False)  # no gradient to the weight: nor to its adapter
    if op in _TRANSPOSE and swaps_the_two_dims(op, args[1:], kwargs):
        return weight._like(transposed=not weight._transposed)
    if op == "to":
        device, dtype, _, _ = torch_compat.parse_to(*args[1:], **kwargs)
        if device is None or torch.device(device) == weight.device:
            return weight if dtype is None or dtype == weight.dtype else weight._like(dtype=dtype)
    return NotImplemented


def swaps_the_two_dims(op: str, rest: tuple, kwargs: dict) -> bool:
    """Whether the transposing ``op`` with the arguments ``rest`` (after the tensor) swaps a matrix's two dims."""
    if op in ("t", "T", "mT"):
        return True
    if op == "transpose":
        dims = [*rest, *kwargs.values()]
        return len(dims) == 2 and {int(d) % 2 for d in dims} == {0, 1}
    order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest
    return [int(d) % 2 for d in order] == [1, 0]  # permute(1, 0)


def _serve_matmul(op: str, weight: ReadWeight, args: tuple, kwargs: dict) -> Any:
    if op == "linear":  # F.linear(x, W, b): y = x W^T + b
        x, bias = args[0], args[2] if len(args) > 2 else kwargs.get("bias")
        if weight is not args[1] or weight._transposed or isinstance(x, ReadWeight) or x.dim() < 1:
            return NotImplemented
        return weight._layer.read(x, bias, weight._adapted, weight.dtype)
    if len(args) != 2 or kwargs:
        return NotImplemented
    left, right = args
    if right is weight and weight._transposed and left.dim() >= 1:  # x @ W^T
        return weight._layer.read(left, None, weight._adapted, weight.dtype)
    if left is weight and not weight._transposed and right.dim() >= 2:  # W @ y = (y^T W^T)^T (Mamba's dt_proj)
        return weight._layer.read(right.transpose(-1, -2), None, weight._adapted, weight.dtype).transpose(-1, -2)
    return NotImplemented


class ReadableLinear(nn.Linear):
    """An ``nn.Linear`` stored by a precision mode (the child ``quantized``) whose ``weight``, read by the model's
    code, is a :class:`ReadWeight` computed from that storage. Calling it is calling the storage. Built by
    :func:`readable` only."""

    @property
    def coverage_note(self) -> str:
        """Said in the coverage table's last column: stored small, and why it is no plain quantized layer."""
        return f"stored quantized; its weight, read directly by {served_reader(self) or 'the model'}, computes from the storage"

    def storage(self) -> nn.Module:
        """The mode's layer holding the ``[out, in]`` weight."""
        return cast(nn.Module, self._modules["quantized"])

    def storage_device(self) -> torch.device:
        return cast(torch.Tensor, self.storage().weight).device

    def weight_dtype(self) -> torch.dtype:
        storage = self.storage()
        fmt = quantized_format(storage)
        dtype = fmt.compute_dtype(storage) if fmt is not None else None
        return dtype or (self.bias.dtype if self.bias is not None else torch.float32)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # read through peft's LoRA layer (its `weight` property returns its base's), as the model reads it: the weight
        # with its adapter, whose reads call that layer (also where LoRA was applied outside the surgery, which links
        # it: link_adapters). Read from the base layer itself (LoRA.merge, peft's own code): the base weight alone.
        caller = sys._getframe(1).f_locals.get("self")
        through_lora = caller is not None and caller is not self and getattr(caller, "base_layer", None) is self
        if through_lora:
            self.__dict__["_outer"] = caller
        return ReadWeight(self, adapted=through_lora)

    def dense(self, adapted: bool = True) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight, plus the adapter's ``B @ A`` (differentiable) when ``adapted``."""
        storage = self.storage()
        with torch.no_grad():  # frozen storage, and its calibrated correction (QuantizedPrecision(correction_rank=))
            weight = quantized_format(storage).dequantize(storage, self.weight_dtype())
            correction = correction_weight(storage)
            if correction is not None:
                weight = weight + correction.to(weight.device, weight.dtype)
        outer: Any = self.outer() if adapted else None  # peft's LoRA layer
        if outer is None or getattr(outer, "merged", False) or getattr(outer, "disable_adapters", False):
            return weight
        for name in outer.active_adapters:
            if name in outer.lora_A:
                if name in getattr(outer, "lora_variant", {}):
                    raise NotImplementedError(
                        f"lightning_hbm: the weight of a layer adapted with a LoRA variant ({type(outer.lora_variant[name]).__name__}) "
                        "was read directly by an op that needs it whole; use plain LoRA for this layer."
                    )
                weight = weight + outer.get_delta_weight(name).to(weight.dtype)
        return weight

    def outer(self) -> Optional[nn.Module]:
        """The LoRA layer around this one (linked by :func:`link_adapters`), if it still wraps it."""
        outer = self.__dict__.get("_outer")
        return outer if outer is not None and getattr(outer, "base_layer", None) is self else None

    def read(self, x: torch.Tensor, bias: Any, adapted: bool, dtype: torch.dtype) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for the model's ``weight`` read: the layer (its adapter too, if ``adapted``)
        called on ``x``, with ``bias`` in place of its own."""
        caller: Callable[..., torch.Tensor] = self.outer() if adapted and self.outer() is not None else self  # type: ignore[assignment]
        stack: list[Any] = self.__dict__.setdefault("_biases", [])
        stack.append(bias)
        try:
            return caller(x.to(dtype) if x.dtype != dtype and x.is_floating_point() else x)
        finally:
            stack.pop()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stack = self.__dict__.get("_biases") or [self.bias]  # a read's bias (Swin-V2 zeroes the key's part of a copy)
        out = cast(torch.Tensor, self.storage()(x))
        return out if stack[-1] is None else out + stack[-1].to(out.dtype)

    @classmethod
    def from_quantized(cls, linear: nn.Linear, quantized: nn.Module) -> ReadableLinear:
        new: Any = cls.__new__(cls)
        nn.Module.__init__(new)  # not nn.Linear's: it would allocate a weight the storage holds
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.bias = linear.bias  # the same Parameter (trained as before); held here only: a read may pass another
        cast(Any, quantized).bias = None
        new.quantized = quantized
        return cast(ReadableLinear, new)


# layers of models as built whose weight the probe step saw read directly, by reads a ReadWeight serves: (the reader,
# the layer's name in the model: "" where not given), the name for the error a write to their weight raises
_SERVED: weakref.WeakKeyDictionary[nn.Module, tuple[str, str]] = weakref.WeakKeyDictionary()


def mark_served(layer: nn.Module, reader: str, name: str = "") -> None:
    """The probe step saw ``reader`` read ``layer``'s weight (the layer ``name`` of the model) in ways a
    :class:`ReadWeight` serves."""
    _SERVED[layer] = (reader, name)


def served_reader(layer: nn.Module) -> Optional[str]:
    """The reader of ``layer``'s weight if a quantized ``layer`` will serve it (a plain Linear marked by the probe), or
    already does (a :class:`ReadableLinear`); ``None`` otherwise."""
    served = _SERVED.get(layer)
    if served is not None:
        return served[0]
    return "" if isinstance(layer, ReadableLinear) else None


def servable(layer: nn.Module) -> bool:
    """A plain ``nn.Linear`` (its forward is ``nn.Linear``'s): the only layer a :class:`ReadableLinear` replaces."""
    return isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward and not isinstance(layer, ReadableLinear)


def readable(linear: nn.Module, quantized: nn.Module) -> nn.Module:
    """``quantized`` (the mode's layer built from ``linear``), in a :class:`ReadableLinear` if the probe step saw the
    model's code read ``linear``'s weight directly; as it is otherwise. Called by the formats' ``replace``."""
    served = _SERVED.get(linear)
    if served is None or not isinstance(linear, nn.Linear):
        return quantized
    new = ReadableLinear.from_quantized(linear, quantized)
    _SERVED[new] = served
    record.set_converted(new, "Linear")  # resume maps its storage's keys to the layer's weight (the LINEAR kind's name)
    return new


def link_adapters(module: nn.Module) -> int:
    """Tell each :class:`ReadableLinear` in ``module`` the LoRA layer around it (peft's ``base_layer``), so that a
    read of its weight runs the adapter; returns how many were linked. Called once the model is changed."""
    linked = 0
    for sub in module.modules():
        base = getattr(sub, "base_layer", None)
        if isinstance(base, ReadableLinear) and sub is not base:
            # a plain attribute (no child module, no cycle in modules()); a strong reference, which deepcopy maps to
            # the copy's LoRA layer (a weak one would still point at the original's)
            base.__dict__["_outer"] = sub
            linked += 1
    return linked


__all__ = ["ReadWeight", "ReadableLinear", "link_adapters", "mark_served", "op_name", "readable", "servable", "served_reader", "swaps_the_two_dims", "writes"]
