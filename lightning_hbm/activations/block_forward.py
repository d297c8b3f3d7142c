"""A checkpointed block's ``forward``: the mechanism :class:`~lightning_hbm.activations.checkpointing.ActivationCheckpointing`
sets on each block it chose (:func:`wrap`), one block at a time.

The block's ``forward`` is replaced on the instance by a picklable object (:class:`_CheckpointedForward`, not a
closure, not a bound method) holding the block and its setup (:class:`_BlockSetup`); each training forward runs the
block's own forward under non-reentrant ``torch.utils.checkpoint``, inside the offload hooks
(:mod:`~lightning_hbm.activations.offload`) and the regenerate links (:mod:`~lightning_hbm.activations.regenerate`)
when asked, its buffers replayed in the recompute (:mod:`~lightning_hbm.activations.replay`). A block whose first
training forward changes a list or dict it was given runs without checkpoint (:func:`mutated_arguments`).

Not ``checkpoint_wrapper``: a wrapper module prefixes every parameter name with ``_checkpoint_wrapped_module.``, which
changes the state_dict keys and makes peft's adapter state_dict silently empty (checked with peft 0.21). Wrapping
``forward`` keeps names, keys and the module tree exactly as the user built them. Non-reentrant, because the reentrant
variant gives no gradients to adapters behind frozen embeddings (inputs without ``requires_grad``).

A model pickled before session 34 names these classes under :mod:`lightning_hbm.activations.checkpointing`, their
former home: that module keeps them importable by those names.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Optional, Union, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.offload import OffloadSavedTensors
from lightning_hbm.activations.regenerate import InputHooks, Record, Remade, inner_forward
from lightning_hbm.activations.replay import ForwardState
from lightning_hbm.adapters.lora.order import recomputing
from lightning_hbm.record import CheckpointedForward, checkpoint_setup


class _BlockSetup:
    """A block's checkpoint setup: what its wrapped ``forward`` needs, kept in that forward object on the block (no
    closure). Formerly ``_BlockPlan`` ("plan" names the planner's, issue 54): a pickled model holds it by class path
    (``activations.checkpointing`` keeps both names, for models pickled before this class moved here)."""

    def __init__(
        self,
        block: nn.Module,
        context_fn: Optional[Callable[[], tuple[AbstractContextManager, AbstractContextManager]]],
        offload: Optional[OffloadSavedTensors],
        moves: bool = True,
    ) -> None:
        # An instance-level forward someone set before us is kept (and put back by unwrap); otherwise the
        # class's forward is looked up at call time: a bound method stored here would not survive pickling.
        self.own_forward: Optional[Callable[..., Any]] = torch_compat.forward_override(block)
        self.context_fn = context_fn
        self.offload = offload
        #: whether this block's inputs go through ``offload`` (partial offload: the first blocks only); a block that
        #: keeps them on the device still holds ``offload`` to end the previous block's copy in flight
        self.moves = moves
        #: ``regenerate=n``: the callback's counts, which link each forward to the checkpointed block called just
        #: before it (:mod:`lightning_hbm.activations.regenerate`); None: every input kept
        self.counts: Optional[Remade] = None
        self.name = ""
        #: whether the block's keyword tensors were looked at (:func:`_note_keywords`): on its first training forward only
        self.keywords_noted = False
        #: what its first training forward changed in a list or dict it was given (:func:`mutated_arguments`; ``""``:
        #: nothing; ``None``: not looked at yet): such a block runs without checkpoint (session 32)
        self.mutates: Optional[str] = None


class _CheckpointedForward(CheckpointedForward):
    """The block's new ``forward``: a picklable object (not a closure, not a bound method) holding the block and its
    setup, copied with the block; being one marks the block checkpointed (:func:`lightning_hbm.record.checkpoint_setup`,
    read by the coverage table)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpointed_forward(self.block, self.setup, *args, **kwargs)


def wrap(block: nn.Module, setup: _BlockSetup) -> None:
    torch_compat.override_forward(block, _CheckpointedForward(block, setup))


def unwrap(block: nn.Module) -> None:
    setup = cast(_BlockSetup, checkpoint_setup(block))  # called on wrapped blocks only
    torch_compat.override_forward(block, setup.own_forward)  # None: the class's forward again


def _checkpointed_forward(self: nn.Module, setup: _BlockSetup, /, *args: Any, **kwargs: Any) -> Any:
    inner = inner_forward(self, setup.own_forward)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)  # evaluation: nothing is saved, nothing to recompute
    if setup.mutates is None or setup.mutates:
        looked = _looked_at(self, setup, inner, args, kwargs)
        if looked is not None:  # its first training forward, given a list or dict, or a forward that changes one
            return looked[0]
    extra: dict[str, Any] = {} if setup.context_fn is None else {"context_fn": setup.context_fn}
    calls = itertools.count()
    state = ForwardState(self)  # the buffers its forward changes (BatchNorm statistics, spectral_norm's u, v)

    def run(*a: Any, **k: Any) -> Any:
        # the first call is the forward; every later one is checkpoint's recompute, in the backward (lora.order)
        again = next(calls) > 0
        with recomputing(again), state.replayed(again):
            return inner(*a, **k)

    if setup.offload is not None and not setup.moves:
        setup.offload.settle()  # the offloaded blocks are behind: the last one's copy had this whole block to finish
    # The offload hooks are outside the checkpoint: what checkpoint itself saves (the block's
    # inputs) goes through them; what it recomputes never does.
    hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = setup.offload if setup.offload is not None and setup.moves else None
    record, call = None, functools.partial(checkpoint, run)
    if setup.counts is not None:  # regenerate=n: linked to the block called before by data flow (regenerate.Link)
        link = setup.counts.link(setup.name, args, kwargs)
        args, kwargs, call = link.args, link.kwargs, functools.partial(checkpoint, link.call(run))
        unpack = hooks.unpack_hook if hooks is not None else _same
        record = Record(self, link.call(inner), args, kwargs, state, unpack, setup.name, link.position, setup.counts)
        hooks = InputHooks(hooks, link.source, record, setup.counts, setup.name)
    if setup.offload is not None and setup.moves and not setup.keywords_noted:
        setup.keywords_noted = True  # the warning names a block once: its later steps are not looked at again
        _note_keywords(setup.offload, setup.name, args, kwargs)
    with hooks if hooks is not None else nullcontext():
        out = call(*args, use_reentrant=False, **extra, **kwargs)
    if record is not None:
        record.returned(out)  # and the record is the one the next block called links to
    return out


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _containers(args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Union[list, dict]]]:
    named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + [(f"{k!r}", v) for k, v in kwargs.items()]
    return [(name, value) for name, value in named if isinstance(value, (list, dict))]


