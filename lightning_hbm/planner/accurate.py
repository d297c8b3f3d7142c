"""The accurate 4-bit base for the model at hand: the calibrated correction's rank chosen by a byte target per weight.

:data:`~lightning_hbm.planner.candidates.ACCURATE_4BIT` (``nf4-dq-b32``, GPTQ rounding, ``correction_rank=16``) is the
base measured closest to 16-bit LoRA as trained. Its correction stores ``r x (in + out)`` values in the compute dtype
(:func:`~lightning_hbm.layers.correction.storage_dtype`) beside each Linear, so what it costs per weight grows as the layers narrow
and doubles under fp32 compute: at rank 16, 0.626 bytes per weight on SmolLM2-135M (hidden 576) in bf16, 0.718 in fp32;
0.79 on all-MiniLM-L6-v2 (hidden 384) in fp32, over issue 52's 0.65. :func:`accurate_4bit`
keeps the base and the rounding, and takes the largest rank of :data:`ACCURATE_RANKS` whose stored base, factors
included, stays within the target (:data:`ACCURATE_BYTES_PER_WEIGHT` unless told otherwise): SmolLM2 keeps its
measured rank 16 under bf16 compute (8 under fp32), MiniLM takes 12 (6 under fp32). Counted as the coverage table counts a quantized Linear: the
packed weight, its quantization constants, the bias in the compute dtype and the factors, over the layer's weights and
biases (``benchmarks/finetune_minilm.py``'s ``B/weight``), exact per layer (:func:`~lightning_hbm.precision.sensitivity.weight_bytes`
quantizes a zero weight of each shape once). Only shapes are read: nothing of the model changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_hbm.layers import kind_of
from lightning_hbm.layers.correction import storage_dtype
from lightning_hbm.planner.building import _build, _fake_mode, _quiet_logs
from lightning_hbm.planner.candidates import ACCURATE_4BIT
from lightning_hbm.planner.realvalues import RealValues
from lightning_hbm.precision import QuantizedPrecision, to_dtype
from lightning_hbm.precision.sensitivity import weight_bytes

#: The stored base AutoFit's accurate 4-bit candidate may take per quantized Linear weight, the correction's factors
#: included (issue 52: "the best configuration AutoFit picks at 0.65 B/weight or less"). ``AutoFit(accurate_bytes_per_weight=...)``.
ACCURATE_BYTES_PER_WEIGHT = 0.65
#: The correction ranks tried, the largest that fits taken: 16 (SmolLM2's measured rank) down to 4 (the least a
#: measured arm used: MiniLM, session 40). Under 4 the correction is not offered: the plain base is said instead.
ACCURATE_RANKS = (16, 12, 8, 6, 4)


@dataclass(frozen=True)
class AccurateBase:
    """The accurate 4-bit base chosen for one model (:func:`accurate_4bit`).

    Args:
        rank: the correction rank taken (0: none of :data:`ACCURATE_RANKS` fits the target).
        bytes_per_weight: the stored base per weight at ``rank`` (at the smallest rank tried when none fits).
        target: the byte target per weight it was chosen under.
        dtype: the compute dtype its factors and biases are stored in.
        layers: how many Linear-like layers the correction covers (0: the model has none to quantize).
        ranks: ``{rank: bytes per weight}`` for every rank tried, largest first.
    """

    rank: int
    bytes_per_weight: float
    target: float
    dtype: str
    layers: int
    ranks: tuple[tuple[int, float], ...]

    @property
    def settings(self) -> dict[str, Any]:
        """``QuantizedPrecision``'s arguments (``mode``, ``rounding``, ``correction_rank``), as a user would write them;
        ``{}`` when no rank fits."""
        if not self.rank:
            return {}
        return {"mode": ACCURATE_4BIT["precision"], "rounding": ACCURATE_4BIT["rounding"], "correction_rank": self.rank}

    @property
    def candidate_fields(self) -> dict[str, Any]:
        """The :class:`~lightning_hbm.planner.Candidate` fields of the base (``{}`` when no rank fits)."""
        return {**ACCURATE_4BIT, "correction_rank": self.rank} if self.rank else {}

    def describe(self) -> str:
        """Why this rank, with the figures (AutoFit says it at setup)."""
        tried = ", ".join(f"{r}: {b:.3f}" for r, b in self.ranks)
        if not self.rank:
            return (
                f"none of the correction ranks {list(ACCURATE_RANKS)} keeps the accurate 4-bit base within "
                f"{self.target:g} bytes per weight on this model ({self.dtype} factors; bytes per weight by rank: {tried}); "
                f"AutoFit(accurate_bytes_per_weight={_raised(self.ranks[-1][1])}) offers it at rank {self.ranks[-1][0]}"
            )
        return (
            f"correction rank {self.rank}, the largest of {list(ACCURATE_RANKS)} that keeps the stored base within "
            f"{self.target:g} bytes per weight on this model's {self.layers} Linear layers: {self.bytes_per_weight:.3f} "
            f"with its {self.dtype} factors (bytes per weight by rank: {tried})"
        )


def _raised(value: float) -> str:
    """``value`` rounded up to the third decimal: a target that admits it."""
    return f"{-(-round(value * 1e6) // 1000) / 1000:g}"


def accurate_4bit(
    model: nn.Module,
    dtype: Union[str, torch.dtype] = "bfloat16",
    max_bytes_per_weight: float = ACCURATE_BYTES_PER_WEIGHT,
    ranks: Sequence[int] = ACCURATE_RANKS,
) -> AccurateBase:
    """The accurate 4-bit base for ``model``: the largest correction rank of ``ranks`` whose stored base (``nf4-dq-b32``
    weights, constants and biases in ``dtype``, factors in its 16-bit storage dtype) stays within ``max_bytes_per_weight`` per weight.

    ``model``: a module as built; a LightningModule whose layers ``configure_model`` builds is built on fake tensors to
    read their shapes (nothing is allocated, the module is not changed).

    Raises:
        ValueError: a target that is not a positive number, or no rank to try.
    """
    if isinstance(max_bytes_per_weight, bool) or not isinstance(max_bytes_per_weight, (int, float)) or not 0 < max_bytes_per_weight:
        raise ValueError(
            f"accurate_bytes_per_weight={max_bytes_per_weight!r}: pass the bytes the 4-bit base may store per weight, "
            f"factors included, e.g. {ACCURATE_BYTES_PER_WEIGHT} (nf4-dq-b32 alone takes about 0.54)."
        )
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in ranks):
        raise ValueError(f"accurate_4bit(ranks={list(ranks)!r}): pass correction ranks >= 1, e.g. {list(ACCURATE_RANKS)}.")
    torch_dtype = to_dtype(dtype)
    shapes = _linear_shapes(model)
    biases = sum(b for _, _, b in shapes)
    params = sum(i * o for i, o, _ in shapes) + biases  # as the coverage table counts a layer's parameters
    base = sum(weight_bytes(ACCURATE_4BIT["precision"], i, o, torch_dtype) for i, o, _ in shapes) + biases * torch_dtype.itemsize
    tried = []
    for rank in sorted(ranks, reverse=True):
        factors = sum(min(rank, i, o) * (i + o) for i, o, _ in shapes) * storage_dtype(torch_dtype).itemsize
        tried.append((rank, (base + factors) / params if params else 0.0))
    name = str(storage_dtype(torch_dtype)).removeprefix("torch.")
    fitting = [(rank, value) for rank, value in tried if value <= max_bytes_per_weight]
    rank, value = fitting[0] if fitting and shapes else (0, tried[-1][1])
    return AccurateBase(rank, value, float(max_bytes_per_weight), name, len(shapes), tuple(tried))


def _linear_shapes(model: nn.Module) -> list[tuple[int, int, int]]:
    """``(in_features, out_features, bias elements)`` of every Linear-like layer ``nf4-dq-b32`` quantizes in ``model``
    (the layers the correction covers: a convolution gets no factors), read on a fake build when its layers are built
    in ``configure_model``."""
    shapes = _shapes(model)
    if shapes or not isinstance(model, pl.LightningModule):
        return shapes
    fake_mode = _fake_mode()
    with _quiet_logs():
        built = _build(model, fake_mode, RealValues(fake_mode))
        with fake_mode:
            built.configure_model()
        return _shapes(built)


def _shapes(model: nn.Module) -> list[tuple[int, int, int]]:
    shapes = []
    for _, layer in QuantizedPrecision(ACCURATE_4BIT["precision"]).quantization.targets(model):
        kind = kind_of(layer)
        if kind is None or kind.wrap is not None:
            continue
        in_features, out_features = kind.features(layer)
        bias: Optional[torch.Tensor] = getattr(layer, "bias", None)
        shapes.append((in_features, out_features, bias.numel() if isinstance(bias, torch.Tensor) else 0))
    return shapes


__all__ = ["ACCURATE_BYTES_PER_WEIGHT", "ACCURATE_RANKS", "AccurateBase", "accurate_4bit"]
