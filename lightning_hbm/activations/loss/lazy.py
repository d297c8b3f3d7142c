"""``LazyLogits``: the head's output not computed yet, and the head ``forward`` that returns it."""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.loss.chunked import fused_linear_cross_entropy
from lightning_hbm.memory.tracker import LOSS_SCOPE, memory_scope

log = logging.getLogger(__name__)

_CE_SIGNATURE = inspect.signature(F.cross_entropy)


class _HeadState:
    """Per head: how to compute it, the model it belongs to (for messages), and whether it warned already."""

    def __init__(self, name: str, module: nn.Module, chunk_size: Optional[int], kernel: str, model: str = "") -> None:
        self.name, self.module, self.chunk_size, self.kernel = name, module, chunk_size, kernel
        self.model = model  # e.g. "BartForConditionalGeneration in MyModule": the warning names the model
        self.materialized_by: Optional[str] = None
        self.elementwise: list[str] = []  # elementwise ops seen on the logits (applied per chunk)
        self.fused_logged = False

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        # the class's forward when the instance attribute is our wrapper (see _LazyHead); another instance
        # forward is _dequantized_once's, active while the chunks run
        forward = self.module.__dict__.get("forward")
        if forward is None or isinstance(forward, _LazyHead):
            return type(self.module).forward(self.module, x, *args, **kwargs)
        return forward(x, *args, **kwargs)


def _metadata_functions() -> set[Any]:
    """Tensor attributes answered from the lazy tensor's recorded shape/dtype/device, without computing."""
    props = ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "is_cpu", "layout", "is_sparse", "is_meta",
             "is_quantized", "is_nested", "grad_fn", "is_leaf", "grad", "names", "itemsize", "nbytes", "is_mps")
    found = {getattr(torch.Tensor, p).__get__ for p in props if hasattr(torch.Tensor, p)}
    methods = ("dim", "size", "numel", "nelement", "ndimension", "is_floating_point", "is_complex", "element_size",
               "get_device", "__len__", "__hash__")
    return found | {getattr(torch.Tensor, m) for m in methods}


_METADATA = _metadata_functions()
# Elementwise ops replayed chunk by chunk: tanh (soft-capping), and + - * / with a number or a tensor along the
# vocabulary (_elementwise and LazyLogits._along_vocab check the operand). The logits may be either operand
# (``bias + logits`` calls ``Tensor.__add__(bias, logits)``).
_ELEMENTWISE = {
    **dict.fromkeys((torch.tanh, torch.Tensor.tanh), "tanh"),
    **dict.fromkeys((torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__), "add"),
    **dict.fromkeys((torch.sub, torch.subtract, torch.Tensor.sub, torch.Tensor.subtract, torch.Tensor.__sub__,
                     torch.Tensor.__rsub__, torch.rsub), "sub"),
    **dict.fromkeys((torch.mul, torch.multiply, torch.Tensor.mul, torch.Tensor.multiply, torch.Tensor.__mul__,
                     torch.Tensor.__rmul__), "mul"),
    **dict.fromkeys((torch.div, torch.divide, torch.true_divide, torch.Tensor.div, torch.Tensor.divide,
                     torch.Tensor.true_divide, torch.Tensor.__truediv__), "div"),
}
_DIVISORS = (torch.div, torch.divide, torch.true_divide, torch.Tensor.div, torch.Tensor.divide, torch.Tensor.true_divide,
             torch.Tensor.__truediv__)


class _Op:
    """One elementwise op on the logits, replayed on each chunk (or on all of them when materialized).

    ``args`` are the op's arguments with ``None`` where the logits go; the logits are cast first to the dtype they had
    when the op ran (a lazy ``.float()`` before it), so each chunk computes what the unfused op computed.
    """

    def __init__(self, name: str, func: Any, args: tuple, kwargs: dict, position: int, dtype: torch.dtype) -> None:
        self.name, self.func, self.args, self.kwargs, self.position, self.dtype = name, func, args, kwargs, position, dtype

    @property
    def operands(self) -> list[torch.Tensor]:
        """Tensor operands that need a gradient (a trainable bias or scale): the fused loss must return theirs."""
        return [a for a in self.args if isinstance(a, torch.Tensor) and a.requires_grad]

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        args = list(self.args)
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.ndim > z.ndim:
                args[i] = a.reshape(a.shape[a.ndim - z.ndim:])  # [1, 1, V] on a [n, V] chunk: only leading 1s go
        args[self.position] = z.to(self.dtype)
        return self.func(*args, **self.kwargs)