def _items(container: Union[list, dict]) -> list[tuple[Any, Any]]:
    return list(container.items()) if isinstance(container, dict) else list(enumerate(container))


def _same_item(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str, bool)) and a == b)


def mutated_arguments(before: list[tuple[str, list[tuple[Any, Any]]]], given: list[tuple[str, Union[list, dict]]]) -> str:
    """What a forward changed in the lists and dicts it was given (``before``: their items as it began), or ``""``."""
    said = []
    for (name, old), (_, container) in zip(before, given):
        new = _items(container)
        changed = sum(1 for (k, a), (j, b) in zip(old, new) if k != j or not _same_item(a, b)) + abs(len(new) - len(old))
        if changed:
            what = "dict" if isinstance(container, dict) else "list"
            said.append(f"the {what} given as {name} ({changed} of {max(len(old), len(new))} items replaced, added or removed)")
    return "; ".join(said)


def _looked_at(block: nn.Module, setup: _BlockSetup, inner: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Optional[tuple[Any]]:
    """A block whose forward changes a list or dict it is given (diffusers' Wan VAE: ``feat_cache`` and ``feat_idx``,
    appended to and indexed by a counter the forward moves on) cannot be recomputed: the recompute in backward sees
    other values (Wan: ``IndexError``, or other cached frames). Decided by running: its first training forward given a
    list or dict runs without checkpoint, those compared before and after; changed, the block is never checkpointed,
    warned by name with what changed; unchanged, it is checkpointed from its next call (this one keeps its activations
    once). Returns ``(output,)`` when the block ran here, ``None`` when it is to be checkpointed now."""
    given = _containers(args, kwargs)
    if setup.mutates is None and not given:
        setup.mutates = ""  # nothing it could change: checkpointed as ever
        return None
    if setup.mutates:
        return (inner(*args, **kwargs),)
    before = [(name, _items(container)) for name, container in given]
    out = inner(*args, **kwargs)
    setup.mutates = mutated_arguments(before, given)
    if setup.mutates:
        rank_zero_warn(
            f"lightning_hbm: ActivationCheckpointing leaves {setup.name or type(block).__name__!r} ({type(block).__name__}) "
            f"without checkpoint: its forward changes {setup.mutates}, measured on its first training forward, so a "
            "recompute in backward would run on other values than the forward did (diffusers' AutoencoderKLWan: "
            "IndexError). Its activations are kept, as without checkpointing. Fix: ActivationCheckpointing(blocks=[...]) "
            "naming modules inside it whose forward takes and changes no list or dict."
        )
    return (out,)


def _note_keywords(offload: OffloadSavedTensors, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Note the keyword tensors the offload never sees that are at least as large as the block's largest positional
    tensor (its hidden states passed as ``hidden_states=h``; not a position-id or a small mask beside them)."""
    largest = max((a.numel() * a.element_size() for a in args if isinstance(a, Tensor)), default=0)
    kept = [(k, v.numel() * v.element_size()) for k, v in kwargs.items() if isinstance(v, Tensor) and not isinstance(v, nn.Parameter)]
    kept = [(k, b) for k, b in kept if b and b >= largest]
    if kept:
        offload.keywords_kept[name] = kept
