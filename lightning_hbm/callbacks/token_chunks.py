"""Token-chunked recompute of a block's token-wise layers (``ActivationCheckpointing(mlp_chunks=k)``).

What it shrinks: the **activations** term's working set in the backward. A checkpointed block recomputes its whole
forward in the backward and holds every intermediate of it at once; in a transformer the MLP's are the widest
(1024 tokens x intermediate 2048 x fp32 = 8 MiB per tensor, about 68 MiB for one Llama MLP's recompute and
gradients at the 100M shape). A layer that treats each token on its own can be recomputed ``k`` tokens-chunks at a
time instead: only one chunk's intermediates live at once, for the same arithmetic (the idea of DeepSpeed ALST's
``TiledMLP``).

How, and why by hand: two autograd Functions. ``_KeepInput`` saves the layer's input (through whatever saved-tensor
hooks are active: the block's checkpoint discards it and recomputes it) and passes it on; ``_ChunkedCall`` runs the
layer chunk by chunk under ``no_grad`` and, in the backward, recomputes each chunk with a graph, takes its gradients
(input and the layer's trainable parameters, which are inputs of the Function so autograd accumulates them once)
and frees it. The saved input is packed *before* the layer's compute, so the block's recompute stops there
(torch's non-reentrant early stop) and the layer's forward runs once per step in the backward, as without chunks.
Nesting ``torch.utils.checkpoint`` per chunk instead was measured to run the MLP 2.75 times per step: each inner
checkpoint packs its input only after the previous chunks ran, so the outer recompute ran them again.

Which layers: decided by running, on the first training call of each direct child of a checkpointed block
(:func:`decide`): a layer is chunked when it is called with one tensor and no keyword arguments, gives an output
with the same tokens, widens (some sub-layer's output has at least twice the elements of the input), is token-wise
(its chunked output equals its whole output), draws no random numbers, changes no buffer, and trains no parameter
outside itself. Attention (keyword arguments, or tokens mixed) and norms (not wider) stay as they are.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat

WIDENING = 2.0  # chunk a layer when one of its sub-layers' outputs has at least this many times its input's elements


class _Box:
    """Where ``_KeepInput`` leaves its context for ``_ChunkedCall``'s backward (which runs first) to unpack from."""

    ctx: Any = None


