"""Probe a model on one batch and compare its outputs: shared by ``QuantizationQuality`` and the precision plugin.

It sits below ``precision`` and ``callbacks`` (see ``tests/test_layering.py``) so that the quantization
choices (sensitivity plan, smoothing, GPTQ) and the callback that reports their cost measure with the
same code; those of one quantization are handed a :class:`Probe` (the model and its batch, built once) and run their
forwards through it. ``lightning_hbm.quality`` re-exports every name. The probe batch is drawn by :mod:`lightning_hbm.probe_batch`
(:func:`first_batch`, :func:`first_batches`, re-exported here).
"""

from __future__ import annotations

import warnings
import weakref
from collections import Counter
from collections.abc import Collection, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torchmetrics import CosineSimilarity, RelativeSquaredError

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.probe_batch import first_batch, first_batches  # public here too (drawn by probe_batch)

PREFIX = "quant/"


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a ``forward`` (a LightningModule need not: ``training_step`` may compute without one)."""
    return "forward" in vars(module) or type(module).forward not in (nn.Module.forward, pl.LightningModule.forward)


def check_forward(module: nn.Module, who: str) -> None:
    """``TypeError`` naming the fix when ``module`` has no ``forward`` for the probe batch to go through.

    Without this, the probe fails inside torch: ``_forward_unimplemented() got an unexpected keyword argument
    'input_ids'``, which names neither the module nor what to add.
    """
    if has_forward(module):
        return
    name = type(module).__name__
    raise TypeError(
        f"{who} runs a probe batch through {name}.forward (module(x), module(inputs) of an (inputs, targets) pair, or "
        f"module(**batch) of a dict), but {name} defines no forward (Lightning trains through training_step, which "
        f"may compute without one). Define {name}.forward returning the output tensor or an object with .logits, e.g. "
        f"`def forward(self, **batch): return self.model(**batch)` for a dict batch or `def forward(self, x): return "
        f"self.model(x)`."
    )


def forward_on(module: nn.Module, batch: Any) -> Any:
    """``module``'s output on ``batch``, whatever it is: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets)
    pair, or ``forward(**dict)``, on a copy of the batch: a forward that changes its input in place (``x /= 255``) ran
    on the user's batch once per probe forward, and the probe batch is the first batch training gets (a
    ``BatchEncoding``'s tensors too, :func:`~lightning_hbm._compat.torch.map_tensors`)."""
    if isinstance(batch, Tensor):
        return module(batch.clone())
    if isinstance(batch, (tuple, list)):
        return module(torch_compat.map_tensors(torch.clone, batch[0]))
    return module(**torch_compat.map_tensors(torch.clone, batch))


def probe_output(module: nn.Module, batch: Any) -> Tensor:
    """The module's output tensor for ``batch``: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets) pair, or
    ``forward(**dict)``. Of an output that is not one tensor: its floating ``logits``, else its first floating tensor
    that is not one of the batch's own handed back.

    No logits (a UNet's ``.sample``, an encoder's ``last_hidden_state``, a dict of features; as
    ``ModelOutput.to_tuple()[0]``): floating, because an integer tensor first (a prediction's ``argmax`` beside the
    logits) was measured, and the 4-bit conv plan widened layers to keep class indices equal; not the batch's, because
    a forward returning ``(x, features)`` was measured on its input, the same whatever the quantization (cosine 1.0:
    every convolution kept in the base mode); not a 0-dim one while there is another, because ``(loss, logits)`` was
    measured on the loss, whose cosine is 1.0 (the cosine of one value is its sign).

    One way, in this function: the forward on a copy of the batch, then the batch's own tensors, then the pick (a helper
    of this module called after the copy sent the quantization's walk back and forth between here and ``_compat.torch``).
    """
    check_forward(module, "lightning_hbm")  # QuantizationQuality checks at setup; the plugin's probes land here
    out = forward_on(module, batch)
    if isinstance(out, Tensor):
        logits: Any = out
    else:
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if not (isinstance(logits, Tensor) and logits.is_floating_point()):
            values = out.to_tuple() if hasattr(out, "to_tuple") else list(out.values()) if isinstance(out, Mapping) else out
            given = torch_compat.tensor_leaves(batch)

            def echoed(t: Tensor) -> bool:
                return any(t.shape == b.shape and t.dtype == b.dtype and t.device == b.device and torch.equal(t, b) for b in given)

            found = [t for t in tree_flatten(values)[0] if isinstance(t, Tensor) and t.is_floating_point() and not echoed(t)]
            logits = next((t for t in found if t.dim() > 0), found[0] if found else None)
    if not (isinstance(logits, Tensor) and logits.is_floating_point()):
        got = f"a {logits.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"QuantizationQuality needs the model's forward to return a floating tensor (or an object with a `logits` "
            f"tensor, or any floating tensor other than its input), got {got}. Make forward return the output tensor "
            "for the probe batch."
        )
    return logits


