"""What a run applied, as a typed record: the facts the report's advice reads (:class:`RunFacts`).

The advice for a term (:func:`lightning_hbm.memory.report.advice`) depends on what the run already uses: a QLoRA run
is not told to quantize and add LoRA. Those facts are filled by whoever knows them (``HBMProfiler`` from the
Trainer, in ``lightning_hbm.profiling``) and passed down as this record: this level imports neither the precision
formats nor the callbacks. The quantized base is read off the model itself (:func:`quantized_base`), through the
format lookup :mod:`lightning_hbm.precision` registers with :mod:`lightning_hbm.memory.storage`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

from torch import nn

from lightning_hbm.memory.storage import quantization_tensors, quantized_format, tensor_bytes


@dataclass(frozen=True)
class RunFacts:
    """What a run applied (all off by default: a plain run).

    Attributes:
        precision: name of the quantized format holding most of the frozen base weights (``"nf4-dq"``); ``None``:
            the base is not quantized.
        bits_per_weight: stored bits per weight of that format on this model, quantization constants included
            (nf4-dq ~4.1, nf4 ~4.5, int8 ~8.0); set exactly when ``precision`` is.
        lora: LoRA adapters train on a frozen base.
        checkpointing: activations are recomputed in backward (``ActivationCheckpointing``).
        fused_loss: the loss is computed chunk by chunk (``FusedLoss``).
        optimizers: class names of the run's optimizers (shown in the advice).
        compact_states: the optimizer states are already low-bit or off the device.

    Raises:
        ValueError: ``precision`` given without ``bits_per_weight`` or the other way round.
    """

    precision: Optional[str] = None
    bits_per_weight: Optional[float] = None
    lora: bool = False
    checkpointing: bool = False
    fused_loss: bool = False
    optimizers: tuple[str, ...] = ()
    compact_states: bool = False

    def __post_init__(self) -> None:
        if (self.precision is None) != (self.bits_per_weight is None):
            raise ValueError(
                f"RunFacts: precision={self.precision!r} and bits_per_weight={self.bits_per_weight!r} go together "
                "(both None: the base is not quantized)."
            )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the profiler's report keeps it under ``used["facts"]``, :meth:`from_dict` reads it back)."""
        return {**asdict(self), "optimizers": list(self.optimizers)}

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> RunFacts:
        """The record :meth:`as_dict` wrote; ``None`` or ``{}`` (a report written before facts were kept): a plain run.

        Keys this version does not know (a report from a newer one) are left out rather than refused: the report
        is still readable, its advice just does not use them.
        """
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in (data or {}).items() if k in known}
        if "optimizers" in values:
            values["optimizers"] = tuple(values["optimizers"])
        return cls(**values)


def quantized_base(module: nn.Module) -> tuple[Optional[str], Optional[float]]:
    """(format name, stored bits per weight) of ``module``'s quantized layers; ``(None, None)`` when none is.

    The name is that of the format holding most weights, as the format lookup reports it (it cannot tell variants
    of one layer class apart, e.g. ``nf4`` from ``nf4-dq``: a caller that knows the configured mode names it).
    Bits per weight: the bytes of every quantized layer's weight and quantization constants over their unpacked
    weight count, so what the base stores is measured on the model, not assumed from a name.
    """
    weights: Counter[str] = Counter()
    stored = 0
    for sub in module.modules():
        fmt = quantized_format(sub)  # duck-typed (storage.py): precision registers the lookup, this level cannot import it
        if fmt is None:
            continue
        weight = [p for name, p in sub.named_parameters(recurse=False) if name == "weight"]
        weights[fmt.name] += int(fmt.weight_shape(sub).numel())
        stored += tensor_bytes([*weight, *quantization_tensors(sub)])
    if not weights:
        return None, None
    return max(weights, key=lambda n: weights[n]), 8.0 * stored / max(sum(weights.values()), 1)


__all__ = ["RunFacts", "quantized_base"]