class _KeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, box: _Box) -> Tensor:
        ctx.save_for_backward(x)
        box.ctx = ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ChunkedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, call: _Chunks, box: Optional[_Box], *params: Tensor) -> Tensor:
        ctx.call, ctx.box, ctx.params = call, box, params
        if box is None:  # an input without a graph: nothing upstream to recompute it from, keep it here
            ctx.save_for_backward(x)
        # detached: tracers that hook module inputs (torch's MemTracker) need a tensor with a grad_fn or none
        return torch.cat([call.inner(c) for c in call.split(x.detach())], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        (x,) = ctx.box.ctx.saved_tensors if ctx.box is not None else ctx.saved_tensors
        call: _Chunks = ctx.call
        wants_x, wanted = ctx.needs_input_grad[0], ctx.needs_input_grad[3:]
        params = [p for p, needed in zip(ctx.params, wanted) if needed]
        grads_x: list[Tensor] = []
        grads_p: list[Optional[Tensor]] = [None] * len(params)
        for chunk, grad_chunk in zip(call.split(x), call.split(grad)):
            chunk = chunk.detach().requires_grad_(wants_x)
            out = call.recompute(chunk)
            got = torch.autograd.grad(out, ([chunk] if wants_x else []) + params, grad_chunk, allow_unused=True)
            if wants_x:
                grads_x.append(got[0] if got[0] is not None else torch.zeros_like(chunk))
                got = got[1:]
            grads_p = [a if b is None else b if a is None else a + b for a, b in zip(grads_p, got)]
        rest = iter(grads_p)
        return (torch.cat(grads_x, dim=-2) if wants_x else None, None, None, *(next(rest) if n else None for n in wanted))


class _Chunks:
    """One layer's own forward, how many token-chunks to run it in, and the autocast state of its forward.

    The backward runs outside the forward's ``torch.autocast`` (the autograd engine does not carry it), so the
    recompute enters it again, as ``torch.utils.checkpoint`` does: under ``bf16-mixed`` it computes in bfloat16 too.
    """

    def __init__(self, inner: Any, chunks: int, device_type: str) -> None:
        self.inner, self.chunks, self.device_type = inner, chunks, device_type
        self.autocast = torch.is_autocast_enabled(device_type)
        self.autocast_dtype = torch.get_autocast_dtype(device_type)

    def split(self, x: Tensor) -> tuple[Tensor, ...]:
        return x.chunk(self.chunks, dim=-2)

    def recompute(self, chunk: Tensor) -> Any:
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
            return self.inner(chunk)


class ChunkedForward:
    """The ``forward`` of one layer inside a checkpointed block: chunked once :func:`decide` said yes.

    A picklable object (not a closure) kept in the layer's ``__dict__``, like the block's own checkpointed forward.
    ``verdict`` is ``None`` until the first training call, then ``""`` (chunked) or the reason it is not.
    """

    def __init__(self, layer: nn.Module, chunks: int) -> None:
        self.layer, self.chunks = layer, chunks
        self.own_forward = torch_compat.forward_override(layer)
        self.verdict: Optional[str] = None
        self.planned: Optional[str] = None  # the same, decided on fake tensors (the planner's trace)

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own_forward or type(self.layer).forward.__get__(self.layer)
        return own(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # evaluation: nothing is saved, nothing to recompute
        # the planner's trace has no values: it plans with the checks that need none; the first real step decides
        fake = any(torch_compat.is_fake(a) for a in args if isinstance(a, Tensor))
        verdict = self.planned if fake else self.verdict
        if verdict is None:
            # identity hooks: what the test saves must not land in the block checkpoint's count of saved tensors
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                verdict = decide(self.layer, self.inner, self.chunks, args, kwargs, values=not fake)
            if fake:
                self.planned = verdict
            else:
                self.verdict = verdict
        if verdict:
            return self.inner(*args, **kwargs)
        x = args[0]
        params = tuple(p for p in self.layer.parameters() if p.requires_grad)
        if not x.requires_grad and not params:
            return self.inner(x)  # nothing to differentiate
        box = _Box() if x.requires_grad else None
        if box is not None:
            x = _KeepInput.apply(x, box)
        return _ChunkedCall.apply(x, _Chunks(self.inner, self.chunks, x.device.type), box, *params)


def decide(
    layer: nn.Module, inner: Any, chunks: int, args: tuple[Any, ...], kwargs: dict[str, Any], values: bool = True
) -> str:
    """``""`` if ``layer`` may be recomputed in ``chunks`` token-chunks, else why not (by running it, without a graph).

    Decided on the first training call, with the real input: a layer's code says nothing reliable about whether it
    mixes tokens (attention does, a BatchNorm over tokens does in training mode), draws random numbers or reaches
    parameters it does not own. ``values=False`` (fake tensors: the planner's trace) skips the checks that read
    values (random state, chunked against whole output).
    """
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or args[0].dim() < 2:
        return "not called with one tensor of tokens"
    x = args[0]
    if x.shape[-2] < chunks:
        return f"{x.shape[-2]} tokens, fewer than mlp_chunks={chunks}"
    widest = [0]

    def _measure(_m: nn.Module, _i: Any, out: Any) -> None:
        if isinstance(out, Tensor):
            widest[0] = max(widest[0], out.numel())

    handles = [m.register_forward_hook(_measure) for m in layer.modules() if m is not layer]
    versions = [b._version for b in layer.buffers()]
    before = _rng_states(x.device) if values else None
    try:
        with torch.no_grad():
            whole = inner(x)
    finally:
        for h in handles:
            h.remove()
    if before is not None and _restore_rng(x.device, before):
        return "draws random numbers (dropout in training mode)"
    if [b._version for b in layer.buffers()] != versions:
        return "changes its buffers in the forward"
    if not isinstance(whole, Tensor) or whole.shape[:-1] != x.shape[:-1]:
        return "its output is not one tensor with the input's tokens"
    if widest[0] < WIDENING * x.numel():
        return "no wider than its input (nothing to gain)"
    if values:
        with torch.no_grad():
            parts = torch.cat([inner(c) for c in x.chunk(chunks, dim=-2)], dim=-2)
        if not torch.allclose(parts, whole, rtol=1e-3, atol=1e-5 * float(whole.abs().max()) + 1e-12):
            return "mixes tokens (its chunked output differs)"
    foreign = _foreign_leaves(layer, inner, x)
    return f"trains {foreign} parameter(s) it does not own (their gradients would be lost)" if foreign else ""


def _rng_states(device: torch.device) -> list[Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _restore_rng(device: torch.device, before: list[Tensor]) -> bool:
    """Put the random states back as ``before``; whether the call in between drew from them."""
    after = _rng_states(device)
    torch.set_rng_state(before[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(before[1], device)
    return any(not torch.equal(a, b) for a, b in zip(after, before))


def _foreign_leaves(layer: nn.Module, inner: Any, x: Tensor) -> int:
    """How many trained leaves outside ``layer``'s own parameters one token's graph reaches."""
    own = {id(p) for p in layer.parameters()}
    with torch.enable_grad():
        out = inner(x[..., :1, :].detach())
    found, seen, nodes = 0, set(), [out.grad_fn] if isinstance(out, Tensor) else []
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it fills
        if variable is not None and id(variable) not in own:
            found += 1
        nodes.extend(n for n, _ in node.next_functions)
    return found


__all__ = ["ChunkedForward", "decide"]
