"""GPTQ rounding for 4-bit layers (bitsandbytes', torchao's NF4): the same bytes, less output error.

What it shrinks: nothing more; it spends the **parameters** term better. Plain bitsandbytes rounds
every weight to the nearest of the 16 NF4 (or FP4) values of its block. GPTQ (Frantar et al., 2022)
rounds the columns of a weight one after the other and moves each rounding error onto the columns
not yet rounded, weighted by the inverse of ``H = 2 X^T X`` (``X``: the layer's inputs on a probe
batch), so that the errors cancel in ``W X`` instead of adding up. The result is stored in
bitsandbytes' own format: the same packed 4-bit indices (two per byte, high nibble first), the same
block absmax and double-quantized constants that ``quantize_4bit`` computed, so peft's QLoRA layers,
the checkpoint format and every byte figure are unchanged. Only the indices differ. Which layers can be
rounded so, and on which grid, is their format's answer (:meth:`QuantFormat.rounding_grid
<lightning_hbm.precision.registry.QuantFormat.rounding_grid>`): bitsandbytes' 4-bit modes and ``nf4-torchao``.

A convolution is rounded as the Linear it is over its input's patches (im2col, :func:`patches`): its ``H`` is
``2 P^T P`` of the probe's patches, one per group for a grouped or depthwise convolution (each group multiplies its
own channels); transposed convolutions keep nearest rounding. Measured on four conv nets with calibrated BatchNorm
statistics (``benchmarks/conv_gptq.py``): uniform nf4-dq ResNet18 0.912 -> 0.956 held-out output cosine; on a
4-image probe the late layers get fewer patches than inputs and GPTQ fits the probe (0.976 there), which is why a
plan measures convolutions rounded to nearest (:func:`~lightning_hbm.precision.sensitivity.measured_rounded`).

Measured on all-MiniLM-L6-v2 (``benchmarks/README.md``): held-out embedding cosine of uniform
``nf4-dq`` 0.97356 with nearest rounding, 0.98600 with this rounding (32 probe sentences), at 0.5196
bytes per parameter both.

Why written here: torchao 0.18's ``prototype.gptq`` writes its own int4/int8/NVFP4 tensors
(``Int4WeightOnlyConfig`` needs the ``mslk`` kernels), not bitsandbytes' NF4 storage that peft's
QLoRA layers read; bitsandbytes has no GPTQ. The algorithm is the reference one (lazy batches of
128 columns, Cholesky of the damped inverse Hessian, columns in decreasing order of ``diag(H)``),
with fixed block scales: bitsandbytes' absmax of the original weight, so a block's largest weight
keeps its exact value and the stored format stays bitsandbytes' own.

Cost: one forward of the probe batch, then per layer a Cholesky factorization and one pass over its
columns. Memory: the Hessians, ``in_features**2`` fp32 each (shared by layers that read the same input:
q/k/v, gate/up), all held at once in host memory until the layers are rounded. On a Llama-3-8B shape
that is 32 x (3 x 4096**2 + 14336**2) x 4 B = 30.5 GiB of host RAM (computed, not run): planned for
small and medium models; a block-by-block pass would bound it and is not written.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Sequence
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.precision.registry import RoundingGrid, format_of
from lightning_hbm.probe import eval_no_grad, probe_output

log = logging.getLogger(__name__)

#: ``QuantizedPrecision(rounding=...)`` values
ROUNDINGS = ("nearest", "gptq")
#: the damping added to ``diag(H)``, as a fraction of its mean: 0.1 generalized better than GPTQ's 0.01
#: from 32 probe sentences to held-out ones on all-MiniLM-L6-v2 (0.98600 vs 0.98254)
DAMP = 0.1


def grid_of(layer: nn.Module) -> Optional[RoundingGrid]:
    """The code grid of ``layer``'s format, ``None`` if its format has none (or it is not a quantized layer)."""
    fmt = format_of(layer)
    return None if fmt is None else fmt.rounding_grid(layer)


def conv_geometry(layer: nn.Module) -> Optional[tuple]:
    """What a convolution's input patches depend on (``None``: not a convolution, its input rows are its inputs).
    Transposed convolutions are not covered (their stored matrix is not a linear map of input patches)."""
    if not isinstance(layer, torch_compat.ConvNd) or layer.transposed:
        return None
    return (layer.kernel_size, layer.stride, layer.dilation, layer._reversed_padding_repeated_twice, layer.padding_mode, layer.groups)


