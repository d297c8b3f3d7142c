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

A chunked layer fed straight by another of its block (a Llama block's ``post_attention_layernorm`` -> ``mlp``) keeps no
input of its own: its backward remakes each chunk of its input from the first layer's kept input (same chunk boundaries: the
forward's values bit for bit), so the first layer's whole output is neither made by the block's recompute nor held
during the second's backward; and each backward writes its input's gradient chunk by chunk into one tensor. At the 8B
Llama shape the two took 89.0 -> 84.9 KB per token off the recomputed block's backward (``benchmarks/README.md``).

The layers one level inside a block's layers (:func:`inner_candidates`: q/k/v inside the attention) are taken only when
fed straight by a chunked layer and keeping a copy of their input (a LoRA projection keeps it for ``lora_A``'s
gradient): they run whole as before but keep nothing; in the backward, once the last of the layers one chunked layer
feeds has its output's gradient, their input is remade chunk by chunk from the chunked layer's kept input, each is
recomputed on it whole in the forward's order and one backward runs through them all, so the gradients are the code
before's bit for bit (summed over chunks they would round differently). At 8B the ``input_layernorm`` output is then not
held through the block's backward: 84.9 -> 76.5 KB per token (Dec 5 2026), for one more forward of q/k/v per block
(step time 1.00x to 1.04x on CPU, ``benchmarks/fed_projections_time.py``).

Which layers: decided by running, on the first training call of each layer of a checkpointed block
(:func:`decide`): a layer is chunked when it is called with one tensor and no keyword arguments, gives an output
with the same tokens, saves for backward at least twice its input and output bytes per token (measured on one and
two tokens), or at least once when what it saves is a wider copy of its tokens than its input (a bf16 RMSNorm that
computes in fp32, as transformers' Llama, Qwen and Mistral norms do: its backward then makes several fp32 copies of
its tokens at once, the largest part of an 8B Llama block's recompute backward at long context before this rule), is
token-wise (changing one token's input changes no other token's output, bit for bit, and its chunked output equals
its whole output), draws no random numbers, changes no buffer, and trains no parameter outside itself. Attention
(keyword arguments, or tokens mixed), convolutions (tokens mixed) and norms that compute in their input's width
(nothing to gain) stay as they are. On the planner's fake tensors, which have no values, the token-wise test follows the ops
instead (:mod:`lightning_hbm.activations.token_rows`), and that verdict is kept apart from the real one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.token_rows import fake_rowwise_reason
from lightning_hbm.memory.storage import tensor_storage_key

WIDENING = 2.0  # chunk a layer that saves for backward at least this many times its input + output bytes per token
UPCAST = 1.0  # ... or this many times, when what it saves is a wider copy of its tokens (its backward runs wide)


class _Box:
    """Where ``_KeepInput`` leaves its context for ``_ChunkedCall``'s backward (which runs first) to unpack from."""

    ctx: Any = None


class _Fed:
    """One whole layer fed by a chunked source (kept in the source's context, in the forward's order): its call and,
    in the backward, its output's gradient until the last of them arrives. Not the layer's context: the source's
    context and its consumers' would then hold each other, and a graph the checkpoint recomputed (with the block's
    input restored in it) would live until the garbage collector ran, one block's input more per block."""

    def __init__(self, call: _Chunks) -> None:
        self.call, self.grad = call, None


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
    def forward(ctx: Any, x: Tensor, call: _Chunks, box: Optional[_Box], source: Any, *params: Tensor) -> Tensor:
        ctx.call, ctx.box, ctx.source, ctx.params = call, box, source, params
        ctx.stash = None  # the kept input, when a later chunked call unpacked it first (:func:`_kept_input`)
        if box is None and source is None:  # an input without a graph: nothing upstream to recompute it from
            ctx.save_for_backward(x)
        ctx.fed = []  # as a source: the whole layers it feeds, in the forward's order (:class:`_Fed`)
        if call.whole:  # called as the code before calls it: the same output, bit for bit
            ctx.member = _Fed(call)
            source.fed.append(ctx.member)
            out = call.inner(x.detach())
            return out.clone() if tensor_storage_key(out) == tensor_storage_key(x) else out
        # detached: tracers that hook module inputs (torch's MemTracker) need a tensor with a grad_fn or none
        return run_chunks(call.inner, call.split(x.detach()), x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        if ctx.call.whole and torch.is_grad_enabled():  # a second derivative (create_graph): see _whole_graph_backward
            return _whole_graph_backward(ctx, grad)
        if ctx.call.whole:  # its parameters' gradients: accumulated by _fed_backward's backward, or returned
            return _whole_backward(ctx, grad)
        if any(c.grad is not None for c in ctx.fed):  # a whole layer it feeds whose partners' backward never ran
            flushed = _fed_backward(ctx)
            grad = flushed if grad is None else grad + flushed
        call: _Chunks = ctx.call
        wants_x, wanted = ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
        params = [p for p, needed in zip(ctx.params, wanted) if needed]
        grads_p: list[Optional[Tensor]] = [None] * len(params)
        chunks = _input_chunks(ctx)
        # the input's gradient is written chunk by chunk into one tensor: gathering the chunks' gradients and joining
        # them held the input's gradient twice at the end (the peak of an 8B block's backward at long context)
        grad_x: Optional[Tensor] = None
        # under create_graph (a gradient penalty's second derivative) this backward is recorded: each chunk stays tied
        # to the kept input's graph and its gradients are taken with a graph (detached, they were constants: the
        # second derivative came out silently wrong, or failed where the chunked layer was the input's only path)
        create = torch.is_grad_enabled()
        run = set(torch_compat.chunk_starts(len(chunks), 1, grad))  # on fake tensors the others only allocate
        row = 0
        for i, (chunk, grad_chunk) in enumerate(zip(chunks, call.split(grad))):
            rows, row = row, row + chunk.numel() // chunk.shape[-1]
            if i not in run:
                continue
            if ctx.source is not None:  # the chunk of the input, remade from the source's kept input
                chunk = ctx.source.call.recompute(chunk) if create else ctx.source.call.rerun(chunk)
            if not create or not chunk.requires_grad:
                chunk = chunk.detach().requires_grad_(wants_x)
            out = call.recompute(chunk)
            asked = ([chunk] if wants_x else []) + params
            got = torch.autograd.grad(out, asked, grad_chunk, allow_unused=True, create_graph=create)
            if wants_x:
                if grad_x is None:
                    grad_x = chunk.new_empty(*grad.shape[:-1], chunk.shape[-1])
                part = grad_x.view(-1, chunk.shape[-1])[rows:row]
                if got[0] is not None:
                    part.copy_(got[0].reshape(part.shape))
                else:
                    part.zero_()
                got = got[1:]
            grads_p = [a if b is None else b if a is None else a + b for a, b in zip(grads_p, got)]
        rest = iter(grads_p)
        return (grad_x, None, None, None, *(next(rest) if n else None for n in wanted))


def _whole_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    """The backward of a layer run whole, fed by a chunked source (:class:`_Chunks`' ``whole``: q/k/v fed by the
    ``input_layernorm``): its output's gradient is kept until every layer the source feeds has its own; the last one
    to arrive runs them all together (:func:`_fed_backward`) and returns the source output's gradient, the others
    None (nothing to add); their parameters' gradients are accumulated by that backward (None here).

    Where this backward accumulates into no ``.grad`` of theirs (``autograd.grad(loss, params)``,
    ``backward(inputs=...)`` leaving one out), each layer's own gradients are returned instead (:func:`_own_backward`):
    accumulated, they went into ``.grad`` and the caller got None for them. A second derivative takes
    :func:`_whole_graph_backward` instead (:meth:`_ChunkedCall.backward`)."""
    if not torch_compat.accumulates_into([p for member in ctx.source.fed for p in member.call.params]):
        return _own_backward(ctx, grad)
    ctx.member.grad = grad
    grad_x = _fed_backward(ctx.source) if all(m.grad is not None for m in ctx.source.fed) else None
    return (grad_x, None, None, None, *(None for _ in ctx.params))


def _own_backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    """One whole layer's gradients (input and parameters) returned by its own node, for a backward that accumulates
    into no ``.grad`` (:func:`_whole_backward`): its input remade from the source, the layer recomputed on it. The
    input's gradient is summed layer by layer, not in the order of one backward through them all: within rounding
    of :func:`_fed_backward`'s, not bit for bit (each layer remakes the input: one source forward more per layer)."""
    x = _remade_input(ctx.source).detach().requires_grad_(True)
    out = ctx.call.recompute(x)
    got = torch.autograd.grad(out, [x, *ctx.params], grad, allow_unused=True)
    return (got[0], None, None, None, *got[1:])


def _whole_graph_backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
    """The backward of a layer run whole, fed by a chunked source, under create_graph (a gradient penalty's second
    derivative): recorded, so that autograd can differentiate it again. Its input is remade with a graph (each chunk
    recomputed by the source's layer from the source's kept input, which keeps its own graph), the layer recomputed on
    it, and its gradients (input and parameters) taken with a graph and returned through the Function, each layer on
    its own as its gradient arrives: accumulating the parameters' gradients straight into ``.grad``, as the
    first-order :func:`_fed_backward` does, would lose them for ``autograd.grad(..., params)`` and for the second
    derivative. Remade input and recompute are paid once per fed layer (three norm recomputes for q/k/v instead of
    one), only in this rare mode; the first-order path is left as it is (bit for bit, same memory)."""
    wants_x, wanted = ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
    params = [p for p, needed in zip(ctx.params, wanted) if needed]
    x = _remade_input(ctx.source, graph=True)
    if not x.requires_grad:  # the kept input came back without a graph (and the source trains nothing): a leaf
        x = x.detach().requires_grad_(wants_x)
    out = ctx.call.recompute(x)
    asked = ([x] if wants_x else []) + params
    got = list(torch.autograd.grad(out, asked, grad, allow_unused=True, create_graph=True)) if asked else []
    grad_x = got.pop(0) if wants_x else None
    rest = iter(got)
    return (grad_x, None, None, None, *(next(rest) if needed else None for needed in wanted))


def _fed_backward(source: Any) -> Tensor:
    """The gradient of ``source``'s output through the whole layers it feeds whose output gradients arrived, taken as
    the code before took it: their input remade (each chunk by the source's layer, the forward's values bit for bit),
    each layer recomputed on it in the forward's order, and one backward through them all, so that the six
    contributions of q/k/v's base and LoRA paths add up in the order they did; their parameters' gradients are
    accumulated by autograd as before (hooks included)."""
    members = [c for c in source.fed if c.grad is not None]
    x = _remade_input(source).detach().requires_grad_(True)
    edges, grads = [], []
    for member in members:
        out = member.call.recompute(x)
        # the output's gradient edge, not the output: its bytes (8 KiB per token for q_proj at 8B) go at once
        edges.append(torch.autograd.graph.get_gradient_edge(out))
        grads.append(member.grad)
        member.grad = None
        del out
    params = [p for member in members for p in member.call.params]
    torch.autograd.backward(edges, grads, inputs=[x, *params])
    return x.grad if x.grad is not None else torch.zeros_like(x)


def _remade_input(source: Any, graph: bool = False) -> Tensor:
    """The output of ``source`` (a chunked layer) in the backward of the whole layers it feeds: remade chunk by chunk
    from its kept input, each chunk written into one tensor (the chunks gathered and joined would hold it twice); the
    source's input is left stashed for the source's own backward. ``graph`` (create_graph): each chunk recomputed with
    a graph back to the kept input and the chunks joined by a differentiable ``cat``."""
    kept = _kept_input(source)
    source.stash = kept
    chunks = source.call.split(kept)
    if graph:
        parts = [source.call.recompute(chunk) for chunk in chunks]
        width = parts[0].shape[-1]
        return torch.cat([p.reshape(-1, width) for p in parts]).reshape(*kept.shape[:-1], width)
    run = set(torch_compat.chunk_starts(len(chunks), 1, kept))  # on fake tensors the others only allocate
    whole: Optional[Tensor] = None
    row = 0
    for i, chunk in enumerate(chunks):
        rows, row = row, row + chunk.numel() // chunk.shape[-1]
        if i not in run:
            continue
        part = source.call.rerun(chunk)
        if whole is None:
            whole = part.new_empty(*kept.shape[:-1], part.shape[-1])
        whole.view(-1, part.shape[-1])[rows:row].copy_(part.reshape(-1, part.shape[-1]))
    assert whole is not None  # split gives at least one chunk, and chunk_starts runs the first
    return whole


def _kept_input(ctx: Any) -> Tensor:
    """The input a ``_ChunkedCall`` kept (through its ``_KeepInput``, or itself), unpacked once: a checkpoint's saved
    tensor may be unpacked only once per backward, and the chunked call after it (:func:`_source`) reads it first."""
    if ctx.stash is not None:
        x, ctx.stash = ctx.stash, None
        return x
    (x,) = ctx.box.ctx.saved_tensors if ctx.box is not None else ctx.saved_tensors
    return x


def _input_chunks(ctx: Any) -> list[Tensor]:
    """The chunks of a ``_ChunkedCall``'s input in its backward; with a ``source``, the chunks of the source's input
    (each remade into this call's input chunk by the source's layer, one at a time): the source's input is left
    stashed for the source's own backward, which runs next."""
    if ctx.source is None:
        return ctx.call.split(_kept_input(ctx))
    kept = _kept_input(ctx.source)
    ctx.source.stash = kept
    return ctx.source.call.split(kept)


def _source(x: Tensor, chunks: int) -> Any:
    """The backward node (its context) of the chunked token-wise layer whose output ``x`` is, in ``chunks`` chunks
    alike, or None.

    Why: a chunked layer fed straight by another (a Llama block's ``post_attention_layernorm`` -> ``mlp``) then keeps
    nothing of its own: its backward remakes each chunk of its input from the first layer's kept input, so the
    first layer's output (8 KiB per token for Llama 8B) is neither kept by the checkpoint's recompute nor made by it
    (the recompute stops at the first layer's kept input). The chunk boundaries are the same, so each remade chunk is
    the forward's, bit for bit.
    """
    node: Any = x.grad_fn  # a custom Function's node is its ctx: the attributes its forward set
    chunked = isinstance(node, _ChunkedCall._backward_cls)  # type: ignore[attr-defined]  # torch sets it on every Function
    # a source keeps its own input: a layer that remakes its input is no source (no chains of three)
    return node if chunked and node.call.chunks == chunks and node.source is None and not node.call.whole else None


class _Chunks:
    """One layer's own forward, how many token-chunks to run it in, and the autocast state of its forward.

    ``whole``: the layer runs whole in the forward and its backward (a layer fed by a chunked source whose gradients must
    stay the code before's: summed over chunks they would round differently); only its input is remade in chunks.

    The backward runs outside the forward's ``torch.autocast`` (the autograd engine does not carry it), so the
    recompute enters it again, as ``torch.utils.checkpoint`` does: under ``bf16-mixed`` it computes in bfloat16 too.
    """

    def __init__(
        self, inner: Any, chunks: int, device_type: str, block: Optional[int] = None, whole: bool = False, params: tuple = ()
    ) -> None:
        self.inner, self.chunks, self.device_type, self.block, self.whole = inner, chunks, device_type, block, whole
        self.params = params  # a whole layer's trainable parameters (their gradients: see _fed_backward)
        self.autocast = torch.is_autocast_enabled(device_type)
        self.autocast_dtype = torch.get_autocast_dtype(device_type)

    def split(self, x: Tensor) -> list[Tensor]:
        return split(x, self.chunks)

    def recompute(self, chunk: Tensor) -> Any:
        with torch.enable_grad(), torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
            return self.inner(chunk)

    def rerun(self, chunk: Tensor) -> Tensor:
        """The forward's output of ``chunk`` again, without a graph (the chunk of the next layer's input)."""
        with torch.no_grad(), torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast):
            return self.inner(chunk)


class ChunkedForward:
    """The ``forward`` of one layer inside a checkpointed block: chunked once :func:`decide` said yes.

    A picklable object (not a closure) kept in the layer's ``__dict__``, like the block's own checkpointed forward.
    ``verdict`` is ``None`` until the first training call, then ``""`` (chunked) or the reason it is not.
    ``fed_only``: a layer inside one of the block's layers (:func:`inner_candidates`: q/k/v inside the attention),
    chunked only when fed straight by a chunked layer and it keeps a copy of its input (:func:`decide`'s ``fed``).
    """

    def __init__(self, layer: nn.Module, chunks: int, block: Optional[int] = None, fed_only: bool = False) -> None:
        self.layer, self.chunks, self.fed_only = layer, chunks, fed_only
        #: the checkpointed block the layer is in (a number per block; ``None``: outside every block, the final norm):
        #: a layer remakes its input only from a source in its own block (:meth:`__call__`)
        self.block = block
        self.own_forward = torch_compat.forward_override(layer)
        self.verdict: Optional[str] = None
        self.fake_verdict: Optional[str] = None  # the same, decided on the planner's fake tensors

    def inner(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own_forward or type(self.layer).forward.__get__(self.layer)
        return own(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.inner(*args, **kwargs)  # evaluation: nothing is saved, nothing to recompute
        # the planner's trace (fake tensors) decides by following the ops (token_rows), apart from the real verdict,
        # which the first real training step always makes
        if self.fed_only and not (args and isinstance(args[0], Tensor) and _source(args[0], self.chunks) is not None):
            # not fed straight by a chunked layer (block 0's q/k/v behind a norm that gets no gradient, or a call from
            # its parent's decide): as before; no verdict either, the next fed call decides
            return self.inner(*args, **kwargs)
        fake = any(torch_compat.is_fake(a) for a in args if isinstance(a, Tensor))
        if (self.fake_verdict if fake else self.verdict) is None:
            # identity hooks: what the test saves must not land in the block checkpoint's count of saved tensors
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                verdict = decide(self.layer, self.inner, self.chunks, args, kwargs, fed=self.fed_only)
            if fake:
                self.fake_verdict = verdict
            else:
                self.verdict = verdict
        if self.fake_verdict if fake else self.verdict:
            return self.inner(*args, **kwargs)
        x = args[0]
        params = tuple(p for p in self.layer.parameters() if p.requires_grad)
        if not x.requires_grad and not params:
            return self.inner(x)  # nothing to differentiate
        source = _source(x, self.chunks)
        if source is not None and (self.block is None or source.call.block != self.block):
            # remade from another block's layer (T5's final norm from the last block's whole feed-forward), the input
            # cost a rerun of that layer per step for nothing: outside the source's block it is kept anyway (the final
            # norm's own saved input, or the next block's checkpointed input)
            source = None
        if self.fed_only and source is not None:  # run whole, its input remade from the source in the backward
            call = _Chunks(self.inner, self.chunks, x.device.type, block=self.block, whole=True, params=params)
            return _ChunkedCall.apply(x, call, None, source, *params)
        box = _Box() if x.requires_grad and source is None else None
        if box is not None:
            x = _KeepInput.apply(x, box)
        return _ChunkedCall.apply(x, _Chunks(self.inner, self.chunks, x.device.type, self.block), box, source, *params)


def split(x: Tensor, chunks: int) -> list[Tensor]:
    """``x``'s tokens (every position of every leading dimension) in ``chunks`` pieces, each a contiguous
    ``(1, tokens, features)`` tensor (a 2-D ``x`` keeps its rank: row blocks).

    Contiguous because a layer may ``view`` its input (Mixtral's sparse MLP does); flattened first because the
    chunks of a contiguous ``(tokens, features)`` view are views too, where slicing a batch of sequences along its
    sequence dimension would copy every chunk (3.7 MiB more at the 100M shape, measured).
    """
    if x.dim() == 2:
        return list(x.contiguous().chunk(chunks, dim=0))
    return list(x.reshape(1, -1, x.shape[-1]).chunk(chunks, dim=1))


def join(parts: list[Tensor], like: Tensor) -> Tensor:
    """The outputs of :func:`split`'s chunks as one tensor with ``like``'s leading dimensions.

    Written into a new tensor, not reshaped: a custom Function's output that is a view cannot be changed in place,
    and Falcon adds the attention output to its MLP's output in place.
    """
    if like.dim() == 2:
        return torch.cat(parts, dim=0)
    width = parts[0].shape[-1]
    whole = parts[0].new_empty(*like.shape[:-1], width)
    torch.cat([p.reshape(-1, width) for p in parts], dim=0, out=whole.view(-1, width))
    return whole


def inner_candidates(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers one level inside :func:`candidates` (a Llama attention's q/k/v/o projections, the MLP's), chunked only
    when fed straight by a chunked layer (``ChunkedForward(fed_only=True)``): q/k/v, fed by the chunked
    ``input_layernorm``, then keep nothing and remake their input chunk by chunk from the norm's kept input."""
    return [(f"{name}.{n}", c) for name, layer in candidates(block) for n, c in layer.named_children()
            if not isinstance(c, (nn.ModuleList, nn.ModuleDict))]


def candidates(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of ``block`` that may be chunked: its children, and the items of a container child (T5's
    ``layer`` ModuleList), which is never called itself."""
    found = []
    for name, child in block.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            found += [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            found.append((name, child))
    return found


def decide(
    layer: nn.Module, inner: Any, chunks: int, args: tuple[Any, ...], kwargs: dict[str, Any], fed: bool = False
) -> str:
    """``""`` if ``layer`` may be recomputed in ``chunks`` token-chunks, else why not (by running it).

    Decided on the first training call, with the real input: a layer's code says nothing reliable about whether it
    mixes tokens (attention does, a convolution does, a BatchNorm over tokens does in training mode), draws random
    numbers, saves enough for backward to be worth chunking, or reaches parameters it does not own.
    ``fed``: the layer's input comes straight from a chunked layer; it then pays when the layer keeps at least its
    input's bytes per token (a LoRA projection keeps its input for ``lora_A``'s gradient): chunked, it keeps nothing and
    its input, the chunked layer's output, is neither kept nor made again whole (:func:`_source`).
    """
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor) or args[0].dim() < 2:
        return "not called with one tensor of tokens"
    x = args[0]
    fake = torch_compat.is_fake(x)
    if x.shape[-2] < max(chunks, 2):
        return f"{x.shape[-2]} tokens, fewer than mlp_chunks={chunks}"
    versions = [b._version for b in layer.buffers()]
    before = _rng_states(x.device) if not fake else []  # fake: random draws are found by their ops (token_rows)
    with torch.no_grad():
        whole = inner(x)
    if before and _restore_rng(x.device, before):
        return "draws random numbers (dropout in training mode)"
    if [b._version for b in layer.buffers()] != versions:
        return "changes its buffers in the forward"
    if not isinstance(whole, Tensor) or whole.shape[:-1] != x.shape[:-1]:
        return "its output is not one tensor with the input's tokens"
    try:  # cheapest first (one and two tokens), each probe only if the one before passed
        (one, _), graph, leaf = _saved_bytes(inner, x, 1)
        (two, wide), _, _ = _saved_bytes(inner, x, 2)
        per_token = x[..., :1, :].numel() * x.element_size() + whole[..., :1, :].numel() * whole.element_size()
        # a layer that saves a wider copy of its tokens than it was given (a bf16 RMSNorm computing in fp32) runs its
        # backward in that width too: several such temporaries per token at once, whatever it saves
        threshold = UPCAST if wide else WIDENING
        if fed:  # what pays is the copy of the input it keeps: chunked, it keeps none (the source remakes it)
            threshold, per_token = 1.0, x[..., :1, :].numel() * x.element_size()
        if two - one < threshold * per_token:
            what = "its input" if fed else "its input and output"
            return f"saves {(two - one) / per_token:.1f}x {what} per token for backward (chunks pay from {threshold:g}x)"
        if fake:  # no values to compare: follow the ops instead (conservative: a refusal plans the whole recompute)
            reason = fake_rowwise_reason(layer, inner, x)
            if reason:
                return f"may mix tokens: {reason}"
        elif _mixes_tokens(inner, x, whole):
            return "mixes tokens (changing one token's input changed another token's output)"
        with torch.no_grad():
            parts = run_chunks(inner, split(x, chunks), x)
    except (RuntimeError, ValueError, IndexError) as err:  # fewer tokens than called with: a reshape to the count
        return f"fails on part of its tokens ({type(err).__name__}: {str(err)[:120]})"
    if not fake and not _close_in_chunks(parts, whole):
        return "mixes tokens (its chunked output differs)"
    foreign = _foreign_leaves(layer, graph, leaf)
    return f"trains {foreign} parameter(s) it does not own (their gradients would be lost)" if foreign else ""


def _saved_bytes(inner: Any, x: Tensor, tokens: int) -> tuple[tuple[int, bool], Any, Tensor]:
    """Bytes of the tensors the layer's forward on its first ``tokens`` tokens saves for backward (parameters left
    out, each tensor once), its output and its input leaf.

    What chunks shrink is exactly this, per token: two token counts tell it apart from what every call saves
    whatever its length (a weight's transpose, a dequantized weight). Tensor bytes, not storage bytes: a saved view
    of the whole input would count the whole batch.
    """
    saved: dict[Any, int] = {}
    wider = [False]

    def pack(tensor: Tensor) -> Tensor:
        if not isinstance(tensor, nn.Parameter):
            key = (tensor_storage_key(tensor), tensor.storage_offset(), tensor.shape, tensor.stride())
            saved[key] = tensor.numel() * tensor.element_size()
            if tensor.shape[:-1] == leaf.shape[:-1] and tensor.element_size() > leaf.element_size():
                wider[0] = True
        return tensor

    leaf = x[..., :tokens, :].detach().contiguous().requires_grad_(x.is_floating_point())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = inner(leaf)
    return (sum(saved.values()), wider[0]), out, leaf


def _close_in_chunks(parts: Tensor, whole: Tensor) -> bool:
    """Whether the chunks' output is the whole call's within two units of rounding of its dtype.

    Not exact, unlike :func:`_mixes_tokens` (which has already shown, exactly, that no token's output depends on
    another's): a matmul kernel may block fewer rows differently and round its sums differently. On the Dec 2 Intel CPU
    with AMX the bf16 4-bit MLP of the 100M Llama came out one bf16 rounding apart (0.00195 at a largest 0.887) in
    chunks of half the tokens, and fp32's tolerance (1e-3) refused it there.
    """
    eps = torch.finfo(whole.dtype).eps if whole.is_floating_point() else 0.0
    tol = max(1e-3, 2 * eps)
    return torch.allclose(parts, whole, rtol=tol, atol=max(1e-5, 2 * eps) * float(whole.abs().max()) + 1e-12)


def _mixes_tokens(inner: Any, x: Tensor, whole: Tensor) -> bool:
    """Whether changing the first (then the last) token's input, or the first sequence's, changes any other token's
    output by any amount.

    Exact on purpose: a token-wise layer computes each token's row on its own, so the other rows come out
    bit-identical, while a layer that mixes a little (ConvNeXt's 7x7 convolution behind a layer scale of 1e-6) would
    pass any tolerance at initialisation and then train differently in chunks. The first sequence too, because the
    chunks run tokens of several sequences together.
    """
    changes = [(0, slice(1, None), -2), (-1, slice(None, -1), -2)] + ([(0, slice(1, None), 0)] if x.dim() > 2 else [])
    for index, rest, dim in changes:
        moved = x.clone()
        moved.select(dim, index).add_(1.0 + float(x.detach().abs().max()))
        with torch.no_grad():
            out = inner(moved)
        if not isinstance(out, Tensor) or not torch.equal(out.narrow(dim, *_span(rest, x.shape[dim])),
                                                         whole.narrow(dim, *_span(rest, x.shape[dim]))):
            return True
    return False


def run_chunks(inner: Callable[[Tensor], Tensor], chunks: list[Tensor], like: Tensor) -> Tensor:
    """``inner`` of each of :func:`split`'s ``chunks`` of ``like``, in order, joined (:func:`join`).

    On fake tensors (the planner's trace) only the first two chunks and the last run, as in the traced forward: each
    middle one has the second's shape and no values, so its output is only allocated (running all 16 chunks of each
    8B MLP layer was 73 of a plan's 203 s)."""
    run = set(torch_compat.chunk_starts(len(chunks), 1, like))
    outputs: list[Tensor] = []
    for i, chunk in enumerate(chunks):
        outputs.append(inner(chunk) if i in run else torch.empty_like(outputs[-1]))
    return join(outputs, like)


def _span(rest: slice, size: int) -> tuple[int, int]:
    start, stop, _ = rest.indices(size)
    return start, stop - start


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


def _foreign_leaves(layer: nn.Module, out: Any, leaf: Tensor) -> int:
    """How many trained leaves other than ``layer``'s own parameters and its input ``leaf`` the graph of ``out``
    (the layer's output) reaches."""
    own = {id(p) for p in layer.parameters()} | {id(leaf)}
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


__all__ = ["ChunkedForward", "candidates", "decide", "inner_candidates", "join", "run_chunks", "split"]