_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
          torch.Tensor.bfloat16: torch.bfloat16, torch.Tensor.half: torch.float16}


class LazyLogits(torch.Tensor):
    """Logits ``head(hidden)`` not computed yet (a tensor with no storage of its own).

    Token-dimension views and dtype casts stay lazy; ``F.cross_entropy`` on a ``[N, vocab]`` lazy
    tensor is fused and chunked; anything else computes the full logits once (``materialize``).
    """

    _hidden: torch.Tensor
    _state: _HeadState
    _real: Optional[torch.Tensor]
    _post: tuple[_Op, ...]  # elementwise ops applied per chunk (soft-capping, final_logits_bias, scales)

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, state: _HeadState, dtype: torch.dtype, post: tuple[_Op, ...] = ()) -> "LazyLogits":
        shape = (*hidden.shape[:-1], int(cast(int, state.module.out_features)))  # a Linear-like head's attribute
        # requires_grad=False: nothing runs autograd on this object itself (every computation is on
        # hidden and the head), and module hooks (profilers) must not attach gradient hooks to it.
        self = torch_compat.make_wrapper_subclass(cls, shape, dtype=dtype, device=hidden.device, requires_grad=False)
        self._hidden, self._state, self._real, self._post = hidden, state, None, post
        return self

    # repr is not a torch function: materialize here
    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # Tensor's own signature: mypy 2.4 flags even an identical one
        return f"LazyLogits({self.materialize('repr')!r})"

    def _derive(self, hidden: torch.Tensor, dtype: Optional[torch.dtype] = None, post: tuple = ()) -> "LazyLogits":
        return LazyLogits(hidden, self._state, dtype or self.dtype, self._post + post)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head, then the recorded elementwise ops: the logits of ``hidden`` (one chunk, or all of them)."""
        logits = self._state.forward(hidden)
        for op in self._post:
            logits = op(logits)
        return logits

    def materialize(self, why: str = "materialize") -> torch.Tensor:
        """The real logits (computed once per lazy tensor; a ``UserWarning`` once per head)."""
        if self._real is None:
            state = self._state
            if state.materialized_by is None:
                state.materialized_by = why
                warnings.warn(_materialize_message(why, state, tuple(self.shape), self.numel() * self.element_size()),
                              UserWarning, stacklevel=4)
                log.debug("FusedLoss: %s materialized the logits of %s", why, state.name)
            # in the loss scope: HBMProfiler's and the planner's `loss` term then show these full logits, not 0
            with memory_scope(LOSS_SCOPE):
                self._real = self._head(self._hidden).to(self.dtype)
        return self._real

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch_compat.disable_torch_function_subclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.untyped_storage:
            # It owns no memory; memory tools (torch's MemTracker, HBMProfiler) must count 0 bytes, not the shape.
            return torch.UntypedStorage(0, device=args[0].device)
        lazy = args[0] if args and isinstance(args[0], LazyLogits) else None
        if func is F.cross_entropy:
            out = _fused_cross_entropy(args, kwargs)
            if out is not None:
                return out
        elif func in _ELEMENTWISE:
            out = _elementwise(func, args, kwargs)
            if out is not None:
                return out
        elif lazy is not None:
            out = lazy._lazy_op(func, args[1:], kwargs)
            if out is not None:
                return out
        name = getattr(func, "__name__", str(func))
        unwrap = lambda x: x.materialize(name) if isinstance(x, LazyLogits) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:  # type: ignore[override]  # torch types Tensor's as a plain function, subclasses' are classmethods
        raise RuntimeError(f"lightning_hbm FusedLoss: {func} reached a LazyLogits below autograd; please report this.")

    def _lazy_op(self, func: Any, args: tuple, kwargs: dict) -> Optional["LazyLogits"]:
        """The op as a new lazy tensor if it only touches token dimensions or the dtype, else ``None``."""
        if func in _CASTS and not args and not kwargs.get("memory_format"):
            return self if _CASTS[func] == self.dtype else self._derive(self._hidden, _CASTS[func])
        if func is torch.Tensor.to:
            kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
            device, dtype, _, memory_format = torch_compat.parse_to(*args, **kwargs)
            if (device is None or torch.device(device) == self.device) and memory_format is None:
                return self._derive(self._hidden, dtype)
            return None
        if func is torch.Tensor.contiguous:
            return self
        if func in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten):
            return self._reshaped(func, args, kwargs)
        if func is torch.Tensor.__getitem__ and len(args) == 1:
            return self._indexed(args[0])
        return None

    def _along_vocab(self, other: torch.Tensor) -> bool:
        """``other`` is a scalar or varies only along the vocabulary (``[V]``, ``[1, V]``, ``[1, 1, 1]``): each chunk of
        rows applies it whole. A per-token operand (``[B, T, 1]``) would need its rows sliced: not kept lazy."""
        if isinstance(other, LazyLogits) or other.ndim > self.ndim or any(s != 1 for s in other.shape[:-1]):
            return False
        if other.ndim and other.shape[-1] not in (1, self.shape[-1]):
            return False
        return other.ndim == 0 or other.device == self.device

    def _reshaped(self, func: Any, args: tuple, kwargs: dict) -> Optional["LazyLogits"]:
        if any(isinstance(a, torch.dtype) for a in args):
            return None  # a dtype view reinterprets bytes
        try:
            shape = func(torch.empty(self.shape, device="meta"), *args, **kwargs).shape
        except (RuntimeError, TypeError):
            return None
        # Any reshape that keeps the vocabulary as the innermost dimension only regroups tokens.
        if not shape or shape[-1] != self.shape[-1]:
            return None
        return self._derive(self._hidden.reshape(*shape[:-1], self._hidden.shape[-1]))

    def _indexed(self, index: Any) -> Optional["LazyLogits"]:
        items = index if isinstance(index, tuple) else (index,)
        if not items or items[-1] is None or any(isinstance(i, LazyLogits) for i in items):
            return None
        consumed = sum(0 if i is None or i is Ellipsis else (i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1)
                       for i in items)
        full_last = isinstance(items[-1], slice) and items[-1] == slice(None)
        touches_vocab = (Ellipsis in items and not full_last and items[-1] is not Ellipsis) or consumed > self.ndim or (
            Ellipsis not in items and consumed == self.ndim and not full_last)
        if touches_vocab:
            return None
        return self._derive(self._hidden[index])


def _elementwise(func: Any, args: tuple, kwargs: dict) -> Optional[LazyLogits]:
    """``tanh``, or ``+ - * /`` with a number or a tensor along the vocabulary, as a new lazy tensor; else ``None``.

    Elementwise with an operand that does not vary over tokens, so applying it to each chunk of rows gives the same
    logits (Gemma-2's soft-capping ``tanh(z / c) * c``, BART's ``logits + final_logits_bias``, a per-vocab scale).
    """
    name = _ELEMENTWISE[func]
    where = [i for i, a in enumerate(args) if isinstance(a, LazyLogits)]
    if len(where) != 1 or len(args) != (1 if name == "tanh" else 2) or "out" in kwargs:
        return None
    lazy: LazyLogits = args[where[0]]
    if where[0] == 1 and func in _DIVISORS:
        return None  # ``c / logits``: not a scale of the logits
    for other in args[:where[0]] + args[where[0] + 1:]:
        if isinstance(other, torch.Tensor) and not lazy._along_vocab(other):
            return None
        if not isinstance(other, torch.Tensor) and (isinstance(other, bool) or not isinstance(other, (int, float))):
            return None
    meta = lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, torch.Tensor) else a  # noqa: E731
    try:  # the result's shape and dtype (type promotion with the operand), without computing anything
        out = func(*map(meta, args), **kwargs)
    except (RuntimeError, TypeError):
        return None
    if out.shape != lazy.shape:
        return None
    state = lazy._state
    if name not in state.elementwise:
        state.elementwise.append(name)
    op = _Op(name, func, tuple(None if i == where[0] else a for i, a in enumerate(args)), kwargs, where[0], lazy.dtype)
    return lazy._derive(lazy._hidden, out.dtype, post=(op,))


def _materialize_message(why: str, state: _HeadState, shape: tuple, nbytes: int) -> str:
    return (
        f"lightning_hbm FusedLoss: `{why}` on the logits of `{state.name}` ({state.model or 'the model'}) cannot stay "
        f"fused: it needs the full [tokens, vocab] logits {shape} ({nbytes / 2**20:.1f} MiB), computed every step. A "
        f"loss computed from them is not fused, and HBMProfiler's and the planner's `loss` term count these full "
        f"logits. Kept lazy: token slices and views, dtype casts, tanh, and + - * / by a number or a tensor along the "
        f"vocabulary (final_logits_bias); slicing the tokens first (logits[:, -1]) computes only those rows."
    )


def _fused_cross_entropy(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """``F.cross_entropy`` on a lazy ``[N, vocab]`` input with class-index targets, fused; else ``None``."""
    bound = _CE_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    logits, target = a["input"], a["target"]
    if not isinstance(logits, LazyLogits) or logits.ndim != 2 or not isinstance(target, torch.Tensor):
        return None
    if target.ndim != 1 or target.is_floating_point() or a["weight"] is not None:
        return None  # probabilities as targets, class weights: computed the ordinary way (logged)
    if a["size_average"] is not None or a["reduce"] is not None:
        return None
    state = logits._state
    head_forward: Callable[[torch.Tensor], torch.Tensor]  # the head's forward, or the lazy tensor's recorded ops on it
    head_forward, kernel = state.forward, state.kernel
    operands: list[torch.Tensor] = []
    if logits._post:
        # the chunk loop writes the gradient into the logits: a copy keeps the output a tanh backward reads intact
        # (+ - * / save their inputs or operands, not their output)
        copy = logits._post[-1].name == "tanh"
        head_forward = (lambda h: logits._head(h).clone()) if copy else logits._head
        kernel = "chunked"  # Liger knows no soft-capping or bias
        operands = [t for op in logits._post for t in op.operands]
        if not state.fused_logged:
            state.fused_logged = True
            log.info(
                "lightning_hbm FusedLoss: %s on the logits of `%s` (e.g. final-logit soft-capping, final_logits_bias) "
                "applied chunk by chunk: the loss stays fused.", ", ".join(f"`{op}`" for op in state.elementwise), state.name,
            )
    return fused_linear_cross_entropy(
        logits._hidden, state.module, target, ignore_index=a["ignore_index"], label_smoothing=a["label_smoothing"],
        reduction=a["reduction"], logits_dtype=logits.dtype, chunk_size=state.chunk_size, head_forward=head_forward,
        kernel=kernel, operands=operands,
    )


class _LazyHead:
    """Replaces a head's ``forward`` (instance attribute): returns :class:`LazyLogits`."""

    def __init__(self, state: _HeadState) -> None:
        self.state = state

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or x.shape[-1] == 0 or x.numel() == 0:
            return self.state.forward(x, *args, **kwargs)
        return LazyLogits(x, self.state, _output_dtype(self.state, x))


def _output_dtype(state: _HeadState, x: torch.Tensor) -> torch.dtype:
    """The dtype the head would return for ``x`` (autocast, quantized layers: asked from a 1-token forward)."""
    module = state.module
    # Outside autocast, Linear layers return the input dtype (F.linear refuses mixed dtypes; bitsandbytes' layers
    # and peft's LoRA wrappers cast their result back to it): no need to run anything.
    if not torch.is_autocast_enabled(x.device.type) and (isinstance(module, nn.Linear) or hasattr(module, "base_layer")):
        return x.dtype
    with torch.no_grad():
        return state.forward(x.reshape(-1, x.shape[-1])[:1]).dtype

