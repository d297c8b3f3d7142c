"""``FusedLoss``: the output head and the cross-entropy without the full ``[tokens, vocab]`` logits.

What it shrinks: the **activations** (and temporaries) of the loss. A causal LM's head turns
``tokens x hidden`` into ``tokens x vocab`` logits; with a 32k-128k vocabulary that tensor is the
largest of the step: Hugging Face's ``ForCausalLMLoss`` upcasts it to fp32, the cross-entropy keeps
its log-softmax for backward and the backward builds a gradient of the same size, i.e. several
``tokens x vocab`` copies at the peak (3.9 GiB of fp32 for Llama-3.1-8B at batch 2 x 2048).

How: at the surgery point (stage ``KERNELS``, after quantization and adapters) the head's
``forward`` is replaced by one that returns a :class:`LazyLogits`: a tensor subclass that holds the
hidden states and the head, reports the logits' shape/dtype/device, and records what the code does
with it as long as it only touches the token dimensions (slices such as ``logits[..., :-1, :]``,
``view``/``reshape``/``flatten`` keeping the vocabulary last, ``contiguous``, ``float()``/``to(dtype)``).
``F.cross_entropy`` (and so ``nn.CrossEntropyLoss`` and transformers' ``loss_function``) on a
``[N, vocab]`` lazy tensor runs :func:`fused_linear_cross_entropy`: the head is applied to chunks of
the hidden states, each chunk's loss and gradient are computed in fp32 and the chunk is freed, so the
step holds ``chunk x vocab`` instead of ``tokens x vocab``. The head is called as a function, so a
quantized head (bitsandbytes) or a LoRA-adapted head (peft) works, and its trainable parameters get
their gradients. Any other use of the logits (``argmax``, metrics, printing, returning them)
computes the full logits once, with a one-time log line naming the operation: the results are
correct, only the saving is lost for that tensor.

On CUDA, with ``liger-kernel`` installed (``pip install lightning-hbm[fused]``) and a plain
``nn.Linear`` head, Liger's fused linear cross-entropy kernel is used instead of the chunked loop
(not yet run on GPU in this repository). The chunked path is the portable one (CPU and GPU).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch.utils._pytree import tree_map
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.layers import output_heads
from lightning_hbm.memory.tracker import LOSS_SCOPE, memory_scope
from lightning_hbm.precision.registry import format_of
from lightning_hbm.surgery import Stage, SurgeryCallback

log = logging.getLogger(__name__)

_LIGER_AVAILABLE = RequirementCache("liger-kernel")
#: Bytes one chunk's logits may take (the head's output, its fp32 copy; the gradient reuses both): tokens per
#: chunk follow the vocabulary, so the loss costs about the same at 32k and 256k. 32 MiB is 174 tokens of a 32k
#: bf16 head; a 128k-vocabulary step with 256-token chunks peaked at 2.23x its floor (benchmarks/README.md).
CHUNK_BYTES = 32 * 2**20
#: Fewest tokens per chunk (fewer only when the batch is smaller): each chunk's forward and backward matmuls read
#: the whole ``[vocab, hidden]`` head weight, so tiny chunks spend the step re-reading it. Measured (128k vocabulary,
#: fp32, CPU): 65-token chunks made the whole step 1.13x the 256-token one, 96-token chunks 1.07x.
MIN_CHUNK_TOKENS = 96
_CE_SIGNATURE = inspect.signature(F.cross_entropy)


def logit_element_bytes(dtype: torch.dtype) -> int:
    """Bytes one chunk holds per logits element: the head's output, plus its fp32 copy when it is narrower.

    The softmax and its gradient are computed in place in the fp32 copy and written back into the output's
    storage (:func:`_chunks`): no third copy.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + (4 if itemsize < 4 else 0)