def input_absmax(module: nn.Module, layers: Mapping[str, nn.Module], batch: Any) -> tuple[dict[str, Tensor], Tensor]:
    """Per-channel ``max|x|`` (float32) of the input of each of ``layers`` over one forward of ``batch`` (all its
    calls), and the module's output (:func:`probe_output`, as float32). A layer the forward never calls is absent."""
    absmax: dict[str, Tensor] = {}

    def record(name: str) -> Any:
        def hook(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            seen = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

        return hook

    handles = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    try:
        output = probe_output(module, batch).float()
    finally:
        for handle in handles:
            handle.remove()
    return absmax, output


#: a value as built at most this (``-1e9``, ``-1e30``, ``torch.finfo(torch.float32).min``) is a mask (no probability
#: after a softmax), and so is a value computed at most :data:`MASK_AS_COMPUTED` (or the computing dtype's lowest, -inf)
#: where the model as built has one
MASK_VALUE = -1e9
#: :data:`MASK_VALUE` as a computing dtype may round it: bfloat16 (8 significant bits) gives ``-1e9`` as
#: ``-998,244,352``, above ``-1e9`` (was read as no mask, and the mask then dominated the figures: ~1.0 for a model
#: whose every other output was wrong, session 30); the 1 in 128 allowed is twice bfloat16's rounding
MASK_AS_COMPUTED = MASK_VALUE * (1 - 2**-7)


def compare_outputs(output: Tensor, reference: Tensor, lm: bool) -> dict[str, float]:
    """The metrics logged by :class:`QuantizationQuality` (and optimized by the sensitivity-aware plan).

    Cosine similarity per output row (per token for a language model, per sample otherwise),
    root relative squared error over all outputs, and for a language model ``KL(p_fp || p_q)``.
    """
    limit = torch.finfo(output.dtype).max if output.is_floating_point() else float("inf")  # its dtype's range
    output, reference = output.float(), reference.float()
    width = reference.shape[-1] if reference.dim() >= 2 else reference.numel()
    # an inf both give (a head that masks classes with -inf) agrees: left in, every row holding one measured NaN, and
    # the conv plan was chosen on NaN (planned 'to a probe output cosine of nan')
    same = ~reference.isfinite() & (output == reference)
    # a mask of torch.finfo(dtype).min both give (bfloat16 rounds float32's to -inf): its square overflows float32, every
    # row holding one measured NaN (identical outputs read cosine NaN); agrees like an inf both give
    huge = 2.0**63
    same |= (reference.abs() > huge) & (output.abs() > huge) & (reference.sign() == output.sign())
    # a mask (at most -1e9 as built) that the output gives as a mask in its own dtype (-1e9 as that dtype rounds it, or
    # that dtype's lowest: -inf, float16's -65504 from torch.finfo(dtype).min): the same mask; was cosine NaN, relative error inf
    # (session 29). Not an overflowing value of the output's own (-1e5 or +1e5 as built): those stay NaN and inf
    same |= (reference <= MASK_VALUE) & (output <= max(MASK_AS_COMPUTED, -limit))
    measured, wanted = (output.masked_fill(same, 0.0), reference.masked_fill(same, 0.0)) if bool(same.any()) else (output, reference)
    rows = ~same.reshape(-1, width).all(-1)  # a row both mask whole (-inf everywhere) has no direction: left out
    metrics = {
        PREFIX + "cosine_similarity": float(CosineSimilarity(reduction="mean")(measured.reshape(-1, width)[rows], wanted.reshape(-1, width)[rows])),
        PREFIX + "relative_error": float(RelativeSquaredError(squared=False)(measured.flatten(), wanted.flatten())),
    }
    if lm:
        metrics[PREFIX + "kl_divergence"] = _kl_divergence(output.reshape(-1, width), reference.reshape(-1, width))
    return metrics


def _kl_divergence(output: Tensor, reference: Tensor) -> float:
    """Mean over rows of ``KL(p || q)``, ``p`` the softmax of ``reference`` (the full-precision model's logits), ``q``
    of ``output``: torchmetrics ``KLDivergence``'s figure, with masked entries handled.

    A token the reference gives no mass (``-inf`` logit: a masked vocabulary entry; or a probability that underflows to
    0 in float32: a mask of ``-1e9`` or ``torch.finfo(torch.float32).min``, which float16 or bfloat16 round to
    ``-inf``) adds 0, whatever ``output`` gives it (torchmetrics: ``0 * (-inf - x)`` = NaN, the whole figure NaN when both models mask the same entries). A token
    the reference gives mass to and ``output`` -inf adds inf: the quantized model rules out what the model as built
    predicts, and the figure says so (with a warning naming how many), not NaN; a row ``output`` masks whole (every
    entry -inf) rules out every token, inf. A row the reference masks whole (every entry -inf: a padded position
    masked entirely) has no distribution to compare with: it is left out of the mean, whatever ``output`` gives it,
    and a warning counts such rows (counting it 0 would lower the mean by the share of such rows; its softmax is NaN,
    which made the whole figure NaN). If every row is left out there is no figure: NaN, with that warning.
    """
    p_log, q_log = reference.float().log_softmax(-1), output.float().log_softmax(-1)
    empty, none_left = reference.eq(float("-inf")).all(-1), output.eq(float("-inf")).all(-1)
    q_log = q_log.masked_fill(none_left.unsqueeze(-1), float("-inf"))  # its softmax is NaN: no mass anywhere
    p_log, q_log = p_log[~empty], q_log[~empty]
    if bool(empty.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence leaves out {int(empty.sum())} of {empty.shape[0]} rows the full-precision "
            f"model masks whole (-inf for every entry: no next-token distribution to compare with; "
            f"{int((empty & none_left).sum())} of them the quantized model masks whole too): the figure is the mean "
            f"over the other {int((~empty).sum())} rows{' (none: NaN)' if bool(empty.all()) else ''}. Probe on rows "
            "the model predicts (no fully masked positions) for a figure over every row.",
            stacklevel=2,
        )
    masked = p_log.exp() == 0  # no mass in float32 (the figure's own p * (log p - log q) is 0 there)
    ruled_out = (q_log == float("-inf")) & ~masked
    terms = (p_log.exp() * (p_log - q_log)).masked_fill(masked, 0.0).masked_fill(ruled_out, float("inf"))
    if bool(ruled_out.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence is inf: the quantized model gives -inf (no probability) to "
            f"{int(ruled_out.sum())} token(s) the full-precision model gives probability to, in "
            f"{int(ruled_out.any(-1).sum())} of {ruled_out.shape[0]} rows (the quantized logits overflowed, or mask "
            f"differently): compare the two models' masks, or quantize fewer layers (skip=...).",
            stacklevel=2,
        )
    return float(terms.sum(-1).mean()) if terms.shape[0] else float("nan")


@contextmanager
def eval_no_grad(module: nn.Module) -> Generator[None, None, None]:
    # Dropout would make the probe outputs random; the same eval forward is used on both sides.
    # Each module's own flag is put back (not module.train(flag) on the root, which would also switch on the
    # submodules the user froze in eval mode, e.g. a frozen encoder whose BatchNorm statistics must not move).
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


@dataclass
class Probe:
    """A model and its probe batch, as the measurements of one quantization run them: built once by their owner
    (``Quantization._measure``, ``choose_layer_modes``) and handed down, so that each measurement (the smoothing, its
    candidates' errors, the swapped-in outputs of the plans) asks it for a forward instead of taking the model and
    the batch apart again. Each method is the function of this module of the same name on :attr:`module` and
    :attr:`batch`."""

    module: nn.Module
    batch: Any

    def eval_no_grad(self) -> AbstractContextManager[None]:
        """:func:`eval_no_grad` of the model."""
        return eval_no_grad(self.module)

    def output(self) -> Tensor:
        """:func:`probe_output`: the model's output tensor on the batch."""
        return probe_output(self.module, self.batch)

    def forward(self) -> Any:
        """:func:`forward_on`: the model's output on (a copy of) the batch, as it returns it."""
        return forward_on(self.module, self.batch)

    def input_absmax(self, layers: Mapping[str, nn.Module]) -> tuple[dict[str, Tensor], Tensor]:
        """:func:`input_absmax` of ``layers`` over one forward, and the output."""
        return input_absmax(self.module, layers, self.batch)

    def recording_calls(self, names: Optional[Collection[str]] = None, keep: int = 0) -> AbstractContextManager[list["Call"]]:
        """:func:`recording_calls` of the model's submodules ``names``."""
        return recording_calls(self.module, names, keep)


@dataclass
class Call:
    """One call of a submodule during a forward: its floating outputs' shapes and (``keep`` > 0) an evenly strided
    subset of at most ``keep`` of their values, flattened, in fp32 on the host."""

    #: the module's name (``""``: the root) and how many times it had been called before in this forward
    key: tuple[str, int]
    #: the call it ran inside (``None``: the root's)
    parent: Optional[tuple[str, int]]
    shapes: tuple[tuple[int, ...], ...]
    values: Optional[Tensor] = None


def call_values(output: Any, keep: int) -> Tensor:
    """Every floating tensor of ``output``, flattened and joined, every k-th value (the fewest k leaving at most
    ``keep``), in fp32 on the host: two outputs of the same shapes keep the same positions."""
    leaves = [t.detach().flatten() for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    step = max(-(-sum(t.numel() for t in leaves) // max(keep, 1)), 1)
    return torch.cat([t[::step].float().cpu() for t in leaves]) if leaves else torch.zeros(0)


@contextmanager
def recording_calls(module: nn.Module, names: Optional[Collection[str]] = None, keep: int = 0) -> Generator[list[Call], None, None]:
    """The calls of ``module``'s submodules (``names``: only those; default all, the root included) during the
    forwards inside, in the order they returned (a parent after its children), each a :class:`Call`."""
    calls: list[Call] = []
    stack: list[tuple[str, int]] = []
    counts: Counter[str] = Counter()

    def enter(name: str) -> Any:
        def push(layer: nn.Module, args: tuple) -> None:
            stack.append((name, counts[name]))
            counts[name] += 1

        return push

    def leave(layer: nn.Module, args: tuple, output: Any) -> None:
        key = stack.pop()
        leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
        values = call_values(leaves, keep) if keep and leaves else None
        calls.append(Call(key, stack[-1] if stack else None, tuple(tuple(t.shape) for t in leaves), values))

    chosen = [(name, layer) for name, layer in module.named_modules() if names is None or name in names]
    handles = [h for name, layer in chosen for h in (layer.register_forward_pre_hook(enter(name)), layer.register_forward_hook(leave))]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


#: max pooling that gives the position of each maximum (``return_indices=True``): a SegNet's decoder puts its values
#: back there (``max_unpool2d``); a near-tie in a window (bfloat16, a quantized convolution before) moves a value to
#: another pixel, and the output compared pixel by pixel read that as the quantization's loss (a small SegNet in int8:
#: 0.9955 against 0.9998 with the same convolutions and upsampling instead, session 29). Followed once taken, as
#: :data:`INDEXED` (the pooled values stay this forward's own), and recorded only where a forward can follow them (a
#: budget to keep them, or a forward to follow): the sensitivity plan, which does not follow, measured only before the
#: first pool where the indices moved, and chose 4-bit for every convolution after it
POOLED = frozenset({f"{kind}max_pool{n}d_with_indices" for kind in ("", "adaptive_", "fractional_") for n in (1, 2, 3)})
#: the ops whose result depends on the order or the size of values (data-dependent selection: a detector's
#: post-processing sorts, keeps the top-k, thresholds, suppresses): what comes after one that selects otherwise holds
#: other elements, or the same ones in another order, and is not compared element by element (issue 53, session 27)
SELECTING = frozenset({"sort", "argsort", "msort", "topk", "nonzero", "argwhere", "masked_select", "argmax", "argmin",
                       "unique", "unique_consecutive", "nms", "batched_nms", *("max", "min", "kthvalue", "mode", "median",
                       "nanmedian", "cummax", "cummin", "where"), *POOLED})
#: of :data:`SELECTING`, the ops that select only in some forms: ``max``/``min`` and the others giving ``(values,
#: indices)`` along a dimension (``scores.max(-1)``: the labels, as ``argmax``; not a full reduction nor an elementwise
#: maximum), ``where`` given the condition alone (``nonzero``'s indices; not ``where(mask, a, b)``)
INDEXED = frozenset({"max", "min", "kthvalue", "mode", "median", "nanmedian", "cummax", "cummin", *POOLED})
#: ops that select by a boolean mask among their arguments (``boxes[scores > 0.5]``)
MASKING = frozenset({"__getitem__", "index", "masked_select"})


@dataclass
class Selection:
    """One data-dependent selection during a forward (:data:`SELECTING`): the op, where it ran, what it picked."""

    op: str
    #: how many module calls had returned when it ran (the calls of :func:`recording_calls` before it), and the last
    returned: int
    after: Optional[tuple[str, int]]
    #: what it picked (its integer outputs, or the boolean masks it was given): shapes, a checksum of every value,
    #: and an evenly strided subset of at most 4096 of them, on the host
    shapes: tuple[tuple[int, ...], ...]
    checksum: int
    values: Tensor
    #: the shapes of the tensors it was given, and (recorded with a budget: :func:`recording_selections`) a copy of
    #: every value it picked, on the host: what a forward that follows this one's selections is given instead
    given: tuple[tuple[int, ...], ...] = ()
    route: tuple[Tensor, ...] = ()

    def differs(self, other: Selection) -> Optional[str]:
        """How ``other`` picked otherwise (``None``: the same op picked the same)."""
        if self.op != other.op:
            return f"{other.op} ran where the model as built ran {self.op}"
        if self.shapes != other.shapes:
            return f"{self.op} picked shapes {[list(s) for s in other.shapes]}, {[list(s) for s in self.shapes]} as built"
        unread = not self.values.numel() or not other.values.numel()  # fake or meta tensors: the shapes only
        if unread or (self.checksum == other.checksum and torch.equal(self.values, other.values)):
            return None
        seen = int((self.values != other.values).sum())
        return f"{self.op} picked other elements or another order ({seen} of {self.values.numel()} compared positions differ)"


def _picked(name: str, args: tuple, kwargs: Mapping[str, Any], out: Any) -> list[Tensor]:
    if (name in INDEXED and not isinstance(out, tuple)) or (name == "where" and len(args) + len(kwargs) > 1):
        return []  # a full reduction, an elementwise maximum, a where choosing between two tensors: no selection
    if name in MASKING:  # the masks it selects by (not the tensor indexed: ``suppressed[i]`` of a boolean tensor)
        given = [a for arg in (*args[1:], *kwargs.values()) for a in (arg if isinstance(arg, (tuple, list)) else (arg,))]
        return [t for t in given if isinstance(t, Tensor) and t.dtype == torch.bool]
    return [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and not t.is_floating_point()]


def _given(args: tuple, kwargs: Mapping[str, Any]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for arg in (*args, *kwargs.values()) for t in (arg if isinstance(arg, (tuple, list)) else (arg,)) if isinstance(t, Tensor))


def _swapped(tree: Any, swaps: Mapping[int, Tensor]) -> Any:
    """``tree`` (arguments: a tuple, a dict, their tuples and lists) with the tensors whose id is in ``swaps`` swapped."""
    if isinstance(tree, Tensor):
        return swaps.get(id(tree), tree)
    if isinstance(tree, dict):
        return {k: _swapped(v, swaps) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return type(tree)(_swapped(v, swaps) for v in tree)
    return tree


class _Selections(TorchFunctionMode):
    """Records the selections (:func:`recording_selections`); given those of another forward (``follow``), this one
    picks what that one picked wherever it ran the same op on tensors of the same shapes (:func:`following`)."""

    def __init__(self, calls: list[Call], budget: int = 0, follow: Optional[Sequence[Selection]] = None) -> None:
        super().__init__()
        self.calls, self.budget, self.follow = calls, budget, follow or None
        self.pools = budget > 0 or follow is not None  # pooling indices (:data:`POOLED`) only where they can be followed
        self.seen: list[Selection] = []
        #: id of the indices an :data:`INDEXED` op gave -> (those indices, weakly: unused ones are freed as without the
        #: record; its selection): a selection once an op takes them (``boxes.gather(..., label)``); unused
        #: (PointNet's ``x.max(2)[0]``, a global max pool), none
        self.pending: dict[int, tuple[weakref.ref[Tensor], Selection]] = {}
        #: following: indices of this forward -> those followed instead (every later op taking them), how many
        #: selections picked otherwise and were followed, and why following stopped (``None``: it did not)
        self.swaps: dict[int, tuple[weakref.ref[Tensor], Tensor]] = {}
        self.differed = 0
        self.stopped: Optional[str] = None
        self.first: Optional[tuple[int, str]] = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.pending or self.swaps:
            args, kwargs = self._take(args, kwargs)
        name = getattr(func, "__name__", "").split(".")[0]
        masks = _picked(name, args, kwargs, None) if name in MASKING else []
        if masks:  # the masks are replaced before the op runs: it keeps as many elements as the one followed
            routed = self._route(name, masks, _given(args, kwargs))
            if routed is not None:
                swaps = {id(a): b for a, b in zip(masks, routed)}
                args, kwargs, masks = _swapped(args, swaps), _swapped(kwargs, swaps), list(routed)
            self._record(name, masks, args, kwargs)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        found = _picked(name, args, kwargs, out) if name in SELECTING and (self.pools or name not in POOLED) else []
        if found and name in INDEXED:  # a selection once its indices are taken: followed then (:meth:`_take`)
            self.pending[id(found[0])] = (weakref.ref(found[0]), self._selection(name, found, args, kwargs))
        elif found:
            routed = self._route(name, found, _given(args, kwargs), out)
            if routed is not None:
                out, found = _rebuilt(name, out, routed, args, kwargs), list(routed)
            self._record(name, found, args, kwargs)
        return out

    def _selection(self, name: str, found: Sequence[Tensor], args: tuple, kwargs: Mapping[str, Any]) -> Selection:
        picked = [t.detach() for t in found]
        after = self.calls[-1].key if self.calls else None
        route: tuple[Tensor, ...] = ()
        size = sum(t.numel() * t.element_size() for t in picked)
        if self.budget >= size and not any(torch_compat.is_fake(t) or t.is_meta for t in picked):
            self.budget -= size
            route = tuple(t.cpu().clone() for t in picked)
        shapes = tuple(tuple(t.shape) for t in picked)
        return Selection(name.strip("_"), len(self.calls), after, shapes, *_fingerprint(picked), _given(args, kwargs), route)

    def _record(self, name: str, found: Sequence[Tensor], args: tuple, kwargs: Mapping[str, Any]) -> None:
        self.seen.append(self._selection(name, found, args, kwargs))

    def _route(self, name: str, found: Sequence[Tensor], given: tuple, out: Any = None) -> Optional[tuple[Tensor, ...]]:
        """What the forward followed picked at this selection (the next), on ``found``'s devices, when this forward
        picks otherwise and it can be given instead; else ``None`` (the same picks, or following stopped here)."""
        if self.follow is None or self.stopped is not None:
            return None
        want = self.follow[len(self.seen)] if len(self.seen) < len(self.follow) else None
        shapes = tuple(tuple(t.shape) for t in found)
        same = want is not None and want.op == name.strip("_") and want.shapes == shapes
        if same and want is not None and (all(torch.equal(a.cpu(), b) for a, b in zip(found, want.route)) if want.route else want.differs(
                Selection(want.op, 0, None, shapes, *_fingerprint(found))) is None):  # fmt: skip
            return None
        floating = any(t.is_floating_point() for t in tree_flatten(out)[0] if isinstance(t, Tensor)) and name not in ("sort", "topk")
        if want is None or not want.route or want.op != name.strip("_") or want.given != given or (floating and not same):
            self.stopped = f"{name.strip('_')} (selection {len(self.seen) + 1}) " + ("ran where the forward followed ran none" if want is None else
                           "could not be given the picks followed (another op, other shapes or none kept)")  # fmt: skip
            return None
        self.differed += 1
        if self.first is None:  # where the two forwards' routes first part (as :func:`diverging` says it)
            how = want.differs(Selection(want.op, 0, None, shapes, *_fingerprint(found))) or f"{want.op} picked otherwise"
            after = f" after {want.after[0]!r}" if want.after and want.after[0] else " before any module returned"
            self.first = (min(want.returned, len(self.calls)), how + f" (its selection{after})")
        # copies: a forward that changes its picks in place (``idx += offset``) changed the record on the host (the
        # same tensor there), and a second forward following it was given those (an index out of bounds; session 29)
        return tuple(b.to(a.device, copy=True) for a, b in zip(found, want.route))

    def _take(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The pending selections whose indices this op takes become selections, in the order they are taken;
        following, the indices followed are given instead (here and to every later op taking them)."""
        swaps: dict[int, Tensor] = {}
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (tuple, list)) else (arg,):
                if not isinstance(t, Tensor):
                    continue
                swap = self.swaps.get(id(t))
                if swap is not None and swap[0]() is t:
                    swaps[id(t)] = swap[1]
                entry = self.pending.get(id(t))
                if entry is not None and entry[0]() is t:
                    selection = self.pending.pop(id(t))[1]
                    routed = self._route(selection.op, [t], selection.given, (t,))
                    if routed is not None:
                        checksum, values = _fingerprint(routed)
                        swaps[id(t)], selection = routed[0], replace(selection, checksum=checksum, values=values)
                        self.swaps[id(t)] = (weakref.ref(t), routed[0])
                    self.seen.append(selection)
        return (_swapped(args, swaps), _swapped(kwargs, swaps)) if swaps else (args, kwargs)


def _rebuilt(name: str, out: Any, routed: Sequence[Tensor], args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """``out`` of a selecting op with its integer outputs replaced by ``routed``; a sort's or top-k's values are those
    of its input at the indices given (the values the forward followed picked, as this forward computes them)."""
    if isinstance(out, Tensor):
        return routed[0]
    given = iter(routed)
    items = [next(given) if isinstance(t, Tensor) and not t.is_floating_point() else t for t in out]
    if name in ("sort", "topk") and len(items) == 2:
        dim = kwargs.get("dim", args[2 if name == "topk" else 1] if len(args) > (2 if name == "topk" else 1) else -1)
        dim = dim if isinstance(dim, int) and not isinstance(dim, bool) else -1
        items[0] = args[0].gather(dim, items[1])
    return type(out)(items)


def _fingerprint(picked: Sequence[Tensor]) -> tuple[int, Tensor]:
    """A checksum of every value picked and an evenly strided subset of at most 4096; values that cannot be read
    (fake or meta tensors: the planner's trace) give none: compared by their shapes only."""
    try:
        flat = torch.cat([t.flatten().long() for t in picked])
        weights = torch.arange(1, flat.numel() + 1, device=flat.device) % 1000003
        return int((flat * weights).sum()), flat[:: max(-(-flat.numel() // 4096), 1)].cpu()
    except RuntimeError:  # a fake tensor's data-dependent output, a meta tensor's copy (NotImplementedError): subclasses
        return 0, torch.zeros(0, dtype=torch.long)


@contextmanager
def recording_selections(calls: list[Call], budget: int = 0) -> Generator[list[Selection], None, None]:
    """The data-dependent selections (:data:`SELECTING`, boolean masks) of the forwards inside, in order, each with
    how many of ``calls`` (filled by :func:`recording_calls`) had returned when it ran; with a ``budget`` (bytes), a
    copy of what each picked (:attr:`Selection.route`) while the copies fit in it: a later forward can follow them."""
    with _Selections(calls, budget) as mode:
        yield mode.seen


@dataclass
class Followed:
    """What a forward that followed another's selections (:func:`following`) picked: its selections (as followed), how
    many picked otherwise and were given the other forward's picks instead, and why following stopped, if it did (the
    selections from there are its own: compared as :func:`diverging` says)."""

    selections: list[Selection]
    differed: int = 0
    stopped: Optional[str] = None
    #: the first selection followed: how many module calls had returned before it, and how it picked otherwise
    first: Optional[tuple[int, str]] = None


@contextmanager
def following(calls: list[Call], follow: Sequence[Selection]) -> Generator[Followed, None, None]:
    """The forwards inside pick what the forward that recorded ``follow`` (with a budget: :func:`recording_selections`)
    picked at each of its selections, in order, wherever one picks otherwise: a sort's or top-k's indices (its values
    those of this forward's input there), an argmax's, a max's indices once taken, a boolean mask (as many elements
    kept), NMS's, nonzero's. The two then take the same routes (a kNN graph, experts, boxes), and their outputs compare
    element by element. Where the op, the shapes given or (values besides) the shapes picked differ, or no copy was
    kept, following stops: from there this forward picks its own (today's comparison before that selection)."""
    with _Selections(calls, follow=follow) as mode:
        followed = Followed(mode.seen)
        try:
            yield followed
        finally:
            followed.differed, followed.stopped, followed.first = mode.differed, mode.stopped, mode.first


def recorded_forward(
    module: nn.Module, args: tuple, kwargs: Mapping[str, Any], names: Optional[Collection[str]], keep: int, follow: Sequence[Selection] = ()
) -> tuple[Any, list[Call], Followed]:
    """``module(*args, **kwargs)`` in eval mode without grad (:func:`eval_no_grad`), with the calls of its submodules
    ``names`` (:func:`recording_calls`, ``keep`` values each) and its data-dependent selections
    (:func:`recording_selections`), following those of ``follow`` (:func:`following`; none: its own): the output, the
    calls, the selections, in one pass."""
    with eval_no_grad(module), recording_calls(module, names, keep) as calls, following(calls, follow) as followed:
        return module(*args, **kwargs), calls, followed


def diverging(reference: Sequence[Selection], got: Sequence[Selection]) -> Optional[tuple[int, str]]:
    """Where a forward first selects otherwise than the reference: how many module calls had returned before (the
    calls to compare are those) and how, naming the module it ran after; ``None``: every selection picked the same."""
    for want, have in zip(reference, got):
        how = want.differs(have)
        if how is not None:
            after = f" after {want.after[0]!r}" if want.after and want.after[0] else " before any module returned"
            return min(want.returned, have.returned), how + f" (its selection{after})"
    if len(reference) != len(got):
        extra = (reference if len(reference) > len(got) else got)[min(len(reference), len(got))]
        return extra.returned, f"{extra.op}: one forward ran {len(got)} selections, the model as built {len(reference)}"
    return None


def agreeing_calls(reference: Sequence[Call], got: Sequence[Call]) -> list[tuple[Call, Call]]:
    """Where two forwards of one model still compute the same things: the calls of the longest common prefix of the
    two call sequences (same module, same floating output shapes, in the same order) that no call of that prefix ran
    inside (the outermost: a parent returns after its children), as ``(reference call, its counterpart)``.

    Everything after the first call whose outputs changed shape (post-processing that keeps a score-dependent number
    of boxes, masks or tokens) may depend on that selection and is not compared.
    """
    prefix = 0
    while prefix < min(len(reference), len(got)) and (reference[prefix].key, reference[prefix].shapes) == (got[prefix].key, got[prefix].shapes):
        prefix += 1
    inside = {call.key for call in reference[:prefix] if call.shapes}  # inside a call without floating outputs: its own
    return [(want, got[i]) for i, want in enumerate(reference[:prefix]) if want.parent not in inside and want.shapes]


__all__ = ["INDEXED", "MASKING", "MASK_AS_COMPUTED", "MASK_VALUE", "POOLED", "PREFIX", "SELECTING", "Call", "Followed", "Probe", "Selection", "agreeing_calls", "call_values", "check_forward", "compare_outputs", "diverging", "eval_no_grad", "first_batch", "first_batches", "following", "forward_on",
           "has_forward", "input_absmax", "probe_output", "recorded_forward", "recording_calls", "recording_selections"]
