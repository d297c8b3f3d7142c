"""Attention as chunks of batched matmuls, saving less than a fused kernel: ``lightning_hbm::blocked_attention``.

Why by hand: on the CPU of the Dec 2 tables (2-core AMD EPYC with AVX512-BF16), torch's fused CPU kernel
(``_scaled_dot_product_flash_attention_for_cpu``) took 8.4 ms forward and 16.6 ms backward for SmolLM2's attention
(9 heads x 512 positions x 64, bf16, causal), about a third of a QLoRA step with full recompute, where this kernel,
on ``torch.bmm`` (oneDNN's bf16 matmuls), takes about 0.7x of that time (``benchmarks/README.md``). torch's math
kernel is slower still (14.3 + 20.8 ms) and keeps every score for backward.

Memory: backward keeps the inputs and one number per query row (no output, no fp32 log-sum-exp: less than the fused
kernel); the scores exist only for one chunk of query positions at a time (:data:`CHUNK_BYTES` of them), in forward
and again in backward, which recomputes them.

Precision: a bf16 matmul rounds its fp32 sums once, relative to their size, and the softmax depends on each score
minus its row's largest. So each chunk first finds its rows' largest scores with one bf16 matmul, then computes
``[q, -largest] @ [k, 1].T`` (an extra column), which rounds the small differences that matter instead of the large
scores. Without it (bf16 scores, as Hugging Face's eager attention rounds them) the real SmolLM2's weight gradients
were at cosine 0.898 to the fp32 model's on one batch of four, where torch's fused kernel gave 0.975; with it, 0.967
(``benchmarks/blocked_attention.py``). The softmax and its gradient run in torch's fused kernels (fp32 inside). A
query row whose keys are all masked gets a zero output and zero gradients, as torch's kernels give it.

One custom operator for forward and one for backward (``torch.library``), so that a dispatch mode (selective
checkpointing's policy, the profilers) sees one attention operator, and fake tensors have the outputs' shapes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.running import RunningModules

#: scores held at once per chunk of query positions, in bytes of the input dtype (backward holds a few such buffers);
#: 1 MiB was the fastest of 0.25-8 MiB at SmolLM2's and the 100M shape's attention on the Dec 2 CPU
CHUNK_BYTES = 1 * 2**20


def _chunks(batch_heads: int, lq: int, lk: int, causal: bool, itemsize: int) -> Iterator[tuple[int, int, int]]:
    """(first query position, end, keys it needs): causal chunks stop at their last row's key (top-left aligned)."""
    rows = max(1, CHUNK_BYTES // (batch_heads * lk * itemsize))
    for i0 in range(0, lq, rows):
        i1 = min(lq, i0 + rows)
        yield i0, i1, min(i1, lk) if causal else lk


def _grouped(q: Tensor, heads_kv: int) -> Tensor:
    """[B, Hq, L, D] -> [B, Hkv, Hq / Hkv, L, D]: the query heads that share one key/value head side by side."""
    b, hq, lq, d = q.shape
    return q.reshape(b, heads_kv, hq // heads_kv, lq, d)


def _bias(mask: Optional[Tensor], q: Tensor, heads_kv: int, lk: int, causal: bool, i0: int, i1: int,
          kend: int) -> Optional[Tensor]:
    """The chunk's additive mask, broadcastable to its scores [B*Hkv, G*c, kend] (None: nothing masked)."""
    b, hq, _, _ = q.shape
    g, c = hq // heads_kv, i1 - i0
    if causal:  # top-left aligned, as torch's is_causal: query i sees keys 0..i
        hidden = torch.ones(c, kend, dtype=torch.bool, device=q.device).triu_(i0 + 1)
        bias = torch.zeros(c, kend, dtype=q.dtype, device=q.device).masked_fill_(hidden, -math.inf)
        return bias.repeat(g, 1)  # rows are (query head of the group, position)
    if mask is None:
        return None
    m = mask[..., i0:i1, :kend].expand(b, hq, c, kend).reshape(b * heads_kv, g * c, kend)
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill_(~m, -math.inf)
    return m.to(q.dtype)


def _with_columns(x: Tensor, *columns: Tensor) -> Tensor:
    """``x`` [N, R, D] with ``columns`` [N, R] appended, and a zero column if that makes the width odd (oneDNN's bf16
    matmul ran at half speed with 65 columns on the Dec 2 CPU, at full speed with 66)."""
    extra = [c.unsqueeze(-1).to(x.dtype) for c in columns]
    if (x.shape[-1] + len(extra)) % 2:
        extra.append(x.new_zeros(*x.shape[:-1], 1))
    return torch.cat([x, *extra], dim=-1)


def _probabilities(qc: Tensor, k1: Tensor, offset: Tensor, bias: Optional[Tensor], scale: float,
                   masked: bool) -> Tensor:
    """Attention probabilities [N, R, kend] of queries ``qc`` [N, R, D] over keys ``k1`` [N, kend, D + 1 (+ 1)] (a
    column of ones appended), each row's scores lowered by its ``offset`` [N, R] inside the matmul.

    Why the offset: a bf16 matmul rounds its fp32 sums once, relative to their size; the softmax depends on scores
    minus their row's maximum, which for the keys that matter are small numbers. ``[q, -offset] @ [k, 1].T`` rounds
    ``q @ k.T - offset`` itself (torch's fused kernels keep fp32 scores instead).
    """
    qa = _with_columns(qc, -offset)
    u = torch.baddbmm(bias if bias is not None else qa.new_zeros(()), qa, k1[..., : qa.shape[-1]].transpose(1, 2),
                      beta=1 if bias is not None else 0, alpha=scale)
    # _safe_softmax: a row whose keys are all masked gets zeros (plain softmax: NaN), as torch's kernels give it
    return torch.ops.aten._safe_softmax(u, -1) if masked else torch.softmax(u, -1)


def _prepared(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q as [B, Hkv, G, Lq, D]; k as [B*Hkv, Lk, D + 1 (+ 1)] with a column of ones (the offsets' partner); v as
    [B*Hkv, Lk, Dv]."""
    b, hkv, lk = k.shape[:3]
    return (_grouped(q, hkv), _with_columns(k.reshape(b * hkv, lk, -1), k.new_ones(b * hkv, lk)),
            v.reshape(b * hkv, lk, -1))


@torch.library.custom_op("lightning_hbm::blocked_attention", mutates_args=())
def blocked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool,
                      scale: float) -> tuple[Tensor, Tensor]:
    """Attention of ``q`` [B, Hq, Lq, D] over ``k`` [B, Hkv, Lk, D] and ``v`` [B, Hkv, Lk, Dv] (Hq a multiple of Hkv).

    Args:
        mask: None, or broadcastable to [B, Hq, Lq, Lk]: bool (True: attend) or additive.
        causal: query i attends keys 0..i (top-left aligned, as ``is_causal``); not together with ``mask``.
        scale: multiplies ``q @ k.T``.

    Returns:
        the output [B, Hq, Lq, Dv] in q's dtype, and each query row's score offset [B, Hq, Lq] (the largest of its
        unscaled scores, as a first bf16 matmul finds it), which backward reuses.
    """
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    q5, k1, v1 = _prepared(q, k, v)
    out = q.new_empty(b * hkv, g, lq, dv)
    offsets = q.new_empty(b * hkv, g, lq)
    for i0, i1, kend in _chunks(b * hq, lq, lk, causal, q.element_size()):
        c = i1 - i0
        bias = _bias(mask, q, hkv, lk, causal, i0, i1, kend)
        qc = q5[:, :, :, i0:i1].reshape(b * hkv, g * c, d)
        kt = k1[:, :kend, :d].transpose(1, 2)
        rough = torch.bmm(qc, kt) if bias is None else torch.baddbmm(bias, qc, kt)
        offset = rough.amax(-1)
        offset.masked_fill_(offset == -math.inf, 0.0)  # a row with every key masked
        p = _probabilities(qc, k1[:, :kend], offset, bias, scale, mask is not None)
        out[:, :, i0:i1] = torch.bmm(p, v1[:, :kend]).view(b * hkv, g, c, dv)
        offsets[:, :, i0:i1] = offset.view(b * hkv, g, c)
    return out.view(b, hq, lq, dv), offsets.view(b, hq, lq)


@blocked_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(*q.shape[:3], v.shape[-1]), q.new_empty(q.shape[:3])


@torch.library.custom_op("lightning_hbm::blocked_attention_backward", mutates_args=())
def blocked_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor],
                               offsets: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`blocked_attention`'s output for q, k and v (the probabilities recomputed per chunk)."""
    b, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = hq // hkv
    q5, k1, v1 = _prepared(q, k, v)
    grad5, offsets5 = _grouped(grad, hkv), offsets.reshape(b * hkv, g, lq)
    dq = q.new_empty(b * hkv, g, lq, d)
    # key and value gradients sum over every chunk (and every query head of the group): fp32 sums
    dk = torch.zeros(b * hkv, lk, d, dtype=torch.float32, device=q.device)
    dv_ = torch.zeros(b * hkv, lk, dv, dtype=torch.float32, device=q.device)
    for i0, i1, kend in _chunks(b * hq, lq, lk, causal, q.element_size()):
        c = i1 - i0
        bias = _bias(mask, q, hkv, lk, causal, i0, i1, kend)
        qc = q5[:, :, :, i0:i1].reshape(b * hkv, g * c, d)
        p = _probabilities(qc, k1[:, :kend], offsets5[:, :, i0:i1].reshape(b * hkv, g * c), bias, scale,
                           mask is not None)
        gc = grad5[:, :, :, i0:i1].reshape(b * hkv, g * c, dv)
        dv_[:, :kend] += torch.bmm(p.transpose(1, 2), gc)
        dp = torch.bmm(gc, v1[:, :kend].transpose(1, 2))
        ds = torch.ops.aten._softmax_backward_data(dp, p, -1, p.dtype)  # p * (dp - rowsum(p * dp)): one fused kernel
        dq[:, :, i0:i1] = torch.bmm(ds, k1[:, :kend, :d]).mul_(scale).view(b * hkv, g, c, d)
        dk[:, :kend] += torch.bmm(ds.transpose(1, 2), qc).mul_(scale)
    return dq.view(b, hq, lq, d), dk.to(k.dtype).view(k.shape), dv_.to(v.dtype).view(v.shape)


@blocked_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], offsets: Tensor, causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, causal, scale = inputs
    ctx.save_for_backward(q, k, v, mask, output[1])  # the inputs and one bf16 number per row (no output)
    ctx.causal, ctx.scale = causal, scale


def _backward(ctx, grad: Tensor, _offsets_grad: Optional[Tensor]):  # type: ignore[no-untyped-def]
    q, k, v, mask, offsets = ctx.saved_tensors
    dq, dk, dv = blocked_attention_backward(grad.contiguous(), q, k, v, mask, offsets, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None


blocked_attention.register_autograd(_backward, setup_context=_setup_context)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, causal: bool = False,
              scale: Optional[float] = None) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=True)`` without
    dropout, on :func:`blocked_attention`."""
    return blocked_attention(q, k, v, mask, causal, scale if scale is not None else q.shape[-1] ** -0.5)[0]


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class Signature(NamedTuple):
    """What decides an attention call's speed on one kernel (lengths and batch rounded up to powers of two)."""

    device: str
    dtype: str
    heads: int
    heads_kv: int
    head_dim: int
    value_dim: int
    mask: str  # "none", "bool" or "float"
    causal: bool
    rows: int  # batch * query positions, rounded up to a power of two
    keys: int  # key positions, rounded up to a power of two

    def __str__(self) -> str:
        return (f"{self.dtype} on {self.device}, {self.heads} heads ({self.heads_kv} for keys/values) x {self.head_dim}, "
                f"<= {self.rows} batch x query positions, <= {self.keys} keys, "
                f"{'causal' if self.causal else f'mask {self.mask}'}")


class Call(NamedTuple):
    """One ``F.scaled_dot_product_attention`` call this kernel takes, its arguments resolved."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Optional[Tensor]
    causal: bool
    scale: Optional[float]

    @property
    def signature(self) -> Signature:
        b, hq, lq, d = self.q.shape
        kind = "none" if self.mask is None else "bool" if self.mask.dtype == torch.bool else "float"
        return Signature(self.q.device.type, str(self.q.dtype).removeprefix("torch."), hq, self.k.shape[1], d,
                         self.v.shape[-1], kind, self.causal, _pow2(b * lq), _pow2(self.k.shape[2]))

    def run(self) -> Tensor:
        return attention(self.q, self.k, self.v, self.mask, self.causal, self.scale)

    def shapes(self) -> "Shapes":
        mask = None if self.mask is None else (tuple(self.mask.shape), self.mask.dtype)
        return Shapes(tuple(self.q.shape), tuple(self.k.shape), tuple(self.v.shape), mask, self.q.dtype,
                      self.q.device, self.causal, self.scale)


class Shapes(NamedTuple):
    """A call's shapes and settings without its tensors (kept across steps, so it must not hold activations)."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    mask: Optional[tuple[tuple[int, ...], torch.dtype]]
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: Optional[float]


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def resolve(args: tuple, kwargs: dict) -> tuple[Optional[Call], str]:
    """The call, or None and why this kernel does not take it (torch's kernel runs it then)."""
    bound = dict(zip(_SDPA_ARGS, args), **kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    mask, dropout = bound.get("attn_mask"), bound.get("dropout_p", 0.0)
    if not all(type(t) is Tensor and t.dim() == 4 for t in (q, k, v)):
        return None, "inputs that are not plain 4-D tensors (batch, heads, positions, features)"
    assert q is not None and k is not None and v is not None
    if dropout:
        return None, f"attention dropout ({dropout}): the kernel has none"
    if not (q.dtype == k.dtype == v.dtype and q.is_floating_point()) or len({q.device, k.device, v.device}) > 1:
        return None, f"mixed dtypes or devices ({q.dtype}/{k.dtype}/{v.dtype})"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return None, f"shapes q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} that broadcast or do not match"
    heads, heads_kv = q.shape[1], k.shape[1]
    if heads != heads_kv and not (bound.get("enable_gqa") and heads % heads_kv == 0):
        return None, f"{heads} query heads for {heads_kv} key/value heads without enable_gqa"
    if mask is not None:
        if bound.get("is_causal"):
            return None, "an explicit mask together with is_causal=True (torch refuses it)"
        if type(mask) is not Tensor or mask.requires_grad:
            return None, "a mask that needs a gradient"
        try:
            torch.broadcast_shapes(mask.shape, (*q.shape[:3], k.shape[2]))
        except RuntimeError:
            return None, f"a mask of shape {list(mask.shape)} that does not broadcast"
    return Call(q, k, v, mask, bool(bound.get("is_causal")), bound.get("scale")), ""


class Timing(NamedTuple):
    """Forward + backward seconds of one signature on torch's kernel and on this one (the best of some repeats)."""

    torch_s: float
    blocked_s: float


#: "auto" moves a signature to the blocked kernel only where it takes at most this fraction of torch's kernel's time
#: (forward + backward): a margin over the timing's noise, so that a tie keeps torch's kernel
BLOCKED_MARGIN = 0.9


class Router:
    """Which kernel each attention call runs on: every call this kernel takes (``always``), or the signatures whose
    :class:`Timing` says it is faster. Signatures not timed yet run on torch's kernel and wait in ``seen``; calls it
    cannot take run on torch's kernel, their reasons in ``refused``."""

    def __init__(self, always: bool, timings: dict[Signature, Timing]) -> None:
        self.always = always
        self.timings = timings  # the callback's own dict (its checkpointed state)
        self.seen: dict[Signature, Shapes] = {}
        self.refused: dict[str, str] = {}  # reason -> one such call's shapes

    def uses_blocked(self, signature: Signature) -> bool:
        timing = self.timings.get(signature)
        return self.always or (timing is not None and timing.blocked_s <= BLOCKED_MARGIN * timing.torch_s)

    def observe(self, args: tuple, kwargs: dict) -> Optional[Call]:
        """The call if this kernel takes it (its signature kept in ``seen`` until timed), else None (the reason kept)."""
        call, why = resolve(args, kwargs)
        if call is None:
            self.refused.setdefault(why, str([list(a.shape) for a in args[:3] if isinstance(a, Tensor)]))
            return None
        signature = call.signature
        if signature not in self.timings and signature not in self.seen:
            self.seen[signature] = call.shapes()
        return call

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        call = self.observe(args, kwargs)
        return call.run() if call is not None and self.uses_blocked(call.signature) else func(*args, **kwargs)


class _Mode(TorchFunctionMode):
    """Hands ``F.scaled_dot_product_attention`` calls to a :class:`Router`; with ``found`` (recording), tells
    ``found`` instead and runs torch's kernel, the router (if any) only observing the call."""

    def __init__(self, router: Optional[Router], found: Optional[Callable[[], None]] = None) -> None:
        super().__init__()
        self.router, self.found = router, found

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        if self.found is None:
            assert self.router is not None
            return self.router(func, args, kwargs)
        self.found()
        if self.router is not None:
            self.router.observe(args, kwargs)
        return func(*args, **kwargs)


class RoutedForward:
    """The ``forward`` of one module that calls ``F.scaled_dot_product_attention``: it runs inside the router's torch
    function mode.

    Why per module and not one mode around the batch: torch function modes are thread-local state that the autograd
    engine does not carry into backward, where activation checkpointing runs the forward again; a recompute on
    another kernel than its forward saves other tensors, and checkpointing fails. The module's own ``forward`` is
    what the recompute calls. A picklable object kept in the module's ``__dict__``, like the checkpointed forwards.
    """

    def __init__(self, module: nn.Module, router: Router) -> None:
        self.module, self.router = module, router
        self.own_forward = torch_compat.forward_override(module)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.own_forward or type(self.module).forward.__get__(self.module)
        with _Mode(self.router):
            return own(*args, **kwargs)


class CallerRecorder:
    """Records the modules of ``model`` whose own ``forward`` calls ``F.scaled_dot_product_attention`` while it is
    entered (the innermost module running at the call): decided by running, whatever the model's source. Every call
    still runs torch's kernel; ``router`` (if given) observes each (:meth:`Router.observe`)."""

    def __init__(self, model: nn.Module, router: Optional[Router] = None) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.found: dict[str, None] = {}
        self._running = RunningModules()  # process-wide module hooks, for the recorded step only (removed on exit)
        self._mode = _Mode(router, self._record)

    def _record(self) -> None:
        running = (id(m) for m in reversed(self._running.stack))
        inner = next((self.names[i] for i in running if i in self.names), None)
        if inner is not None:
            self.found[inner] = None

    def __enter__(self) -> "CallerRecorder":
        self._running.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._running.__exit__(*exc)


def attention_callers(model: nn.Module, run: Callable[[], Any]) -> list[str]:
    """Names of the modules of ``model`` whose own ``forward`` calls ``F.scaled_dot_product_attention`` in ``run()``."""
    with CallerRecorder(model) as recorder:
        run()
    return list(recorder.found)


def route(model: nn.Module, names: list[str], router: Router) -> None:
    """Give the modules ``names`` of ``model`` a :class:`RoutedForward` (one already routed gets the new router)."""
    for name in names:
        module = model.get_submodule(name)
        current = torch_compat.forward_override(module)
        if isinstance(current, RoutedForward):
            current.router = router
        else:
            torch_compat.override_forward(module, RoutedForward(module, router))


def unroute(model: nn.Module) -> None:
    """Put back the forwards :func:`route` replaced."""
    for module in model.modules():
        current = torch_compat.forward_override(module)
        if isinstance(current, RoutedForward):
            torch_compat.override_forward(module, current.own_forward)


def time_kernels(call: Shapes, repeats: int = 3) -> Timing:
    """Time forward + backward of ``call``'s shapes on torch's kernel (as the current ``sdpa_kernel`` allows) and on
    this one, interleaved, on fresh tensors (random inputs; a mask that masks nothing)."""
    q, k, v = (torch.randn(shape, dtype=call.dtype, device=call.device, requires_grad=True)
               for shape in (call.q, call.k, call.v))
    grad = torch.randn(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    gqa = q.shape[1] != k.shape[1]
    mask = None
    if call.mask is not None:
        shape, dtype = call.mask
        mask = torch.zeros(shape, dtype=dtype, device=q.device) if dtype != torch.bool else torch.ones(
            shape, dtype=dtype, device=q.device)

    def run(fn: Callable[[], Tensor]) -> float:
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)
        start = time.perf_counter()
        fn().backward(grad)
        if q.device.type == "cuda":
            torch.cuda.synchronize(q.device)
        return time.perf_counter() - start

    def reference() -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=call.causal, scale=call.scale,
                                              enable_gqa=gqa)

    def blocked() -> Tensor:
        return attention(q, k, v, mask, call.causal, call.scale)

    times: dict[str, list[float]] = {"torch": [], "blocked": []}
    with torch.enable_grad():
        for i in range(repeats + 1):  # the first round warms both up
            for name, fn in (("torch", reference), ("blocked", blocked)):
                elapsed = run(fn)
                if i:
                    times[name].append(elapsed)
    return Timing(min(times["torch"]), min(times["blocked"]))


__all__ = ["BLOCKED_MARGIN", "CHUNK_BYTES", "Call", "CallerRecorder", "RoutedForward", "Router", "Shapes", "Signature", "Timing",
           "attention", "attention_callers", "blocked_attention", "blocked_attention_backward", "resolve", "route",
           "time_kernels", "unroute"]
