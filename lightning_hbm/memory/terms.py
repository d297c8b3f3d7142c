"""The memory terms: one registry entry per term, read by the profiler, the planner, the report and the docs.

A term is a named share of training memory. Its entry says who holds it, when in a step it is alive, how it
divides over ranks, and which lightning_hbm feature shrinks it (and the guide that explains the feature). The
profiler's columns and logged keys, the planner's table and per-rank split, the report's advice and the terms
table in ``docs/extending.md`` (:func:`terms_table`) all read :data:`TERMS`, so a term is added in one place.

Three kinds of term, because bytes are counted once:

``category``
    The terms that sum to the device total (:data:`~lightning_hbm.memory.categories.CATEGORIES`). Every
    live device storage belongs to exactly one, by what it *is* (its owner), in registry order.
``scope``
    Bytes created inside a :func:`~lightning_hbm.memory.tracker.memory_scope` of the term's name (``loss``:
    what ``FusedLoss`` allocates). They stay inside the category their owner gives them: reported beside the
    sum, never added to it.
``host``
    Host memory a feature moved off the device (``host_offload``: optimizer states; ``host_activations``: offloaded
    block inputs). Not device memory: beside the sum too.

Each entry also says how the term is *measured* and *advised*, so the consumers iterate the registry instead of
naming terms: a category's ``owns`` (the tensors it owns, :func:`~lightning_hbm.memory.categories.owned_tensors`),
``created_in`` (the tracker phase whose unowned storages it takes: activations) or ``rest`` (what nothing else
takes: other); a scope term is measured by the :func:`~lightning_hbm.memory.tracker.memory_scope` of its name; a
host term's ``host`` reads its bytes from the module and its optimizers; ``advise`` says what shrinks the term once the run
already uses its remedy (:class:`~lightning_hbm.memory.facts.RunFacts`). :func:`register_term` adds a scope or
host term at run time (an extension, a test); the categories are the fixed sum, checked against
:class:`~lightning_hbm.memory.categories.MemoryBreakdown` at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Optional, get_args

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_hbm.memory.facts import RunFacts
from lightning_hbm.memory.owners import buffer_tensors, gradient_tensors, optimizer_state_tensors, parameter_tensors
from lightning_hbm.memory.storage import host_offload_bytes, offloaded_activation_bytes

Kind = Literal["category", "scope", "host"]
#: How a category term is measured by owner: ``owns(module, optimizers)`` -> the tensors that are this term's.
Owner = Callable[[nn.Module, Sequence[Optimizer]], list[torch.Tensor]]
#: How a host term is measured: ``host(module, optimizers)`` -> bytes held off the device.
HostMeasure = Callable[[nn.Module, Sequence[Optimizer]], int]
#: What shrinks a term once the run uses its remedy: ``advise(facts)`` -> advice, or None for the ``remedy``.
Advise = Callable[[RunFacts], Optional[str]]

#: How a term divides over ranks, by rule name (the registry's ``sharding``). ``split`` is what
#: :func:`lightning_hbm.planner.shard_categories` divides by the world size; ``gathered`` gets the all-gathered unit.
SHARDING: dict[str, str] = {
    "split": "split evenly over ranks under FSDP/ZeRO-3 (`QuantizedFSDPStrategy`); whole on every rank under DDP",
    "per-rank": "each rank holds its own micro-batch's",
    "gathered": "each rank its own, plus under FSDP the largest block's parameters while it is all-gathered",
    "host": "host memory of each rank's process, off the device",
}


@dataclass(frozen=True)
class MemoryTerm:
    """One memory term (see the module's docstring for ``kind``).

    Attributes:
        name: its key everywhere: ``MemoryBreakdown`` field, CSV/JSON column, ``hbm/<name>`` logged key.
        kind: ``category`` (in the sum), ``scope`` (inside the categories) or ``host`` (off the device).
        owner: what holds the bytes (how the term is measured).
        alive: when in a training step the bytes are alive (the phase).
        sharding: how it divides over ranks: a key of :data:`SHARDING`.
        remedy: the lightning_hbm feature that shrinks it (the report's advice when nothing was used yet).
        guide: the guide explaining that feature, relative to ``docs/``.
        owns: category terms: the tensors of the module and its optimizers that are this term's (by owner).
        created_in: category terms: the tracker phase (``"forward"``) whose storages nothing owns are this term's.
        rest: the category term that takes every storage no other term claims (``other``; exactly one).
        host: host terms: their bytes, read from the run's module and optimizers.
        advise: what shrinks the term once the run already uses its remedy (``None`` from it: the ``remedy``).
        A scope term is measured by :func:`~lightning_hbm.memory.tracker.memory_scope` ``(name)``: no field.

    Raises:
        ValueError: an unknown ``kind`` or ``sharding``, or measurement fields that do not fit the kind.
    """

    name: str
    kind: Kind
    owner: str
    alive: str
    sharding: str
    remedy: str
    guide: str
    owns: Optional[Owner] = None
    created_in: Optional[str] = None
    rest: bool = False
    host: Optional[HostMeasure] = None
    advise: Optional[Advise] = None

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING:
            raise ValueError(f"MemoryTerm {self.name!r}: sharding {self.sharding!r} is not one of {sorted(SHARDING)}.")
        if self.kind not in get_args(Kind):
            raise ValueError(f"MemoryTerm {self.name!r}: kind {self.kind!r} is not one of {list(get_args(Kind))}.")
        by_owner = self.owns is not None or self.created_in is not None or self.rest
        if (self.kind == "category") != by_owner:
            raise ValueError(
                f"MemoryTerm {self.name!r}: owns/created_in/rest say how a category is classified; a category needs "
                f"one of them and a {self.kind} term none."
            )
        if (self.kind == "host") != (self.host is not None):
            raise ValueError(f"MemoryTerm {self.name!r}: a host term, and only a host term, is measured by `host`.")


# -- what shrinks a term once the run uses its remedy (the report's advice) -------------------------------------
#: Bits per weight from which a base counts as 8-bit: the 4-bit formats store 4.1-5 bits with their constants,
#: the 8-bit ones 8.0-8.1, so a 4-bit format halves those again.
EIGHT_BIT = 6.0


def _advise_parameters(facts: RunFacts) -> Optional[str]:
    if facts.precision is None:
        return None
    if facts.bits_per_weight is not None and facts.bits_per_weight >= EIGHT_BIT:
        return f"the base is already {facts.precision}; a 4-bit mode (QuantizedPrecision('nf4-dq')) halves it again"
    return (f"the base is already {facts.precision}; what is left is the layers left unquantized (embeddings, the "
            "head: see the layer-kind table printed at fit start, quantize_head=True), or shard the base over GPUs "
            "(QuantizedFSDPStrategy)")  # fmt: skip


def _advise_gradients(facts: RunFacts) -> Optional[str]:
    if facts.lora:
        return "only the LoRA adapters train already; a lower rank r or fewer target_modules shrink them further"
    return None


def _advise_optimizer_states(facts: RunFacts) -> Optional[str]:
    if facts.compact_states:
        return f"the states are already compact ({', '.join(facts.optimizers)}); offload them to host memory (CPUOffloadStrategy)"
    if facts.lora:
        return "only the adapters have states; 8-bit states (MemoryEfficientOptimizer) shrink them about 4x"
    return None


def _advise_activations(facts: RunFacts) -> Optional[str]:
    if facts.checkpointing:
        return "activations are already recomputed in backward (ActivationCheckpointing); lower the batch size or sequence length"
    return None


def _advise_other(facts: RunFacts) -> Optional[str]:
    if not facts.fused_loss:  # the full logits are the usual largest temporary
        return ("compute the loss without materializing the full logits (FusedLoss), or lower the batch size; "
                "a detailed step (detailed_steps=[n]) names the temporaries")  # fmt: skip
    return None


#: The registry, in order: the categories first (the order a storage is given to its first owner), then the terms
#: beside the sum. Extended only through :func:`register_term`.
TERMS: list[MemoryTerm] = [
    MemoryTerm(
        "parameters", "category",
        owner="the module's parameters at their stored size, quantization constants included (absmax, code books)",
        alive="the whole step",
        sharding="split",
        remedy="store frozen base weights quantized (QuantizedPrecision('nf4-dq')) and train LoRA adapters",
        guide="parameters.md#quantized-base-weights-quantizedprecision",
        owns=lambda module, optimizers: parameter_tensors(module),
        advise=_advise_parameters,
    ),
    MemoryTerm(
        "gradients", "category",
        owner="`param.grad` of every trained parameter",
        alive="from backward to the next step's `zero_grad`, which Lightning runs after the forward",
        sharding="split",
        remedy="train fewer parameters: LoRA adapters on a frozen (quantized) base",
        guide="adapters.md#adapter-only-training-lora-peft",
        owns=lambda module, optimizers: gradient_tensors(module),
        advise=_advise_gradients,
    ),
    MemoryTerm(
        "optimizer_states", "category",
        owner="every tensor in `optimizer.state` (AdamW: two moments and `step`; 8-bit: quantized states + absmax)",
        alive="the whole step, from the first optimizer step on",
        sharding="split",
        remedy="use 8-bit optimizer states or offload them (MemoryEfficientOptimizer)",
        guide="optimizer.md",
        owns=lambda module, optimizers: optimizer_state_tensors(optimizers),
        advise=_advise_optimizer_states,
    ),
    MemoryTerm(
        "activations", "category",
        owner="storages the forward created, alive at its end, owned by none of the above (saved for backward)",
        alive="from the forward to the backward that frees them",
        sharding="per-rank",
        remedy="recompute activations in backward (ActivationCheckpointing) or lower the batch size",
        guide="activations.md#activation-memory-activationcheckpointing-attentionkernel",
        created_in="forward",
        advise=_advise_activations,
    ),
    MemoryTerm(
        "other", "category",
        owner="everything else alive: buffers, the batch, backward and optimizer-step temporaries",
        alive="buffers the whole step; temporaries inside backward and the optimizer step",
        sharding="gathered",
        remedy="lower the batch size; check buffers and temporaries (run a step with detailed_steps=[n])",
        guide="profiler.md#where-the-memory-goes-hbmprofiler",
        owns=lambda module, optimizers: buffer_tensors(module),
        rest=True,
        advise=_advise_other,
    ),
    MemoryTerm(
        "loss", "scope",
        owner="what `FusedLoss` allocates: chunk logits, the fp32 rows being softmaxed, a dequantized head (inside the categories)",
        alive="the loss's forward and backward",
        sharding="per-rank",
        remedy="compute the loss chunk by chunk (FusedLoss) with smaller chunks, or lower the batch size",
        guide="activations.md#the-loss-without-the-full-logits-fusedloss",
    ),
    MemoryTerm(
        "host_offload", "host",
        owner="`CPUOffloadStrategy`'s optimizer: fp32 master copies, gradient buffers and states (host RAM)",
        alive="the whole step",
        sharding="host",
        remedy="train fewer parameters (LoRA) or keep 8-bit states (MemoryEfficientOptimizer) on the host",
        guide="optimizer.md",
        host=lambda module, optimizers: host_offload_bytes(optimizers),
    ),
    MemoryTerm(
        "host_activations", "host",
        owner="`ActivationCheckpointing(offload=True)`: the checkpointed blocks' inputs in pinned host RAM (each as "
        "power-of-two pieces, less than 2 MiB over its bytes)",
        alive="from each block's forward to its backward",
        sharding="host",
        remedy="a shorter sequence or batch; fewer checkpointed blocks offloaded",
        guide="activations.md#activation-memory-activationcheckpointing-attentionkernel",
        host=lambda module, optimizers: offloaded_activation_bytes(module),
    ),
]

#: The names of the terms that sum to the device total, in registry order (fixed: see :func:`register_term`).
CATEGORY_NAMES: tuple[str, ...] = tuple(t.name for t in TERMS if t.kind == "category")
#: The names of the built-in terms reported beside the sum; :func:`side_terms` includes registered ones.
SIDE_TERMS: tuple[str, ...] = tuple(t.name for t in TERMS if t.kind != "category")


def term(name: str) -> MemoryTerm:
    """The registry entry ``name``.

    Raises:
        KeyError: no term has that name (the message lists the terms).
    """
    for t in TERMS:
        if t.name == name:
            return t
    raise KeyError(f"{name!r} is not a memory term; the terms are {[t.name for t in TERMS]} (lightning_hbm.memory.terms.TERMS).")


def category_terms() -> tuple[MemoryTerm, ...]:
    """The terms that sum to the device total, in registry order (a storage goes to the first that owns it)."""
    return tuple(t for t in TERMS if t.kind == "category")


def scope_terms() -> tuple[MemoryTerm, ...]:
    """The terms measured by a :func:`~lightning_hbm.memory.tracker.memory_scope` of their name (inside the sum)."""
    return tuple(t for t in TERMS if t.kind == "scope")


def host_terms() -> tuple[MemoryTerm, ...]:
    """The terms held off the device (host memory), each measured by its ``host``."""
    return tuple(t for t in TERMS if t.kind == "host")


def side_terms() -> tuple[str, ...]:
    """The names of every term beside the sum (scope and host kinds, registered ones included), in registry order."""
    return tuple(t.name for t in TERMS if t.kind != "category")


def created_term(phase: str) -> str:
    """The category of an unowned storage the tracker first saw in ``phase``: ``created_in`` it, else the ``rest``."""
    for t in category_terms():
        if t.created_in == phase:
            return t.name
    return rest_term()


def rest_term() -> str:
    """The category of every storage no other category claims (``other``)."""
    return next(t.name for t in category_terms() if t.rest)


def split_terms() -> tuple[str, ...]:
    """The terms FSDP/ZeRO-3 divides evenly over ranks (sharding ``split``)."""
    return tuple(t.name for t in TERMS if t.sharding == "split")


def register_term(new: MemoryTerm) -> MemoryTerm:
    """Add a ``scope`` or ``host`` term to :data:`TERMS` (an extension, a test): every consumer that iterates the
    registry shows it (the planner's ``Prediction.terms`` and table, the profiler's columns, the report).

    Args:
        new: the entry; a scope term is then measured by ``memory_scope(new.name)`` around the code that allocates it.

    Returns:
        ``new``.

    Raises:
        ValueError: a term of that name exists, or ``new`` is a category (the categories are the fixed sum: a new one
            is an entry in ``TERMS`` here plus a field of ``MemoryBreakdown`` and the ``Category`` literal, checked at
            import; docs/extending.md#a-memory-term).
    """
    if any(t.name == new.name for t in TERMS):
        raise ValueError(f"register_term: a memory term {new.name!r} exists already.")
    if new.kind == "category":
        raise ValueError(
            f"register_term: {new.name!r} is a category; the categories are the fixed sum every storage belongs to "
            "(MemoryBreakdown's fields): add its entry to TERMS in lightning_hbm/memory/terms.py (docs/extending.md#a-memory-term)."
        )
    TERMS.append(new)
    return new


def unregister_term(name: str) -> None:
    """Remove a term :func:`register_term` added (a test's cleanup).

    Raises:
        KeyError: no such term. ValueError: ``name`` is a built-in term.
    """
    found = term(name)
    if name in CATEGORY_NAMES or name in SIDE_TERMS:
        raise ValueError(f"unregister_term: {name!r} is a built-in memory term.")
    TERMS.remove(found)


def _check_registry() -> None:
    """One ``rest`` category, one category per creation phase, categories before the terms beside them."""
    categories = category_terms()
    if sum(t.rest for t in categories) != 1:
        raise ImportError("lightning_hbm.memory.terms: exactly one category term must be the rest (rest=True).")
    phases = [t.created_in for t in categories if t.created_in is not None]
    if len(phases) != len(set(phases)):
        raise ImportError(f"lightning_hbm.memory.terms: two category terms are created in one phase ({phases}).")
    if [t.kind == "category" for t in TERMS] != sorted((t.kind == "category" for t in TERMS), reverse=True):
        raise ImportError("lightning_hbm.memory.terms: the category terms come first in TERMS.")


_check_registry()


def terms_table() -> str:
    """The terms as a markdown table (``docs/extending.md`` holds this text; ``tests/memory/test_terms.py`` checks it)."""
    lines = [
        "| term | kind | what holds it | alive | over ranks | what shrinks it |",
        "|---|---|---|---|---|---|",
    ]
    for t in TERMS:
        lines.append(f"| `{t.name}` | {t.kind} | {t.owner} | {t.alive} | {SHARDING[t.sharding]} | [{t.remedy}]({t.guide}) |")
    return "\n".join(lines) + "\n"


__all__ = [
    "CATEGORY_NAMES",
    "EIGHT_BIT",
    "SHARDING",
    "SIDE_TERMS",
    "TERMS",
    "MemoryTerm",
    "category_terms",
    "created_term",
    "host_terms",
    "register_term",
    "rest_term",
    "scope_terms",
    "side_terms",
    "split_terms",
    "term",
    "terms_table",
    "unregister_term",
]
