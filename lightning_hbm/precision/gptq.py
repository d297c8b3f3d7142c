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
import zlib
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

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
    last: list[Any] = [None, None]

    def hook(name: str) -> Any:
        def record(layer: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            if last[0] is not x:
                rows = x.detach().reshape(-1, x.shape[-1]).float()
                # kept in host memory: a model's Hessians together outweigh its 4-bit weights (below)
                last[:] = [x, ((rows.t() @ rows).cpu(), rows.shape[0])]
            if name in sums:  # a layer called twice in one forward: both inputs count
                total, count = sums[name]
                sums[name] = (total + last[1][0], count + last[1][1])
            else:
                sums[name] = last[1]

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
    short = {name: (count, total.shape[0]) for name, (total, count) in sums.items() if count < total.shape[0]}
    if short:
        # fewer input rows than inputs: H is singular, and GPTQ fits the probe instead of the layer (SmolLM2-135M
        # with 128 probe tokens for 576-1536 inputs: probe output cosine 0.997, held-out 0.984)
        log.warning(
            "lightning_hbm: GPTQ / correction statistics from fewer probe rows (tokens) than inputs for %d layers, e.g. %s "
            "(rows, inputs): the rounding and the calibrated correction will fit the probe more than the data. Pass a "
            "probe_batch with at least %d tokens.",
            len(short), dict(list(short.items())[:3]), max(inputs for _, inputs in short.values()),
        )
    return {name: normalized[id(total)] for name, (total, _) in sums.items()}, {name: count for name, (_, count) in sums.items()}


def gptq_indices(weight: torch.Tensor, hessian: torch.Tensor, grid: RoundingGrid, damp: float = DAMP) -> torch.Tensor:
    """The 4-bit code index of every weight (``[out, in]``, int64), rounded by GPTQ with ``grid``'s fixed scales."""
    code = grid.code.float().to(weight.device)
    out_features, in_features = weight.shape
    # blocks run over the flattened weight: one may span two rows when in_features is not a multiple
    absmax = grid.block_scales.float().to(weight.device)
    scale = absmax.repeat_interleave(grid.block_size)[: weight.numel()].reshape(out_features, in_features)
    hessian = hessian.to(weight.device, torch.float32).clone()
    dead = hessian.diagonal() == 0  # an input that is always zero on the probe: no information, no feedback
    hessian[dead, dead] = 1
    order = torch.argsort(hessian.diagonal(), descending=True, stable=True)  # GPTQ's act_order
    w, hessian, scale = weight.float()[:, order].clone(), hessian[order][:, order], scale[:, order]
    hessian.diagonal().add_(damp * hessian.diagonal().mean())
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    indices = torch.empty(out_features, in_features, dtype=torch.long, device=weight.device)
    for start in range(0, in_features, 128):  # lazy batches: the feedback to later columns in one matmul
        end = min(start + 128, in_features)
        block, errors, inv = w[:, start:end].clone(), torch.zeros_like(w[:, start:end]), inverse[start:end, start:end]
        for i in range(end - start):
            column, s = block[:, i], scale[:, start + i]
            index = ((column / s)[:, None] - code[None]).abs().argmin(1)
            indices[:, start + i] = index
            error = (column - code[index] * s) / inv[i, i]
            block[:, i:] -= error[:, None] * inv[i, i:][None]
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    return indices[:, torch.argsort(order)]


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


__all__ = ["DAMP", "ROUNDINGS", "digest", "gptq_indices", "gptq_round_", "grid_of", "input_hessians", "input_statistics", "pack_indices"]
