"""The chunked linear cross-entropy (an autograd Function), and Liger's fused kernel where it applies."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence, Union, cast

import torch
from lightning_utilities.core.imports import RequirementCache
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.loss.cost import chunk_tokens, softmax_rows
from lightning_hbm.activations.loss.dequantize import _dequantized_once
from lightning_hbm.memory.tracker import LOSS_SCOPE, memory_scope

_LIGER_AVAILABLE = RequirementCache("liger-kernel")


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
    for start in torch_compat.chunk_starts(hidden.shape[0], spec.chunk, hidden):
        stop = min(hidden.shape[0], start + spec.chunk)
        h = hidden[start:stop]
        if want_grad:
            h = h.detach().requires_grad_(need[0])
        with torch.enable_grad() if want_grad else nullcontext():
            # the head gets a view, not the leaf: module hooks that ask autograd about their inputs' nodes (torch's
            # ModTracker/MemTracker, on a LoRA head's sublayers) raise for a leaf inside this autograd.grad
            logits = spec.head(h.view_as(h) if want_grad and need[0] else h)
        detached = logits.detach()
        # bf16 logits are softmaxed a few fp32 rows at a time (cost.softmax_rows), fp32 ones whole and in place
        narrow = spec.out_dtype if spec.out_dtype.itemsize < detached.dtype.itemsize else detached.dtype
        rows = softmax_rows(detached.shape[1], narrow) or detached.shape[0]
        rows = min(rows, detached.shape[0])
        in_place = detached.dtype == narrow == torch.float32
        # the fp32 rows of a narrower chunk, one buffer for all its blocks (was a fresh copy, and its page faults, each)
        buf = None if in_place else torch.empty(rows, detached.shape[1], dtype=torch.float32, device=detached.device)
        for r0 in torch_compat.chunk_starts(detached.shape[0], rows, detached):
            r1 = min(detached.shape[0], r0 + rows)
            scale = None
            if want_grad:
                scale = cast(torch.Tensor, row_scale)[start + r0:start + r1] if cast(torch.Tensor, row_scale).ndim else row_scale  # given: want_grad
            losses[start + r0:start + r1] = _rows_loss(spec, detached[r0:r1], target[start + r0:start + r1], scale,
                                                       None if buf is None else buf[:r1 - r0])
        del buf  # not beside the backward matmul's output: the peak stays the softmax's
        if not want_grad:
            continue
        inputs = ([h] if need[0] else []) + [p for p, nd in zip(params, need[1:]) if nd]
        # the gradient is now in the logits' own storage (_rows_loss): a Linear's backward does not read its output
        # (a head whose backward did would make autograd raise, not compute wrong gradients)
        grads = list(torch.autograd.grad(logits, inputs, detached))
        del logits, detached
        if need[0]:
            cast(torch.Tensor, grad_hidden)[start:stop] = grads.pop(0)  # allocated for need[0] (_chunk_pass)
        for acc in grad_params:
            if acc is not None:
                acc += grads.pop(0)


def _rows_loss(spec: _Spec, block: torch.Tensor, target: torch.Tensor, scale: Optional[torch.Tensor],
               buf: Optional[torch.Tensor]) -> torch.Tensor:
    """Per-token fp32 losses of the logit rows ``block``; with ``scale``, the gradient of ``sum(scale * loss)``
    overwrites ``block``. Its small tensors are per block, as before: per chunk they were a few KB more at the peak.

    fp32 logits are worked on in place; others through ``buf`` (fp32, ``block``'s shape): only ``block`` and one fp32
    copy of it are alive. aten's ``log_softmax`` is one pass-fused kernel where max/sub/exp/sum/log were five ops.
    """
    eps = spec.label_smoothing
    valid = target != spec.ignore_index
    t_safe = torch.where(valid, target, 0).unsqueeze(1)
    if buf is None:
        z = block
    else:
        # the rounding the user's cast would do, then the upcast in one copy into the reused buffer
        z = buf.copy_(block.to(spec.out_dtype) if spec.out_dtype.itemsize < block.dtype.itemsize else block)
    # in place (out= its input): the CPU kernel reads each row before writing it; HF's unfused loss runs the same kernel
    logp = torch.log_softmax(z, 1, out=z)
    loss = logp.gather(1, t_safe).squeeze(1).neg_()  # lse - z_target
    if eps:
        loss = (1 - eps) * loss - eps * logp.mean(dim=1)  # lse - mean(z) = -mean(logp)
    loss = torch.where(valid, loss, 0.0)
    if scale is None:
        return loss
    # d loss / d z = softmax(z) - (1 - eps) * onehot(t) - eps / V, zero on ignored rows
    grad_z = logp.exp_()
    if eps:
        grad_z.sub_(eps / z.shape[1])
    grad_z.scatter_add_(1, t_safe, torch.full_like(t_safe, eps - 1, dtype=grad_z.dtype))
    grad_z.mul_((valid * scale).unsqueeze(1).to(grad_z.dtype))
    if z is not block:
        block.copy_(grad_z)  # bf16 logits: the gradient goes into their storage, rounded as autograd's cast would
    return loss


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
    operands: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``F.cross_entropy(head(hidden).to(logits_dtype), target, ...)`` without the full logits.

    ``hidden`` is ``[N, H]``, ``target`` ``[N]`` class indices. ``head_forward`` (default ``head``) computes
    the logits of a chunk; the trainable parameters of ``head`` receive their gradients, and so do the ``operands``
    that need one (tensors ``head_forward`` uses besides the head, e.g. a trainable logit bias).
    """
    if hidden.ndim != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden must be [N, H] and target [N]; got hidden {tuple(hidden.shape)} and "
            f"target {tuple(target.shape)}. Flatten the token dimensions first (hidden.reshape(-1, H), target.reshape(-1))."
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"fused_linear_cross_entropy: reduction={reduction!r}; use 'mean', 'sum' or 'none'.")
    vocab = int(getattr(head, "out_features"))
    # the head returns the autocast dtype under autocast, else the input's (Linear, bitsandbytes, peft); `out` is then
    # Liger's loss (None where it does not apply)
    out: Union[torch.dtype, Optional[torch.Tensor]] = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
    spec = _Spec(head_forward or head, logits_dtype, ignore_index, float(label_smoothing), reduction,
                 chunk_tokens(hidden.shape[0], vocab, cast(torch.dtype, out), chunk_size), head)
    if kernel in ("auto", "liger"):
        out = _liger(hidden, head, target, spec)
        if out is not None:
            return out
    params: list[torch.Tensor] = [p for p in head.parameters() if p.requires_grad]
    for t in operands:  # once each: a tensor passed twice would get its gradient twice
        if t.requires_grad and not any(t is p for p in params):
            params.append(t)
    return _ChunkedLinearCrossEntropy.apply(spec, hidden, target, *params)

