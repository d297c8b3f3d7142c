"""The calibrated correction of a quantized convolution (``QuantizedPrecision(correction_rank=r)``, issue 52).

A convolution multiplies its ``[out, in / groups x kernel]`` weight matrix with its input's patches (im2col), so its
output error is ``(W - Q) P^T`` and the Linear's fit (:func:`~lightning_hbm.precision.correction.fit_factors`) applies
on the patches: the statistics are the patches' Gram on the probe batch (the one GPTQ rounds a convolution with,
:func:`~lightning_hbm.precision.gptq.patch_gram`), the factors ``A [r, in x kernel]``, ``B [out, r]`` (the shapes of
peft's conv LoRA: a rank-``r`` convolution with the layer's kernel, stride, padding and dilation, then a 1x1 one).
They are stored frozen on the quantized convolution, which adds ``B A`` to the weight it dequantizes at each forward
(:func:`~lightning_hbm.layers.correction.attach_weight_correction`: the same output as the two convolutions, fewer
operations); everything else (bytes, planner, checkpoints, resume) is the Linear's correction's.

Left out, each named in the correction's warning: grouped and depthwise convolutions (each group sees its own
channels, so the whole matrix's low-rank term does not fit them; a 3x3 depthwise one has 9 weights per channel, which
no rank below 9 corrects), and transposed convolutions (their stored matrix is no map of input patches: no statistics).
"""

from __future__ import annotations

from typing import Optional, Protocol, cast

import torch
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers import CONV, kind_of, stored_in
from lightning_hbm.layers.correction import storage_dtype


class Correct(Protocol):
    """What :func:`correct_conv` calls (:class:`~lightning_hbm.precision.correction.CalibratedCorrection`)."""

    def fit(self, name: str, layer: nn.Module, weight: Tensor, holder: Optional[nn.Module] = None) -> None: ...

    def skip(self, name: str, why: str) -> None: ...


def why_uncorrected(conv: nn.Module) -> Optional[str]:
    """Why the convolution ``conv`` (plain or quantized) gets no correction; ``None``: it gets one."""
    if isinstance(conv, torch_compat.ConvNd) and conv.transposed:
        return "a transposed convolution: its stored matrix is no map of input patches, no statistics to fit on"
    groups = cast(int, getattr(conv, "groups", 1))
    if groups > 1:
        return (f"a grouped or depthwise convolution (groups={groups}): each group multiplies its own channels, "
                "which a low-rank term of the whole weight matrix does not fit (not written)")  # fmt: skip
    return None


def is_conv(layer: nn.Module) -> bool:
    """Whether ``layer`` is of the convolution kind (``nn.Conv1d/2d/3d``, quantized or not; not transposed)."""
    return kind_of(layer) is CONV


def correct_conv(correct: Correct, name: str, conv: nn.Module, weight: Tensor) -> None:
    """Give the quantized convolution ``conv`` (built from ``weight``, its ``[out, in x kernel]`` matrix) its
    correction, or record why it gets none (module docstring)."""
    why = why_uncorrected(conv)
    storage = stored_in(conv)
    if why is not None or storage is None:
        correct.skip(name, why or "not stored by a precision mode")
        return
    correct.fit(name, storage, weight, holder=conv)


def conv_correction_bytes(conv: nn.Module, rank: int, dtype: torch.dtype) -> Optional[int]:
    """Bytes of the rank-``rank`` factors the convolution ``conv`` would carry (``None``: it gets none)."""
    if why_uncorrected(conv) is not None:
        return None
    in_features, out_features = cast(tuple[int, int], CONV.features(conv))  # type: ignore[misc]
    return min(rank, out_features, in_features) * (in_features + out_features) * storage_dtype(dtype).itemsize


__all__ = ["conv_correction_bytes", "correct_conv", "is_conv", "why_uncorrected"]
