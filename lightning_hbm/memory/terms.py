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
    Host memory a feature moved off the device (``host_offload``). Not device memory: beside the sum too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["category", "scope", "host"]

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
    """

    name: str
    kind: Kind
    owner: str
    alive: str
    sharding: str
    remedy: str
    guide: str

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING:
            raise ValueError(f"MemoryTerm {self.name!r}: sharding {self.sharding!r} is not one of {sorted(SHARDING)}.")


TERMS: tuple[MemoryTerm, ...] = (
    MemoryTerm(
        "parameters", "category",
        owner="the module's parameters at their stored size, quantization constants included (absmax, code books)",
        alive="the whole step",
        sharding="split",
        remedy="store frozen base weights quantized (QuantizedPrecision('nf4-dq')) and train LoRA adapters",
        guide="parameters.md#quantized-base-weights-quantizedprecision",
    ),
    MemoryTerm(
        "gradients", "category",
        owner="`param.grad` of every trained parameter",
        alive="from backward to the next step's `zero_grad`, which Lightning runs after the forward",
        sharding="split",
        remedy="train fewer parameters: LoRA adapters on a frozen (quantized) base",
        guide="adapters.md#adapter-only-training-lora-peft",
    ),
    MemoryTerm(
        "optimizer_states", "category",
        owner="every tensor in `optimizer.state` (AdamW: two moments and `step`; 8-bit: quantized states + absmax)",
        alive="the whole step, from the first optimizer step on",
        sharding="split",
        remedy="use 8-bit optimizer states or offload them (MemoryEfficientOptimizer)",
        guide="optimizer.md",
    ),
    MemoryTerm(
        "activations", "category",
        owner="storages the forward created, alive at its end, owned by none of the above (saved for backward)",
        alive="from the forward to the backward that frees them",
        sharding="per-rank",
        remedy="recompute activations in backward (ActivationCheckpointing) or lower the batch size",
        guide="activations.md#activation-memory-activationcheckpointing-attentionkernel",
    ),
    MemoryTerm(
        "other", "category",
        owner="everything else alive: buffers, the batch, backward and optimizer-step temporaries",
        alive="buffers the whole step; temporaries inside backward and the optimizer step",
        sharding="gathered",
        remedy="lower the batch size; check buffers and temporaries (run a step with detailed_steps=[n])",
        guide="profiler.md#where-the-memory-goes-hbmprofiler",
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
    ),
)

_BY_NAME = {term.name: term for term in TERMS}
#: The names of the terms that sum to the device total, in registry order.
CATEGORY_NAMES: tuple[str, ...] = tuple(t.name for t in TERMS if t.kind == "category")
#: The names of the terms reported beside the sum (``scope`` and ``host`` kinds), in registry order.
SIDE_TERMS: tuple[str, ...] = tuple(t.name for t in TERMS if t.kind != "category")


def term(name: str) -> MemoryTerm:
    """The registry entry ``name``."""
    if name not in _BY_NAME:
        raise KeyError(f"{name!r} is not a memory term; the terms are {list(_BY_NAME)} (lightning_hbm.memory.terms.TERMS).")
    return _BY_NAME[name]


def split_terms() -> tuple[str, ...]:
    """The terms FSDP/ZeRO-3 divides evenly over ranks (sharding ``split``)."""
    return tuple(t.name for t in TERMS if t.sharding == "split")


def terms_table() -> str:
    """The terms as a markdown table (``docs/extending.md`` holds this text; ``tests/memory/test_terms.py`` checks it)."""
    lines = [
        "| term | kind | what holds it | alive | over ranks | what shrinks it |",
        "|---|---|---|---|---|---|",
    ]
    for t in TERMS:
        lines.append(f"| `{t.name}` | {t.kind} | {t.owner} | {t.alive} | {SHARDING[t.sharding]} | [{t.remedy}]({t.guide}) |")
    return "\n".join(lines) + "\n"


__all__ = ["CATEGORY_NAMES", "SHARDING", "SIDE_TERMS", "TERMS", "MemoryTerm", "split_terms", "term", "terms_table"]