def patches(layer: torch_compat.ConvNd, x: torch.Tensor) -> torch.Tensor:
    """``[groups, rows, in / groups * kernel]``: the input patches each output position of ``layer`` multiplies with its
    weight matrix (im2col; the columns in the order of the weight's ``[out, in / groups, *kernel]`` layout)."""
    spatial = len(layer.kernel_size)
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    if any(layer._reversed_padding_repeated_twice):
        x = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
    if x.dim() == spatial + 1:  # unbatched
        x = x.unsqueeze(0)
    for d in range(spatial):  # each unfold appends that dimension's kernel positions
        k, dilation, stride = layer.kernel_size[d], layer.dilation[d], layer.stride[d]
        x = x.unfold(2 + d, (k - 1) * dilation + 1, stride)[..., ::dilation]
    batch, channels = x.shape[:2]
    # [B, C, *positions, *kernel] -> [B, *positions, C, *kernel] -> [groups, rows, C / groups * kernel]
    x = x.permute(0, *range(2, 2 + spatial), 1, *range(2 + spatial, 2 + 2 * spatial))
    x = x.reshape(-1, layer.groups, channels // layer.groups * math.prod(layer.kernel_size))
    return x.transpose(0, 1)


def patch_gram(layer: nn.Module, x: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, int]:
    """``(P^T P, rows)`` of the input patches ``P`` of the convolution ``layer`` (:func:`patches`), in fp32 on the host:
    ``[K, K]``, or ``[groups, K, K]`` for a grouped (depthwise) one, whose groups see different inputs. Summed over
    chunks of the batch (a 640-pixel image has 100k patches per layer)."""
    conv = cast(torch_compat.ConvNd, layer)
    total: Optional[torch.Tensor] = None
    count = 0
    samples = x if x.dim() == len(conv.kernel_size) + 2 else x.unsqueeze(0)
    step = max(1, chunk // max(1, math.prod(samples.shape[2:])))
    for start in range(0, samples.shape[0], step):
        cols = patches(conv, samples[start : start + step].float())
        gram = cols.transpose(1, 2) @ cols
        total = gram if total is None else total + gram
        count += cols.shape[1]
    assert total is not None
    return (total[0] if conv.groups == 1 else total).cpu(), count


def input_hessians(module: nn.Module, names: Sequence[str], probe: Any) -> dict[str, torch.Tensor]:
    """``name -> 2 X^T X / rows`` of each Linear's input ``X`` on ``probe``, in one forward (fp32).

    Layers reading the same input tensor (q/k/v, gate/up) share one matrix.
    """
    return input_statistics(module, names, probe)[0]


def input_statistics(module: nn.Module, names: Sequence[str], probe: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """:func:`input_hessians` and ``name -> rows`` (the input rows, tokens, each matrix was summed over): the
    calibrated correction (:mod:`lightning_hbm.precision.correction`) refuses a probe with fewer rows than its rank."""
    sums: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (X^T X, rows), summed over every call
    # the last input and its X^T X: q/k/v (gate/up) run one after the other on the same tensor and share
    # it. Held, not keyed by id(): a freed input's id can come back for another tensor.
    last: list[Any] = [None, None, None]

    def hook(name: str) -> Any:
        def record(layer: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            key = conv_geometry(layer)  # a convolution's inputs are its input's patches: same tensor, same geometry
            if last[0] is not x or last[1] != key:
                if key is None:
                    rows = x.detach().reshape(-1, x.shape[-1]).float()
                    # kept in host memory: a model's Hessians together outweigh its 4-bit weights (below)
                    last[:] = [x, key, ((rows.t() @ rows).cpu(), rows.shape[0])]
                else:
                    last[:] = [x, key, patch_gram(layer, x.detach())]
            if name in sums:  # a layer called twice in one forward: both inputs count
                total, count = sums[name]
                sums[name] = (total + last[2][0], count + last[2][1])
            else:
                sums[name] = last[2]

        return record

    handles = [module.get_submodule(name).register_forward_hook(hook(name)) for name in names]
    try:
        with eval_no_grad(module):
            probe_output(module, probe)
    finally:
        for handle in handles:
            handle.remove()
    normalized: dict[int, torch.Tensor] = {}  # shared sums stay shared
    for total, count in sums.values():
        normalized.setdefault(id(total), 2 * total / max(count, 1))
    short = {name: (count, total.shape[-1]) for name, (total, count) in sums.items() if count < total.shape[-1]}
    if short:
        # fewer input rows than inputs: H is singular, and GPTQ fits the probe instead of the layer (SmolLM2-135M
        # with 128 probe tokens for 576-1536 inputs: probe output cosine 0.997, held-out 0.984)
        log.warning(
            "lightning_hbm: GPTQ / correction statistics from fewer probe rows (tokens) than inputs for %d layers, e.g. %s "
            "(rows, inputs; a convolution's rows are its input patches): the rounding and the calibrated correction will "
            "fit the probe more than the data. Pass a probe_batch with at least %d tokens (or patches).",
            len(short), dict(list(short.items())[:3]), max(inputs for _, inputs in short.values()),
        )
    return {name: normalized[id(total)] for name, (total, _) in sums.items()}, {name: count for name, (_, count) in sums.items()}


def gptq_indices(weight: torch.Tensor, hessian: torch.Tensor, grid: RoundingGrid, damp: float = DAMP) -> torch.Tensor:
    """The 4-bit code index of every weight (``[out, in]``, int64), rounded by GPTQ with ``grid``'s fixed scales.

    ``hessian``: ``[in, in]``, or ``[groups, in, in]`` for a grouped convolution (its weight matrix's rows in
    ``groups`` consecutive slices, each multiplying its own inputs): each slice rounded with its own matrix, all at once.
    """
    code = grid.code.float().to(weight.device)
    out_features, in_features = weight.shape
    groups = 1 if hessian.dim() == 2 else hessian.shape[0]
    # blocks run over the flattened weight: one may span two rows when in_features is not a multiple
    absmax = grid.block_scales.float().to(weight.device)
    scale = absmax.repeat_interleave(grid.block_size)[: weight.numel()].reshape(groups, -1, in_features)
    hessian = hessian.to(weight.device, torch.float32).reshape(groups, in_features, in_features).clone()
    diagonal = hessian.diagonal(dim1=-2, dim2=-1)  # a view: written through below
    diagonal[diagonal == 0] = 1  # an input that is always zero on the probe: no information, no feedback
    order = torch.argsort(diagonal, dim=-1, descending=True, stable=True)  # GPTQ's act_order, per group
    columns = order[:, None, :].expand(-1, scale.shape[1], -1)
    w, scale = weight.float().reshape(groups, -1, in_features).gather(2, columns), scale.gather(2, columns)
    hessian = hessian.gather(1, order[:, :, None].expand_as(hessian)).gather(2, order[:, None, :].expand_as(hessian))
    hessian.diagonal(dim1=-2, dim2=-1).add_(damp * hessian.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True))
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    indices = torch.empty(w.shape, dtype=torch.long, device=weight.device)
    for start in range(0, in_features, 128):  # lazy batches: the feedback to later columns in one matmul
        end = min(start + 128, in_features)
        block, errors, inv = w[..., start:end].clone(), torch.zeros_like(w[..., start:end]), inverse[:, start:end, start:end]
        for i in range(end - start):
            column, s = block[..., i], scale[..., start + i]
            index = ((column / s)[..., None] - code).abs().argmin(-1)
            indices[..., start + i] = index
            error = (column - code[index] * s) / inv[:, i, i, None]
            block[..., i:] -= error[..., None] * inv[:, None, i, i:]
            errors[..., i] = error
        w[..., end:] -= errors @ inverse[:, start:end, end:]
    return torch.empty_like(indices).scatter_(2, columns, indices).reshape(out_features, in_features)


def pack_indices(indices: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' packed 4-bit layout: row-major, two indices per byte, the first in the high nibble
    (an odd count leaves the last low nibble 0)."""
    flat = indices.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8).reshape(-1, 1)


def gptq_round_(layer: nn.Module, weight: torch.Tensor, hessian: torch.Tensor) -> None:
    """Replace the packed indices of the 4-bit ``layer`` (quantized from ``weight``) by GPTQ's, in place."""
    grid = grid_of(layer)
    if grid is None:
        raise TypeError(f"GPTQ rounding: {type(layer).__name__} has no code grid (its format rounds to nearest only).")
    packed = grid.packed
    rounded = pack_indices(gptq_indices(weight.detach().to(packed.device), hessian, grid))
    if weight.numel() % 2:  # the last byte's low nibble is bitsandbytes' padding: keep what it wrote
        rounded[-1] |= packed.reshape(-1)[-1:].view(torch.uint8) & 15
    packed.copy_(rounded.reshape(packed.shape).view(packed.dtype))


def digest(module: nn.Module, names: Sequence[str]) -> str:
    """A CRC32 of the packed 4-bit weights of ``names`` (what a resume must rebuild bit for bit)."""
    crc = 0
    for name in names:
        grid = grid_of(module.get_submodule(name))
        if grid is not None:
            crc = zlib.crc32(grid.packed.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


__all__ = ["DAMP", "ROUNDINGS", "conv_geometry", "digest", "gptq_indices", "gptq_round_", "grid_of", "input_hessians", "input_statistics", "pack_indices", "patch_gram", "patches"]
