"""Block inputs remade in the backward instead of kept: ``ActivationCheckpointing(regenerate=n)``.

Under full recompute a checkpointed block keeps only its input, from its forward to its backward: one hidden-size
tensor per block (8 KiB per token at the 8B Llama's width, 32 of them). Offloaded, those inputs fill the host's pinned
memory (256 KiB per token at the 8B: 64 GiB at 262,144 tokens). Here only every ``n``-th block keeps its input; the
``n - 1`` blocks after it keep nothing, and the backward of each remakes its input when it needs it, by running the
blocks before it forward again from the kept input (the kept input restored from wherever it is: the host or the
device). The host then holds ``1/n`` of the inputs, the device no more than before: the remade input is used at once,
in place of the one that would have been restored.

What it costs: the forward of ``n(n-1)/2`` blocks per ``n`` again in the backward, ``(n-1)/2`` more block forwards per
block (a step of full recompute runs about four block forwards' worth per block: ~+12 % for ``n=2``, ~+25 % for ``n=3``,
not measured on a GPU). The remade input is the forward's, bit for bit: the block runs as in its forward (gradients on,
nothing saved, the forward's RNG states and the buffers it read as they were, LoRA's forward order), so the gradients
are those of plain checkpointing (``tests/activations/test_regenerate.py``).

Which block remakes which input is decided by data flow, on every forward: a block's input is remade only when it is
exactly the output of the checkpointed block called just before it, as that block returned it (unchanged since), and
it is then one link further down that chain (the chain's blocks 0, n, 2n, ... keep their inputs). Module order plays no
part: a diffusers UNet calls its blocks in another order than it registers them, and most of its blocks are fed
something else (a downsampler's output, a skip connection concatenated), so they start a chain of their own and keep
their input, as without ``regenerate``; the callback warns after the step, naming each with the bytes it keeps, the
block called before it, and the blocks remade. A block called with that output as a keyword (``block(hidden_states=h)``)
is linked the same way: the keyword tensor goes through the checkpoint as a positional one (a keyword tensor checkpoint
never saves through the saved-tensor hooks: it is held by its closure, neither remade nor offloaded).

Under ``QuantizedFSDPStrategy`` (FSDP2) each block is a unit, and FSDP2 hands a unit its input through an autograd
function of its own (``RegisterPostBackwardFunction``): another tensor of the same data. A block's input is linked
through it (session 37; before, no input was remade under FSDP2), and the block run again in the backward is gathered
first (``FSDPModule.unshard()``; already gathered by FSDP2's backward prefetch, or resharded after). On 2 gloo ranks the
trained weights are those of ``regenerate=1`` bit for bit and the rank's peak is lower by the inputs not kept
(``tests/strategies/test_fsdp_sequential_blocks_s35.py``). A block fed across a unit boundary by a block that is no
unit of its own (``shard_modules`` naming a module of two blocks) keeps such an input and starts a new chain: said at
fit start, once the units exist (:func:`unit_crossings`, session 38), with how many inputs are kept; blocks inside one
unit (one around them all) feed each other directly and are linked.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.replay import ForwardState
from lightning_hbm.adapters.lora.order import recomputing

_RECORD = "lightning_hbm.regenerate"  # the key of a block output's grad_fn metadata holding its forward's record


class Remade:
    """Counts of one callback's remade inputs since the last :meth:`reset`, and what each block did with its input.

    ``made``: the blocks whose input is remade, with its bytes; ``kept``: the blocks keeping theirs as every n-th link
    of a chain (its first one: the first block called, fed by the embedding); ``unmatched``: the blocks keeping theirs
    because it is not the output of the checkpointed block called just before them, with its bytes and that block's
    name. Blocks by name, in the order they were first called."""

    def __init__(self, regenerate: int) -> None:
        self.regenerate = regenerate
        self.inputs = 0
        self.made: dict[str, int] = {}
        self.kept: dict[str, int] = {}
        self.unmatched: dict[str, tuple[int, str]] = {}
        self.last: Optional[weakref.ref[Record]] = None  # the record of the checkpointed block called last (weak)
        #: this step's calls of each block: a block called again (weights shared: ALBERT's one layer) is noted as
        #: ``name (call k)``; under one name, its later call that remade its input took away the note that an
        #: earlier one kept it, unmatched, and the warning naming it was never said (session 29)
        self.calls: dict[str, int] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "last": None, "calls": {}}  # a step's record belongs to that step's graph

    def reset(self) -> None:
        self.inputs = 0
        self.last = None  # a new step: the first block called starts a chain
        self.calls = {}

    def link(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Link:
        """This forward of block ``name``, linked to the checkpointed block called just before it if one of its inputs
        (positional or keyword) is exactly that block's output, unchanged; what it does with its input, noted."""
        previous = self.last() if self.last is not None else None
        # no block called before in this graph (a step without reset(): a loop of plain torch), or a graph kept from
        # step to step by the caller: the notes do not grow without end
        if previous is None or len(self.made) + len(self.kept) + len(self.unmatched) > 4096:
            self.calls = {}
        self.last = None
        link = Link(previous, self.regenerate, args, kwargs)
        called = self.calls[name] = self.calls.get(name, 0) + 1
        name = name if called == 1 else f"{name} (call {called})"
        for seen in (self.made, self.kept, self.unmatched):
            seen.pop(name, None)  # what it did on its last forward
        if link.source is not None:
            self.made[name] = link.nbytes
        elif link.position or previous is None or not _made_by_a_block((*args, *kwargs.values())):
            self.kept[name] = link.nbytes  # a chain's start (a second forward of the model in the step included)
        else:
            self.unmatched[name] = (link.nbytes, previous.name)
        return link