def chunk_tokens(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16, chunk_size: Optional[int] = None) -> int:
    """Tokens per chunk of the fused loss: ``chunk_size`` if given, else as many as fit :data:`CHUNK_BYTES`, at
    least :data:`MIN_CHUNK_TOKENS` (or the whole batch, if smaller).

    ``dtype`` is the head's output dtype. The one rule, used by the loss and by the planner's arithmetic.
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, tokens))
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, CHUNK_BYTES // (vocab * logit_element_bytes(dtype)))))


def loss_bytes(tokens: int, vocab: int, hidden: int, fused: bool, logits_dtype: torch.dtype = torch.bfloat16,
               chunk_size: Optional[int] = None, quantized_head: bool = False) -> int:
    """Bytes the head + cross-entropy add at the step's peak, with or without ``FusedLoss`` (for the planner).

    Unfused (transformers' ``ForCausalLMLoss``, or ``F.cross_entropy(logits.float())``): about 12 bytes per
    ``tokens x vocab`` element whatever the logits dtype: bf16 logits (2, kept by the model output) + the fp32
    log-softmax saved for backward (4) + its fp32 gradient (4) + the gradient's bf16 cast (2); in fp32, logits,
    log-softmax and gradient (4 each). Measured with torch's MemTracker on a 32k vocabulary: 12.2 (bf16), 12.3 (fp32).
    Fused: one chunk (:func:`chunk_tokens`, :func:`logit_element_bytes`), the hidden-state gradient kept from
    forward to backward, and for a 4-bit head its weight dequantized once.
    """
    itemsize = torch.empty((), dtype=logits_dtype).element_size()
    if not fused:
        return tokens * vocab * 12
    chunk = chunk_tokens(tokens, vocab, logits_dtype, chunk_size)
    head = vocab * hidden * itemsize if quantized_head else 0
    return chunk * vocab * logit_element_bytes(logits_dtype) + tokens * hidden * itemsize + head


# --------------------------------------------------------------------------------------------
# The chunked loss
# --------------------------------------------------------------------------------------------


class _Spec:
    """What one fused cross-entropy call needs besides tensors (autograd.Function takes it as an argument)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], out_dtype: torch.dtype, ignore_index: int,
                 label_smoothing: float, reduction: str, chunk: int, module: Optional[nn.Module] = None) -> None:
        self.head, self.out_dtype, self.ignore_index, self.module = head, out_dtype, ignore_index, module
        self.label_smoothing, self.reduction, self.chunk = label_smoothing, reduction, chunk


@memory_scope(LOSS_SCOPE)
def _chunk_pass(spec: _Spec, hidden: torch.Tensor, target: torch.Tensor, params: Sequence[torch.Tensor],
                row_scale: Optional[torch.Tensor], need: Sequence[bool]) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
    """Per-token losses ``[N]`` (fp32) and, if ``row_scale`` is given, the gradients of ``sum(row_scale * loss)``.

    ``need`` = (hidden needs grad, *each param needs grad). Only one chunk's logits exist at a time.
    What it allocates is the ``loss`` term of HBMProfiler and the planner (:func:`memory_scope`).
    """
    n = hidden.shape[0]
    losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
    want_grad = row_scale is not None and any(need)
    grad_hidden = torch.zeros_like(hidden) if want_grad and need[0] else None
    # fp32 accumulators: summing per-chunk gradients in bf16 would round once per chunk
    grad_params = [torch.zeros_like(p, dtype=torch.float32) if want_grad and nd else None for p, nd in zip(params, need[1:])]
    with _dequantized_once(spec.module):
        _chunks(spec, hidden, target, params, row_scale, need, want_grad, losses, grad_hidden, grad_params)
    return losses, [grad_hidden] + [g.to(p.dtype) if g is not None else None for g, p in zip(grad_params, params)]


