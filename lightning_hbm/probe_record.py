"""What a probe forward did: the calls of its submodules and its data-dependent selections, recorded and followed.

:func:`recording_calls` keeps each submodule call (:class:`Call`: its outputs' shapes, some of their values);
:func:`recording_selections` each op that selects by the data (:data:`SELECTING`: a sort, a top-k, a boolean mask,
NMS; :class:`Selection`), and :func:`following` makes a second forward pick what a recorded one picked, so that the two
take the same routes. :func:`diverging` and :func:`agreeing_calls` say where two forwards of one model stop computing
the same things. :mod:`lightning_hbm.probe` runs the forwards (:func:`lightning_hbm.probe.recorded_forward`) and
re-exports every name.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Collection, Generator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_hbm._compat import torch as torch_compat


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


__all__ = ["INDEXED", "MASKING", "POOLED", "SELECTING", "Call", "Followed", "Selection", "agreeing_calls", "call_values",
           "diverging", "following", "recording_calls", "recording_selections"]
