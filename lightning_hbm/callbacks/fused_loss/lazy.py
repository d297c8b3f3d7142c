"""``LazyLogits``: the head's output not computed yet, and the head ``forward`` that returns it."""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.callbacks.fused_loss.chunked import fused_linear_cross_entropy

log = logging.getLogger(__name__)

_CE_SIGNATURE = inspect.signature(F.cross_entropy)


class _HeadState:
    """Per head: how to compute it, and whether the one-time materialization line was logged."""

    def __init__(self, name: str, module: nn.Module, chunk_size: Optional[int], kernel: str) -> None:
        self.name, self.module, self.chunk_size, self.kernel = name, module, chunk_size, kernel
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
_ELEMENTWISE = {torch.tanh: "tanh", torch.Tensor.tanh: "tanh", torch.Tensor.mul: "mul", torch.Tensor.__mul__: "mul",
                torch.Tensor.__rmul__: "mul", torch.mul: "mul", torch.Tensor.div: "div", torch.Tensor.__truediv__: "div",
                torch.div: "div"}
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
    _post: tuple[Callable[[torch.Tensor], torch.Tensor], ...]  # elementwise ops applied per chunk (soft-capping)

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, state: _HeadState, dtype: torch.dtype,
                post: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()) -> "LazyLogits":
        shape = (*hidden.shape[:-1], int(state.module.out_features))
        # requires_grad=False: nothing runs autograd on this object itself (every computation is on
        # hidden and the head), and module hooks (profilers) must not attach gradient hooks to it.
        self = torch_compat.make_wrapper_subclass(cls, shape, dtype=dtype, device=hidden.device, requires_grad=False)
        self._hidden, self._state, self._real, self._post = hidden, state, None, post
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # repr is not a torch function: materialize here
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
        """The real logits (computed once per lazy tensor; logged once per head)."""
        if self._real is None:
            state = self._state
            if state.materialized_by is None:
                state.materialized_by = why
                log.warning(
                    "lightning_hbm FusedLoss: `%s` on the logits of `%s` needs the full [tokens, vocab] tensor: computed "
                    "it (%s, %.1f MiB). A loss computed from this tensor is not fused; F.cross_entropy on the lazy "
                    "logits (token slices, casts and elementwise ops with a number such as soft-capping are kept lazy) "
                    "stays fused, and so does slicing the tokens first (e.g. logits[:, -1]). Logged once.",
                    why, state.name, tuple(self.shape), self.numel() * self.element_size() / 2**20,
                )
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
        elif lazy is not None:
            out = lazy._lazy_op(func, args[1:], kwargs)
            if out is not None:
                return out
        name = getattr(func, "__name__", str(func))
        unwrap = lambda x: x.materialize(name) if isinstance(x, LazyLogits) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
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
        return self._elementwise(func, args, kwargs)

    def _elementwise(self, func: Any, args: tuple, kwargs: dict) -> Optional["LazyLogits"]:
        """``tanh``, or ``*``/``/`` by a number (Gemma-2's final-logit soft-capping ``tanh(z / c) * c``), per chunk.

        Elementwise, so applying it chunk by chunk gives the same logits; the op runs in the dtype the logits
        have at that point (as it would unfused).
        """
        name = _ELEMENTWISE.get(func)
        if name is None or kwargs or len(args) != (0 if name == "tanh" else 1):
            return None
        if args and not (isinstance(args[0], (int, float)) and not isinstance(args[0], bool)):
            return None
        dtype, other = self.dtype, args[0] if args else None
        ops = {"tanh": lambda z: torch.tanh(z.to(dtype)), "mul": lambda z: z.to(dtype) * other,
               "div": lambda z: z.to(dtype) / other}
        state = self._state
        if name not in state.elementwise:
            state.elementwise.append(name)
        return self._derive(self._hidden, post=(ops[name],))

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
    head_forward, kernel = state.forward, state.kernel
    if logits._post:
        # the chunk loop changes the logits in place: a copy keeps the output a tanh backward reads intact
        head_forward, kernel = (lambda h: logits._head(h).clone()), "chunked"  # Liger knows no soft-capping
        if not state.fused_logged:
            state.fused_logged = True
            log.info(
                "lightning_hbm FusedLoss: %s on the logits of `%s` (e.g. final-logit soft-capping) applied chunk by "
                "chunk: the loss stays fused.", ", ".join(f"`{op}`" for op in state.elementwise), state.name,
            )
    return fused_linear_cross_entropy(
        logits._hidden, state.module, target, ignore_index=a["ignore_index"], label_smoothing=a["label_smoothing"],
        reduction=a["reduction"], logits_dtype=logits.dtype, chunk_size=state.chunk_size, head_forward=head_forward,
        kernel=kernel,
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