def _chunks(spec: _Spec, hidden: torch.Tensor, target: torch.Tensor, params: Sequence[torch.Tensor],
            row_scale: Optional[torch.Tensor], need: Sequence[bool], want_grad: bool, losses: torch.Tensor,
            grad_hidden: Optional[torch.Tensor], grad_params: list[Optional[torch.Tensor]]) -> None:
    eps = spec.label_smoothing
    for start in range(0, hidden.shape[0], spec.chunk):
        stop = min(hidden.shape[0], start + spec.chunk)
        h = hidden[start:stop]
        if want_grad:
            h = h.detach().requires_grad_(need[0])
        with torch.enable_grad() if want_grad else nullcontext():
            # the head gets a view, not the leaf: module hooks that ask autograd about their inputs' nodes (torch's
            # ModTracker/MemTracker, on a LoRA head's sublayers) raise for a leaf inside this autograd.grad
            logits = spec.head(h.view_as(h) if want_grad and need[0] else h)
        detached = z = logits.detach()
        if spec.out_dtype.itemsize < z.dtype.itemsize:
            z = z.to(spec.out_dtype)  # the rounding the user's cast would do
        # fp32 logits are changed in place below (a Linear's backward does not read its output; a head whose
        # backward does would make autograd raise, not compute wrong gradients)
        z = z.float()
        in_place = z is detached  # fp32 logits: z is their storage (identity, not data_ptr: fake tensors have none)
        t = target[start:stop]
        valid = t != spec.ignore_index
        t_safe = torch.where(valid, t, 0).unsqueeze(1)
        z_target = z.gather(1, t_safe).squeeze(1)
        z_mean = z.mean(dim=1) if eps else None
        # log-sum-exp and softmax in place: only the logits and one fp32 copy per chunk are ever alive
        z_max = z.amax(dim=1, keepdim=True)
        probs = z.sub_(z_max).exp_()
        z_sum = probs.sum(dim=1, keepdim=True)
        lse = (z_max + z_sum.log()).squeeze(1)
        loss = lse - z_target
        if eps:
            loss = (1 - eps) * loss + eps * (lse - z_mean)
        losses[start:stop] = torch.where(valid, loss, 0.0)
        if not want_grad:
            continue
        # d loss / d z = softmax(z) - (1 - eps) * onehot(t) - eps / V, zero on ignored rows
        grad_z = probs.div_(z_sum)
        if eps:
            grad_z.sub_(eps / z.shape[1])
        grad_z.scatter_add_(1, t_safe, torch.full_like(t_safe, eps - 1, dtype=grad_z.dtype))
        grad_z.mul_((valid * row_scale[start:stop] if row_scale.ndim else valid * row_scale).unsqueeze(1).to(grad_z.dtype))
        inputs = ([h] if need[0] else []) + [p for p, nd in zip(params, need[1:]) if nd]
        # the gradient goes into the logits' own storage (fp32: it already is), so a bf16 chunk never holds
        # logits + fp32 copy + bf16 gradient at once; as above, a Linear's backward does not read its output
        grad_logits = grad_z if in_place else detached.copy_(grad_z)
        del z, probs, grad_z, detached  # the fp32 copy goes before the head's backward runs
        grads = list(torch.autograd.grad(logits, inputs, grad_logits))
        del logits, grad_logits
        if need[0]:
            grad_hidden[start:stop] = grads.pop(0)
        for acc in grad_params:
            if acc is not None:
                acc += grads.pop(0)