def _made_by_a_block(fed: tuple[Any, ...], most: int = 256) -> bool:
    """Whether a tensor of ``fed`` was computed from a checkpointed block's output in this graph (a node holding a
    :class:`Record` within ``most`` nodes of its autograd graph): a block fed something else than the output of the
    block called before it (a downsampler's output, a skip connection) is named; one fed by the input (the first block
    of a second forward of the model in the step: a contrastive pair, DPO's chosen and rejected answers) starts a chain
    as the first forward's does (was: named "unmatched", warned to use regenerate=1, session 30). A graph larger than
    ``most`` nodes is not looked through: named, as before."""
    todo: list[Any] = [t.grad_fn for t in fed if isinstance(t, Tensor) and t.grad_fn is not None]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if len(seen) >= most:
            return True
        seen.add(node)
        if _RECORD in cast(dict[str, Any], node.metadata):
            return True
        todo.extend(following for following, _ in node.next_functions)
    return False


class Link:
    """One forward of a block under ``regenerate=n``: ``position``: its link in the chain of blocks each fed the output
    of the one called before it (0: it starts one); ``source``: the record whose forward remakes its input (None: it
    keeps its input); ``args``/``kwargs``: what the checkpoint gets, the keyword tensors that are ``previous``'s output
    (``names``) moved to the end of the positional arguments, where the checkpoint saves them through the hooks."""

    def __init__(self, previous: Optional[Record], regenerate: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fed = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        given = [t for t in fed if previous is not None and previous.gave(t)]
        self.position = previous.position + 1 if previous is not None and given else 0
        self.source = previous if self.position % regenerate else None
        self.names = tuple(k for k, v in kwargs.items() if any(v is t for t in given))
        self.args = (*args, *(kwargs[k] for k in self.names))
        self.kwargs = {k: v for k, v in kwargs.items() if k not in self.names}
        self.nbytes = sum(t.numel() * t.element_size() for t in given) or max((t.numel() * t.element_size() for t in fed), default=0)

    def call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` called with the flat ``args``: the moved keyword tensors given back their names."""
        return functools.partial(_with_keywords, fn, self.names) if self.names else fn


def _with_keywords(fn: Callable[..., Any], names: tuple[str, ...], *args: Any, **kwargs: Any) -> Any:
    head = len(args) - len(names)
    return fn(*args[:head], **kwargs, **dict(zip(names, args[head:])))


def size(nbytes: int) -> str:
    """``2.00 KiB``: the largest binary unit that keeps the number at 1 or more."""
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes} B"


class Record:
    """One forward of a checkpointed block under ``regenerate=n``: how to run it again, for the block called next if
    that block remakes its input from it (every block records: which block is called next is known only then).

    ``saved``: the position of each tensor argument and what the checkpoint saved for it (an offload handle, the
    tensor itself on the device, or a :class:`Remake` of its own input), held weakly: the checkpoint holds it until
    this block's backward, which runs after the backward of the block it feeds (that block's output gradient comes
    first), so it is there when that block remakes its input (held strongly, by a record that lives as long as the
    step's graph, a kept input outlived its block's backward); ``output``: the tensor the next block gets."""

    def __init__(self, block: nn.Module, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 state: ForwardState, unpack: Callable[[Any], Tensor], name: str = "", position: int = 0,
                 counts: Optional[Remade] = None) -> None:
        self.block, self.inner, self.kwargs, self.state, self.unpack = block, inner, kwargs, state, unpack
        self.name, self.position = name, position  # the block's name; its link in the chain (:class:`Link`)
        self.counts = counts  # whose ``last`` this record becomes when its forward returns (None: no one's)
        self.args: list[Any] = list(args)
        self.saved: dict[int, Callable[[], Any]] = {}
        #: the global RNG states the forward starts from, which its remake draws as (dropout's masks): only where the
        #: block called next may remake its input from this record, its link in the chain not being one before a
        #: multiple of n (:class:`Link`; the chain's arithmetic, whatever the blocks do). Python's and NumPy's states
        #: are most of a snapshot's cost (~60 us of ~100 on the CPU dev machine, benchmarks/regenerate_rng_cost.py)
        feeds = counts is None or (position + 1) % counts.regenerate != 0
        self.rng = torch_compat.rng_states() if feeds else None
        #: the forward's autocast (a bf16-mixed run's ``torch.autocast``), which the backward, where the input is
        #: remade, runs outside of: per device type of its tensors (and the CPU's), whether on and to which dtype
        types = dict.fromkeys(["cpu", *(a.device.type for a in (*args, *kwargs.values()) if isinstance(a, Tensor))])
        types = {t: None for t in types if torch.amp.is_autocast_available(t)}  # not "meta" (the planner's tensors)
        self.autocast = [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]
        self.output: Optional[weakref.ref[Tensor]] = None
        self.version = 0  # the output's version counter as returned: changed in place since, it is not what remake makes
        self.first = False  # the output is the first element of a tuple the block returned

    def keep(self, tensor: Tensor, packed: Any) -> None:
        for index, arg in enumerate(self.args):
            if arg is tensor:
                self.saved[index] = weakref.ref(packed)  # a tensor, an offload handle or a Remake
                self.args[index] = None  # held by the checkpoint until this block's backward, not by the record

    def returned(self, out: Any) -> None:
        """The forward returned ``out``: its output noted, and this record the last one of ``counts``."""
        if self.counts is not None:
            self.counts.last = weakref.ref(self)
        first = out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor) else out
        self.first = first is not out
        self.output = weakref.ref(first) if isinstance(first, Tensor) else None
        self.version = first._version if isinstance(first, Tensor) else 0
        if isinstance(first, Tensor) and first.grad_fn is not None:
            # the record lives as long as that output's graph (the block's plan holds it weakly); none: no backward
            # reaches it, nothing to remake. On the node, not the tensor: a tensor's attribute is pickled with it
            cast(dict[str, Any], first.grad_fn.metadata)[_RECORD] = self  # a dict (typed as a method in torch's stubs)

    def gave(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is the output this forward returned, unchanged since (a forward hook or the model's code
        that scales it in place, ``x.mul_(0.5)`` between blocks, leaves it another input than the remade one)."""
        output = self.output() if self.output is not None else None
        if output is None or output._version != self.version:
            return False
        # under FSDP2 the block fed gets it through its unit's pre-forward function: the same data, another tensor;
        # linked so only where this block is a unit of its own, which remake() gathers (a block inside a larger unit
        # keeps its input, named after the step)
        return output is tensor or (torch_compat.is_fsdp_unit(self.block) and torch_compat.passed_through_fsdp(tensor, output))


class Remake:
    """What a block's checkpoint saves for its input when that input is remade: the forward before it, to run again."""

    def __init__(self, source: Record, counts: Remade) -> None:
        self.source, self.counts = source, counts


def _drop(_tensor: Tensor) -> None:
    return None


def _never(_packed: Any) -> Tensor:
    raise RuntimeError("lightning_hbm: a remade block input's forward saved a tensor a backward then asked for")


def remake(packed: Remake) -> Tensor:
    """The input ``packed`` stands for: its source block's forward run again from that block's own saved inputs."""
    source = packed.source
    args = list(source.args)
    for index, held in source.saved.items():
        saved = held()
        if saved is None:
            raise RuntimeError(
                f"lightning_hbm: regenerate: the saved input of {source.name} was freed (its backward ran) before the "
                "block it feeds remade its input from it: a graph where the block fed runs its backward after the "
                "block feeding it. Use ActivationCheckpointing(regenerate=1)."
            )
        args[index] = remake(saved) if isinstance(saved, Remake) else source.unpack(saved)
    # as its forward ran: gradients on (a layer may choose its kernels by it), nothing saved for a backward, the RNG
    # states and the buffers it read as they were, the forward's LoRA order (recomputing(False)) and autocast
    # an FSDP2 unit's forward run outside its __call__: its parameters gathered (the backward prefetch's, if made)
    with torch_compat.drawing_as(source.rng), recomputing(False), source.state.replayed(True), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(_drop, _never), torch_compat.fsdp_gathered(source.block), \
            contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in source.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        out = source.inner(*args, **source.kwargs)
    packed.counts.inputs += 1
    result: Tensor = (out[0] if source.first else out).detach()
    return result


class InputHooks(torch.autograd.graph.saved_tensors_hooks):
    """The saved-tensor hooks around a checkpointed block whose input is remade (``source``: the forward before it) or
    that feeds one (``record``): its input, when it is ``source``'s output, saved as a :class:`Remake`; every other
    tensor through ``base`` (the offload's hooks; None: kept as it is)."""

    def __init__(self, base: Optional[torch.autograd.graph.saved_tensors_hooks], source: Optional[Record],
                 record: Optional[Record], counts: Remade, name: str) -> None:
        self.base, self.source, self.record, self.counts, self.name = base, source, record, counts, name
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> Any:
        if self.source is not None and self.source.gave(tensor):
            packed: Any = Remake(self.source, self.counts)
        else:
            packed = self.base.pack_hook(tensor) if self.base is not None else tensor
        if self.record is not None:
            self.record.keep(tensor, packed)
        return packed

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Remake):
            return remake(packed)
        return self.base.unpack_hook(packed) if self.base is not None else packed

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        # packing is over; the backward unpacks through ``_unpack``, a bound method that keeps this object alive (a
        # cycle: this object holds its own hooks): holding the record here would keep its saved input (an offload
        # handle and the tensor it restored) until Python's cycle collector ran, one block input longer at a point
        # set by the collector's thresholds (the 8B-style plan of 10 blocks, regenerate=2: 512 KiB off the line)
        self.source = self.record = None


class UnitCrossing:
    """A checkpointed block whose input FSDP2 hands over across a unit boundary from a block it cannot remake it from
    (:func:`unit_crossings`): ``name``, the block called before it (``before``), that block's unit (``source_unit``:
    None where it is in none) and the units the input enters on its way (``entered``, outermost first)."""

    def __init__(self, name: str, before: str, source_unit: Optional[str], entered: list[str]) -> None:
        self.name, self.before, self.source_unit, self.entered = name, before, source_unit, entered


def _units_holding(module: nn.Module, name: str) -> list[str]:
    """The FSDP2 units holding the submodule ``name`` of ``module`` (itself included), by name, outermost first."""
    parts = name.split(".") if name else []
    prefixes = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    return [p for p in prefixes if torch_compat.is_fsdp_unit(module.get_submodule(p))]


def unit_crossings(module: nn.Module, names: Sequence[str]) -> list[UnitCrossing]:
    """The checkpointed blocks ``names`` (call order: a stack calls them in module order) whose input ``regenerate``
    cannot remake under FSDP2, known as soon as the units exist (the strategy's setup, before the first step): a
    block entering a unit that does not hold the block before it gets its input through that unit's pre-forward
    function (:func:`~lightning_hbm._compat.torch.passed_through_fsdp`), linked only where it passes one such unit
    and the block before is a unit of its own (the remake gathers it, :meth:`Record.gave`). Blocks inside one unit
    feed each other directly: linked (the unit is gathered through its backward, where the remake runs)."""
    crossings = []
    for before, name in zip(names, names[1:]):
        source = _units_holding(module, before)
        entered = [u for u in _units_holding(module, name) if u not in source]
        if entered and not (len(entered) == 1 and source and source[-1] == before):
            crossings.append(UnitCrossing(name, before, source[-1] if source else None, entered))
    return crossings


def kept_inputs(count: int, regenerate: int, starts: Sequence[int] = ()) -> int:
    """How many of ``count`` chained blocks keep their input under ``regenerate=n`` when a chain starts again at each
    block of ``starts`` (indices: blocks whose input cannot be linked) besides the first: each chain keeps the input
    of its blocks 0, n, 2n, ..."""
    bounds = sorted({0, *starts, count})
    return sum(-(-(end - start) // regenerate) for start, end in zip(bounds, bounds[1:]))


def inner_forward(block: nn.Module, own: Optional[Callable[..., Any]]) -> Callable[..., Any]:
    return own or functools.partial(type(block).forward, block)


__all__ = ["InputHooks", "Link", "Record", "Remade", "Remake", "UnitCrossing", "inner_forward", "kept_inputs", "remake", "size",
           "unit_crossings"]
