"""What lightning_hbm knows about a model it changed: one typed :class:`Record` per model, one :class:`LayerMark` per layer.

Nothing is stamped on the user's modules. The records and marks live in weak maps owned by this module, keyed by
object identity (an entry goes with its module; a module's own ``__eq__`` / ``__hash__`` play no part), and are read
and written only through the functions below:

- per model (:func:`record_of`): the model as built (schema and fingerprints, taken before the first change), the
  transforms applied and which instance applied each, the ``modules_to_save`` the surgery was given, the last
  coverage table;
- per layer (:func:`mark_of`): the kind it counts as (it replaced a layer of that kind), the kind :func:`prepare_model
  <lightning_hbm.layers.prepare_model>` converted into it, why it was left alone;
- per block: a checkpointed block's mark is its instance ``forward`` itself (a :class:`CheckpointedForward`);
- per weight Parameter: the int8 smoothing exponents, for the duration of the quantization (:func:`input_shift`).

Copies: ``copy.deepcopy`` and pickle copy a module's ``__dict__``, not these maps. A checkpointed block stays
checkpointed and says so (its mark is in its ``forward``); the rest of a model's record follows a copy only through
:func:`copy_record` (the planner's copies call it). A plain copy of a changed model is, to lightning_hbm, a model
nobody changed (``tests/test_record.py`` pins this).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hbm._compat import torch as torch_compat


@dataclass
class Record:
    """What the surgery keeps about one model (the LightningModule it ran on)."""

    as_built: Optional[dict[str, Any]] = None  # schema and fingerprints of the model as built: set once, first surgery
    applied: list[str] = field(default_factory=list)  # names of the transforms applied, in the order they ran
    appliers: dict[str, int] = field(default_factory=dict)  # transform name -> id() of the instance that applied it last
    modules_to_save: list[str] = field(default_factory=list)  # the transforms' modules_to_save, given to run_surgery
    coverage: Optional[list[Any]] = None  # the last coverage table (``layers.CoverageRow`` s): :func:`coverage_of`


@dataclass
class LayerMark:
    """What lightning_hbm did to one layer (a weight-holding module, or the module that replaced one)."""

    kind: Optional[str] = None  # the kind this module counts as: it replaced a layer of that kind (a quantized Conv1D)
    converted: Optional[str] = None  # the kind prepare() (or a quantized convolution) converted into this module
    left_alone: Optional[tuple[str, bool]] = None  # (reason, deliberate): why it was not quantized / adapted
    quantized_as: Optional[tuple[str, str]] = None  # (mode, rounding) a mode's layer was built in: ("nf4-dq", "gptq")


_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # model -> Record
_MARKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # layer -> LayerMark
_SHIFTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight Parameter -> int8 smoothing exponents


# ------------------------------------------------------------------------------------------ per model


def record_of(model: nn.Module, create: bool = False) -> Optional[Record]:
    """The record of ``model`` (``None`` if nothing recorded it yet, unless ``create``: then a new, empty one)."""
    record = _RECORDS.get(model)
    if record is None and create:
        record = _RECORDS[model] = Record()
    return record


def _record(model: nn.Module) -> Record:
    record = record_of(model, create=True)
    assert record is not None
    return record


def as_built(model: nn.Module) -> Optional[dict[str, Any]]:
    """The schema and fingerprints of ``model`` as the user built it, taken by its first surgery (else ``None``)."""
    record = record_of(model)
    return record.as_built if record is not None else None


def set_as_built(model: nn.Module, as_built: Optional[dict[str, Any]]) -> None:
    """Record ``model`` as built (the surgery, before its first change; every rank takes rank 0's)."""
    _record(model).as_built = as_built


def applied_transforms(model: nn.Module) -> list[str]:
    """Names of the transforms applied to ``model``, in the order they ran (a copy)."""
    record = record_of(model)
    return list(record.applied) if record is not None else []


def mark_applied(model: nn.Module, name: str) -> None:
    """Record that the transform ``name`` changed ``model`` (the engine, and the precision plugin)."""
    _record(model).applied.append(name)


def appliers(model: nn.Module) -> dict[str, int]:
    """``{transform name: id() of the instance that applied it last}`` of ``model``: the live map, to read or update."""
    return _record(model).appliers


def modules_to_save(model: nn.Module) -> list[str]:
    """The ``modules_to_save`` the last surgery of ``model`` was given (a copy; ``[]`` before any)."""
    record = record_of(model)
    return list(record.modules_to_save) if record is not None else []


def set_modules_to_save(model: nn.Module, names: list[str]) -> None:
    """Record the transforms' ``modules_to_save`` (``run_surgery``, before any check: the plugin leaves them alone)."""
    _record(model).modules_to_save = list(names)


def coverage_of(model: nn.Module) -> Optional[list[Any]]:
    """The coverage table last reported for ``model`` (public as ``lightning_hbm.coverage_of``), or ``None``.

    One :class:`lightning_hbm.layers.CoverageRow` per layer kind present, then the rows of weights outside any kind,
    the LoRA adapters and ``other``: the table printed at fit start (docs/adapters.md). ``None`` for a model no
    ``QuantizedPrecision`` or ``LoRA`` reported on (a plain copy of one included: see :func:`copy_record`).
    """
    record = record_of(model)
    return record.coverage if record is not None else None


def set_coverage(model: nn.Module, rows: list[Any]) -> None:
    """Record the coverage table of ``model`` (``layers.report_coverage``)."""
    _record(model).coverage = rows


# ------------------------------------------------------------------------------------------ per layer


def mark_of(layer: nn.Module, create: bool = False) -> Optional[LayerMark]:
    """The mark of ``layer`` (``None`` if it has none, unless ``create``: then a new, empty one)."""
    mark = _MARKS.get(layer)
    if mark is None and create:
        mark = _MARKS[layer] = LayerMark()
    return mark


def _mark(layer: nn.Module) -> LayerMark:
    mark = mark_of(layer, create=True)
    assert mark is not None
    return mark


def counted_as(layer: nn.Module) -> Optional[str]:
    """The name of the kind ``layer`` counts as because it replaced a layer of that kind, or ``None``."""
    mark = mark_of(layer)
    return mark.kind if mark is not None else None


def set_kind(layer: nn.Module, name: Optional[str]) -> None:
    """``layer`` counts as a layer of kind ``name`` (it replaced one: a quantized Conv1D is still a Conv1D)."""
    _mark(layer).kind = name


def converted_from(layer: nn.Module) -> Optional[str]:
    """The name of the kind converted into ``layer`` (by ``prepare``, or a quantized convolution), or ``None``."""
    mark = mark_of(layer)
    return mark.converted if mark is not None else None


def set_converted(layer: nn.Module, name: str) -> None:
    """``layer`` was put in the place of a layer of kind ``name`` (resume maps its keys back to that layer's)."""
    _mark(layer).converted = name


def left_alone(layer: nn.Module) -> Optional[tuple[str, bool]]:
    """``(reason, deliberate)`` for a layer left alone on purpose or for want of support, or ``None``."""
    mark = mark_of(layer)
    return mark.left_alone if mark is not None else None


def leave_alone(layer: nn.Module, reason: str, deliberate: bool) -> None:
    """Record why ``layer`` was left alone (the coverage table shows ``reason``; not ``deliberate``: warned about)."""
    _mark(layer).left_alone = (reason, deliberate)


def quantized_as(layer: nn.Module) -> Optional[tuple[str, str]]:
    """``(mode, rounding)`` the mode's ``layer`` was built in by ``QuantizedPrecision`` (``("nf4-dq", "gptq")``;
    rounding ``"nearest"``: the format's own), or ``None``: not built by it (bitsandbytes' or Hugging Face's own)."""
    mark = mark_of(layer)
    return mark.quantized_as if mark is not None else None


def set_quantized_as(layer: nn.Module, mode: str, rounding: str) -> None:
    """Record that the mode's ``layer`` was built in ``mode`` and rounded by ``rounding`` (the quantization)."""
    _mark(layer).quantized_as = (mode, rounding)


# ------------------------------------------------------------------------------------------ per block


class CheckpointedForward:
    """Base of the ``forward`` ``ActivationCheckpointing`` sets on a block instance: the block and its checkpoint
    setup (what the wrapped forward needs: :func:`checkpoint_setup`).

    The object itself is the block's mark: it lives in the block's ``__dict__``, so ``copy.deepcopy`` and pickle
    carry it (rebound to the copy, through the memo) and a copy of a checkpointed model is checkpointed and says so.
    """

    def __init__(self, block: nn.Module, setup: Any) -> None:
        self.block = block
        self.setup = setup

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a model pickled before session 33 holds the setup under its former key "plan" ("plan" names the planner's,
        # issue 54): read back under the new one, so torch.load of such a model keeps its checkpointed blocks working
        if "plan" in state and "setup" not in state:
            state = {("setup" if key == "plan" else key): value for key, value in state.items()}
        self.__dict__.update(state)

    @property
    def plan(self) -> Any:
        """Deprecated: the old name of :attr:`setup` (read-only; warns)."""
        warnings.warn("CheckpointedForward.plan is deprecated: read its setup (the same object).", DeprecationWarning, stacklevel=2)
        return self.setup


def checkpoint_setup(block: nn.Module) -> Optional[Any]:
    """The checkpoint setup of ``block``: what its checkpointed ``forward`` needs (``None``: not checkpointed)."""
    forward = torch_compat.forward_override(block)
    return forward.setup if isinstance(forward, CheckpointedForward) else None


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the checkpointed blocks of ``model``."""
    return [name for name, sub in model.named_modules() if isinstance(torch_compat.forward_override(sub), CheckpointedForward)]


# ------------------------------------------------------------------------------------------ per weight


def input_shift(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """The int8 smoothing exponents attached to the weight Parameter ``weight`` (``None``: none)."""
    return _SHIFTS.get(weight)


def set_input_shift(weight: torch.Tensor, shift: Optional[torch.Tensor]) -> None:
    """Attach (``None``: detach) int8 smoothing exponents to ``weight``; keyed on the Parameter, which unlike its
    module reaches the format's ``replace`` in every code path (the sensitivity plan's copies share it)."""
    if shift is None:
        _SHIFTS.pop(weight, None)
    else:
        _SHIFTS[weight] = shift


@contextmanager
def attached_input_shifts(module: nn.Module, shifts: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Attach ``shifts`` (``{layer name: int8 exponents}``) to the weights of ``module``'s Linears for the duration of
    the block (read by mode ``int8-dynamic-smooth``'s ``replace``), then detach them."""
    weights = [cast(torch.Tensor, module.get_submodule(name).weight) for name in shifts]
    try:
        for weight, shift in zip(weights, shifts.values()):
            set_input_shift(weight, shift)
        yield
    finally:
        for weight in weights:
            set_input_shift(weight, None)



# ------------------------------------------------------------------------------------------ copies


def copy_record(source: nn.Module, copied: nn.Module) -> None:
    """Give ``copied`` (a ``copy.deepcopy`` of ``source``) the record and marks of ``source``.

    Module by module in ``named_modules`` order, which a deep copy keeps; the marks are copied, not shared.

    Raises:
        ValueError: ``copied`` has another module tree than ``source``.
    """
    pairs = list(zip(source.named_modules(remove_duplicate=False), copied.named_modules(remove_duplicate=False)))
    if any(a != b for (a, _), (b, _) in pairs) or len(pairs) != len(list(copied.named_modules(remove_duplicate=False))):
        raise ValueError(f"copy_record: the copy of {type(source).__name__} has another module tree than the model")
    for (_, original), (_, twin) in pairs:
        mark = mark_of(original)
        if mark is not None:
            _MARKS[twin] = copy.deepcopy(mark)
        record = record_of(original)
        if record is not None:
            _RECORDS[twin] = copy.deepcopy(record)


__all__ = [
    "CheckpointedForward",
    "LayerMark",
    "Record",
    "applied_transforms",
    "appliers",
    "as_built",
    "checkpoint_setup",
    "checkpointed_blocks",
    "converted_from",
    "copy_record",
    "counted_as",
    "coverage_of",
    "attached_input_shifts",
    "input_shift",
    "leave_alone",
    "left_alone",
    "mark_applied",
    "mark_of",
    "modules_to_save",
    "quantized_as",
    "record_of",
    "set_as_built",
    "set_converted",
    "set_coverage",
    "set_input_shift",
    "set_kind",
    "set_quantized_as",
]


#: the former names (issue 54: "plan" names the planner's), importable with a DeprecationWarning naming the new one
_RENAMED = {"checkpoint_plan": "checkpoint_setup"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"lightning_hbm.record.{name} is deprecated: use {_RENAMED[name]} (the same function).", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