@contextmanager
def _dequantized_once(head: Optional[nn.Module]) -> Iterator[None]:
    """Frozen quantized layers inside ``head`` dequantize their weight once for all chunks, not twice per chunk.

    A 4-bit layer (bitsandbytes' ``Linear4bit``, any format with ``dense_forward``) dequantizes the whole
    ``[vocab, hidden]`` weight in every forward and again in every backward: per chunk, that transient is as
    large as the bf16 logits of ``hidden`` tokens (1 GiB for an 8B Llama's head), and it would be paid 2 x chunks
    times. Here one copy lives while the chunks run and the layer computes ``F.linear`` with it, exactly what
    its forward does after dequantizing.
    """
    modules = head.modules() if head is not None else ()
    owned = [(m, format_of(m)) for m in modules]
    layers = [(m, fmt) for m, fmt in owned if fmt is not None and fmt.dense_forward and not m.weight.requires_grad]
    previous_forwards = [torch_compat.forward_override(layer) for layer, _ in layers]
    for layer, fmt in layers:
        # Straight into the compute dtype: a model quantized from fp32 weights stores fp32 constants,
        # and an fp32 copy of the head (2 GiB at 8B) next to its bf16 cast would be the step's peak.
        def forward(x: torch.Tensor, layer: nn.Module = layer,
                    weight: torch.Tensor = fmt.dequantize(layer, fmt.compute_dtype(layer))) -> torch.Tensor:
            bias = None if layer.bias is None else layer.bias.to(weight.dtype)
            return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

        torch_compat.override_forward(layer, forward)
    try:
        yield
    finally:
        for (layer, _), previous in zip(layers, previous_forwards):
            torch_compat.override_forward(layer, previous)  # the class's, or e.g. FusedLoss's own wrapper on a 4-bit head


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Cross-entropy of ``head(hidden)`` chunk by chunk; inputs: spec, hidden [N, H], target [N], *params.

    With ``mean``/``sum`` the gradients are computed in the forward pass (the loss is a scalar: its
    gradient is the precomputed one times ``grad_output``), so the head runs once forward and once
    backward per chunk, as in the unfused step. With ``none`` the backward recomputes each chunk.
    """

    @staticmethod
    def forward(ctx: Any, spec: _Spec, hidden: torch.Tensor, target: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        need = (ctx.needs_input_grad[1], *ctx.needs_input_grad[3:])
        ctx.spec, ctx.need = spec, need
        if spec.reduction == "none":
            ctx.save_for_backward(hidden, target, *params)
            losses, _ = _chunk_pass(spec, hidden, target, params, None, need)
            return losses
        valid = (target != spec.ignore_index).sum()
        scale = 1.0 / valid.to(torch.float32) if spec.reduction == "mean" else torch.ones((), device=hidden.device)
        losses, grads = _chunk_pass(spec, hidden, target, params, scale if any(need) else None, need)
        ctx.grads = grads if any(need) else None
        return losses.sum() * scale

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        if ctx.spec.reduction == "none":
            hidden, target, *params = ctx.saved_tensors
            _, grads = _chunk_pass(ctx.spec, hidden, target, params, grad_output.float(), ctx.need)
        else:
            grads = [g * grad_output.to(g.dtype) if g is not None else None for g in ctx.grads]
            ctx.grads = None
        return (None, grads[0], None, *grads[1:])


def _liger(hidden: torch.Tensor, head: nn.Module, target: torch.Tensor, spec: _Spec) -> Optional[torch.Tensor]:
    """Liger's fused kernel for a plain Linear head on CUDA, when installed; ``None`` otherwise. Not yet run on GPU."""
    if not (_LIGER_AVAILABLE and hidden.is_cuda and type(head) is nn.Linear and spec.out_dtype == torch.float32):
        return None
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(
        hidden, head.weight, target, bias=head.bias, ignore_index=spec.ignore_index,
        label_smoothing=spec.label_smoothing, reduction=spec.reduction,
    )
    out = out[0] if isinstance(out, tuple) else out
    return getattr(out, "loss", out)  # newer releases return a CrossEntropyOutput


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    logits_dtype: torch.dtype = torch.float32,
    chunk_size: Optional[int] = None,
    head_forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    kernel: str = "auto",
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).to(logits_dtype), target, ...)`` without the full logits.

    ``hidden`` is ``[N, H]``, ``target`` ``[N]`` class indices. ``head_forward`` (default ``head``) computes
    the logits of a chunk; the trainable parameters of ``head`` receive their gradients.
    """
    if hidden.ndim != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden must be [N, H] and target [N]; got hidden {tuple(hidden.shape)} and "
            f"target {tuple(target.shape)}. Flatten the token dimensions first (hidden.reshape(-1, H), target.reshape(-1))."
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"fused_linear_cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'.")
    vocab = int(getattr(head, "out_features"))
    # the head returns the autocast dtype under autocast, else the input's (Linear, bitsandbytes, peft)
    out = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
    spec = _Spec(head_forward or head, logits_dtype, ignore_index, float(label_smoothing), reduction,
                 chunk_tokens(hidden.shape[0], vocab, out, chunk_size), head)
    if kernel in ("auto", "liger"):
        out = _liger(hidden, head, target, spec)
        if out is not None:
            return out
    params = [p for p in head.parameters() if p.requires_grad]
    return _ChunkedLinearCrossEntropy.apply(spec, hidden, target, *params)


# --------------------------------------------------------------------------------------------
# The lazy logits
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# The callback
# --------------------------------------------------------------------------------------------


def default_heads(module: nn.Module) -> list[str]:
    """The output heads :func:`lightning_hbm.layers.output_heads` finds, else Linear-like modules named ``lm_head``."""
    heads = output_heads(module)
    if not heads:
        heads = [n for n, m in module.named_modules() if n.rpartition(".")[2] == "lm_head"]
    return heads


class FusedLoss(SurgeryCallback):
    """Compute the output head and the cross-entropy chunk by chunk, never the full logits.

    Args:
        heads: module names of the output heads (default: :func:`lightning_hbm.layers.output_heads`: transformers'
            output embeddings, a tied head, or the last Linear as wide as the vocabulary; else modules named ``lm_head``).
        chunk_size: tokens per chunk (default: as many as fit :data:`CHUNK_BYTES`, 32 MiB of logits and
            their fp32 copy, at least :data:`MIN_CHUNK_TOKENS` = 96: 174 tokens at a 32k bf16 vocabulary, 96 at 128k).
        kernel: ``"auto"`` (Liger's fused kernel on CUDA when ``liger-kernel`` is installed and the head is
            a plain ``nn.Linear``, else chunked), ``"chunked"`` (always the portable path).

    Your model code does not change: a transformers causal LM called with ``labels=`` and a
    ``training_step`` computing ``F.cross_entropy(logits[..., :-1, :].reshape(-1, V), y)`` (or
    ``nn.CrossEntropyLoss()``) both go through the fused path. ``ignore_index``, ``label_smoothing`` and
    ``reduction`` are honoured; class weights and probability targets compute the logits (logged).

    Logged keys: none (no metric). One log line per head the first time its full logits are computed.

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("nf4-dq")], callbacks=[LoRA(r=16), FusedLoss()])

    YAML (LightningCLI)::

        trainer:
          callbacks:
            - class_path: lightning_hbm.FusedLoss
              init_args: {chunk_size: 1024}
    """

    stage = Stage.KERNELS
    reapply = True  # idempotent: a new instance installs its own settings

    def __init__(self, heads: Optional[Union[str, Sequence[str]]] = None, chunk_size: Optional[int] = None,
                 kernel: Literal["auto", "chunked"] = "auto") -> None:
        check_args(FusedLoss.__init__, locals())
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
            raise ValueError(f"FusedLoss(chunk_size={chunk_size!r}): give a positive number of tokens, or None for automatic.")
        if kernel not in ("auto", "chunked"):
            raise ValueError(f"FusedLoss(kernel={kernel!r}): choose 'auto' or 'chunked'.")
        if isinstance(heads, str):
            heads = [heads]
        if heads is not None and not heads:
            raise ValueError("FusedLoss(heads=[]): an empty list fuses nothing. Name the output head(s), e.g. "
                             "heads=['lm_head'], or pass None to find them automatically.")
        self.heads = list(heads) if heads is not None else None
        self.chunk_size, self.kernel = chunk_size, kernel
        self.applied_heads: list[str] = []

    def _resolve(self, module: nn.Module) -> list[str]:
        names = dict(module.named_modules())
        heads = self.heads if self.heads is not None else default_heads(module)
        linears = sorted((n for n, m in names.items() if hasattr(m, "out_features")),
                         key=lambda n: -int(names[n].out_features))[:5]
        if not heads:
            raise ValueError(
                f"FusedLoss: found no output head in {type(module).__name__} (no transformers model, no module named "
                f"'lm_head'). Name it: FusedLoss(heads=[...]); the widest Linear layers here are {linears}."
            )
        missing = [h for h in heads if h not in names]
        if missing:
            raise ValueError(f"FusedLoss(heads={heads}): {missing} match no submodule. Linear layers here: {linears}.")
        not_linear = [h for h in heads if not hasattr(names[h], "out_features")]
        if not_linear:
            raise ValueError(
                f"FusedLoss(heads={heads}): {not_linear} have no `out_features` (not Linear-like: "
                f"{[type(names[h]).__name__ for h in not_linear]}). Name the Linear that produces the logits: {linears}."
            )
        return heads

    @override
    def check_model(self, module: pl.LightningModule) -> None:
        self._resolve(module)

    @override
    def transform_model(self, module: pl.LightningModule) -> None:
        self.applied_heads = self._resolve(module)
        for name in self.applied_heads:
            head = module.get_submodule(name)
            # an instance attribute shadows the class's forward; the state calls the class's forward
            torch_compat.override_forward(head, _LazyHead(_HeadState(name, head, self.chunk_size, self.kernel)))
        rank_zero_info(f"lightning_hbm: FusedLoss on {self.applied_heads} (chunked cross-entropy, kernel={self.kernel!r})")


__all__ = ["CHUNK_BYTES", "MIN_CHUNK_TOKENS", "FusedLoss", "LazyLogits", "chunk_tokens", "fused_linear_cross_entropy", "logit_element_bytes", "loss_bytes"]
