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

The experts of a mixture of experts (``LinearExperts``, made after the probe forward) are each rounded on the Hessian
of the tokens its router sent it on the probe (:mod:`~lightning_hbm.precision.expert_inputs`, the statistics the
correction fits on); an expert routed fewer than :data:`EXPERT_MIN_TOKENS` keeps nearest rounding, named at the
surgery. On trained tiny Qwen3-MoEs, with a 2048-token probe, the MoE blocks' held-out output error went 0.038 -> 0.0055
and 0.032 -> 0.0037 (experts 64 wide, two seeds), 0.033 -> 0.0023 and 0.028 -> 0.0016 (256 wide); with experts 32
wide, whose error sits in a few ``down_proj`` inputs with a dominant channel, +7.8 % and -1.7 %
(``benchmarks/moe_expert_gptq.py``, benchmarks/README.md "GPTQ on the experts").

A Linear the model never calls but whose weight its code multiplies with (torchvision Swin's attention passes
``self.qkv.weight`` to ``F.linear``) is rounded from the inputs of those reads (:class:`_ReadInputs`): on a Swin-like
model the held-out logit error of nf4-dq + GPTQ went 0.178 -> 0.049 (0.162 -> 0.016 with a rank-16 correction,
``benchmarks/read_layer_rounding.py``). Under DDP / FSDP every rank rounds from the statistics of all ranks' probes
(:func:`pooled_across_ranks`): the copies (shards) of a weight are one process's rounding of the same rows. A quantized
layer left rounded to nearest (a mode without a code grid, a transposed convolution, a layer the probe never ran) is
named at the surgery with the reason and the fix (:func:`nearest_warning`).

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
from collections.abc import Collection, Mapping, Sequence
from contextlib import nullcontext
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers import stored_in
from lightning_hbm.layers.read_weight import op_name, served_reader, swaps_the_two_dims
from lightning_hbm.naming import name_list
from lightning_hbm.precision.expert_inputs import ExpertInputs
from lightning_hbm.precision.registry import RoundingGrid, format_of
from lightning_hbm.probe import eval_no_grad, probe_output

log = logging.getLogger(__name__)

#: ``QuantizedPrecision(rounding=...)`` values
ROUNDINGS = ("nearest", "gptq")
#: the damping added to ``diag(H)``, as a fraction of its mean: 0.1 generalized better than GPTQ's 0.01
#: from 32 probe sentences to held-out ones on all-MiniLM-L6-v2 (0.98600 vs 0.98254)
DAMP = 0.1


#: the probe tokens an expert's Linear must be routed to be GPTQ-rounded (fewer: nearest, named). An expert's tokens are
#: the router's choice, often few, and its Hessian then of low rank: on trained tiny Qwen3-MoEs whose experts GPTQ helps
#: (64 and 256 wide, two seeds, probes of 64-2048 tokens) every expert Linear routed 4 or more probe tokens had at most
#: 0.54 of nearest rounding's held-out output error; with 2-3 tokens up to 0.90, with one up to 1.20 (worse than
#: nearest) (``benchmarks/moe_expert_gptq.py``, benchmarks/README.md "GPTQ on the experts"; no real MoE measured)
EXPERT_MIN_TOKENS = 4


def grid_of(layer: nn.Module) -> Optional[RoundingGrid]:
    """The code grid of ``layer``'s format, ``None`` if its format has none (or it is not a quantized layer).

    A layer kind that wraps the mode's layer (a convolution, a Linear whose weight is read directly or computed in
    fp32) answers for its storage: the grid its GPTQ rounding wrote, which the resume CRC (:func:`digest`) covers.
    """
    storage = stored_in(layer) or layer
    fmt = format_of(storage)
    return None if fmt is None else fmt.rounding_grid(storage)


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


def input_statistics(
    module: nn.Module, names: Sequence[str], probe: Any, experts: Optional[Mapping[str, nn.Module]] = None
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """:func:`input_hessians` and ``name -> rows`` (the input rows, tokens, each matrix was summed over): the
    calibrated correction (:mod:`lightning_hbm.precision.correction`) refuses a probe with fewer rows than its rank.

    A layer the model never calls but whose weight its code multiplies with (torchvision Swin's ``F.linear(x,
    self.qkv.weight)``, Mamba's ``self.dt_proj.weight @ x``: stored as a
    :class:`~lightning_hbm.layers.read_weight.ReadableLinear`, whose reads call the layer) gets the inputs of those
    reads (:class:`_ReadInputs`), so it is GPTQ-rounded and corrected like any Linear. A transposed convolution gets
    none (its stored matrix is no linear map of input patches). Under a process group of 2 or more ranks the
    statistics are those of all ranks' probes together (:func:`pooled_across_ranks`; a collective). ``experts``
    (``{name: transformers experts layer}``, the calibrated correction's): each expert's projections get the inputs of
    the tokens routed to it, under the names of ``LinearExperts``' Linears (:class:`~lightning_hbm.precision.expert_inputs.ExpertInputs`).
    """
    sums = _Sums()
    routed = ExpertInputs(experts or {}, sums.add)  # records while open; the experts never reached get zero rows at its close
    layers = {name: module.get_submodule(name) for name in names}
    measured = {name: layer for name, layer in layers.items() if not _transposed_conv(layer)}
    handles = [layer.register_forward_hook(sums.hook(name)) for name, layer in measured.items()]
    # only the layers the probe step saw read and that will serve their reads (the others stay in the compute dtype)
    read = {name: layer for name, layer in measured.items() if isinstance(layer, nn.Linear) and served_reader(layer) is not None}
    reads = _ReadInputs(read, sums) if read else None
    try:
        with eval_no_grad(module), reads if reads is not None else nullcontext(), routed:
            probe_output(module, probe)
    finally:
        for handle in handles:
            handle.remove()
        if reads is not None:
            reads.close()
    hessians, rows = sums.normalized()
    rows = pooled_across_ranks(hessians, rows)  # before the check below: every rank decides on the same figures
    # of the layers ``names``: an expert's rows are the tokens routed to it (few by design), and GPTQ and the correction
    # each name the experts they leave out for too few (GPTQRounding.measured, CalibratedCorrection.measured)
    short = {name: (count, hessians[name].shape[-1]) for name, count in rows.items() if count < hessians[name].shape[-1] and name in layers}
    if short:
        # fewer input rows than inputs: H is singular, and GPTQ fits the probe instead of the layer (SmolLM2-135M
        # with 128 probe tokens for 576-1536 inputs: probe output cosine 0.997, held-out 0.984)
        log.warning(
            "lightning_hbm: GPTQ / correction statistics from fewer probe rows (tokens) than inputs for %d layers, e.g. %s "
            "(rows, inputs; a convolution's rows are its input patches): the rounding and the calibrated correction will "
            "fit the probe more than the data. Pass a probe_batch with at least %d tokens (or patches).",
            len(short), dict(list(short.items())[:3]), max(inputs for _, inputs in short.values()),
        )
    return hessians, rows


def _transposed_conv(layer: nn.Module) -> bool:
    # quantized or not (the quantized ones subclass these too)
    return isinstance(layer, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d))


class _Sums:
    """``name -> (X^T X, rows)`` summed over every call (or read) of each layer on the probe, in fp32 on the host."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[torch.Tensor, int]] = {}
        # the last input and its X^T X: q/k/v (gate/up) run one after the other on the same tensor and share
        # it. Held, not keyed by id(): a freed input's id can come back for another tensor.
        self.last: list[Any] = [None, None, None]

    def add(self, name: str, layer: nn.Module, x: torch.Tensor) -> None:
        """``x``: what ``layer`` multiplies its weight with (its input; a convolution's: its input's patches)."""
        key = conv_geometry(layer)  # a convolution's inputs are its input's patches: same tensor, same geometry
        if self.last[0] is not x or self.last[1] != key:
            if key is None:
                rows = x.detach().reshape(-1, x.shape[-1]).float()
                # kept in host memory: a model's Hessians together outweigh its 4-bit weights (module docstring)
                self.last[:] = [x, key, ((rows.t() @ rows).cpu(), rows.shape[0])]
            else:
                self.last[:] = [x, key, patch_gram(layer, x.detach())]
        if name in self.sums:  # a layer called twice in one forward: both inputs count
            total, count = self.sums[name]
            self.sums[name] = (total + self.last[2][0], count + self.last[2][1])
        else:
            self.sums[name] = self.last[2]

    def hook(self, name: str) -> Any:
        def record(layer: nn.Module, args: tuple, output: Any) -> None:
            self.add(name, layer, args[0])

        return record

    def normalized(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """``(name -> 2 X^T X / rows, name -> rows)``; layers that shared their sums share the matrix."""
        self.last = [None, None, None]
        shared: dict[int, torch.Tensor] = {}
        for total, count in self.sums.values():
            shared.setdefault(id(total), 2 * total / max(count, 1))
        return {name: shared[id(total)] for name, (total, _) in self.sums.items()}, {name: count for name, (_, count) in self.sums.items()}


# what a model's code does with a read weight: multiply (F.linear, x @ W.T, W @ y), or make another tensor of the
# same values (a transpose, a cast, a copy) that it multiplies with next
_PRODUCTS = frozenset({"linear", "matmul", "__matmul__", "mm", "bmm"})
_TRANSPOSES = frozenset({"t", "T", "mT", "transpose", "permute"})
_SAME_VALUES = frozenset({"detach", "data", "to", "contiguous", "clone", "float", "half", "bfloat16", "type_as"})


class _ReadInputs(TorchFunctionMode):
    """The inputs of the Linears ``layers`` where the model's code multiplies with their weight instead of calling
    them, summed into ``sums`` as a call's input is.

    Run on the model as built (the probe forward comes before any change): each weight is the layer's own Parameter,
    recognised by identity, as are the tensors made from it by a transpose or a cast (held until :meth:`close`:
    their ids are not reused meanwhile). A use inside the layer's own forward is that call (its forward hook counts
    it). The products a :class:`~lightning_hbm.layers.read_weight.ReadWeight` serves by calling the layer are the
    ones counted, so the statistics are of the inputs the stored layer will see.
    """

    def __init__(self, layers: Mapping[str, nn.Module], sums: _Sums) -> None:
        super().__init__()
        self.sums = sums
        # id -> (tensor, name, layer, transposed)
        self.watched: dict[int, tuple[torch.Tensor, str, nn.Module, bool]] = {
            id(layer.weight): (cast(torch.Tensor, layer.weight), name, layer, False) for name, layer in layers.items()
        }
        self.running: set[int] = set()  # the watched layers whose own forward runs
        self.handles = [h for layer in layers.values() for h in (
            layer.register_forward_pre_hook(lambda m, args: self.running.add(id(m))),
            layer.register_forward_hook(lambda m, args, out: self.running.discard(id(m)), always_call=True),
        )]  # fmt: skip

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.watched.clear()

    def _seen(self, tensor: Any) -> Optional[tuple[str, nn.Module, bool]]:
        entry = self.watched.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if entry is None or entry[0] is not tensor or id(entry[2]) in self.running:
            return None
        return entry[1], entry[2], entry[3]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = op_name(func)
        if op in _PRODUCTS:
            self._product(op, args, kwargs)
        result = func(*args, **kwargs)
        seen = self._seen(args[0]) if args and isinstance(result, torch.Tensor) else None
        if seen is not None and (op in _SAME_VALUES or op in _TRANSPOSES and swaps_the_two_dims(op, args[1:], kwargs)):
            name, layer, transposed = seen
            self.watched[id(result)] = (result, name, layer, transposed != (op in _TRANSPOSES))
        return result

    def _product(self, op: str, args: tuple, kwargs: dict) -> None:
        if op == "linear":  # F.linear(x, W, b): x W^T
            x, weight = (args[0] if args else kwargs.get("input")), (args[1] if len(args) > 1 else kwargs.get("weight"))
            seen = self._seen(weight)
            if seen is not None and not seen[2] and isinstance(x, torch.Tensor):
                self.sums.add(seen[0], seen[1], x)
            return
        if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
            return
        left, right = args
        seen = self._seen(right)
        if seen is not None and seen[2] and left.dim() >= 1:  # x @ W^T
            self.sums.add(seen[0], seen[1], left)
            return
        seen = self._seen(left)
        if seen is not None and not seen[2] and right.dim() >= 2:  # W @ y = (y^T W^T)^T: the rows of y^T
            self.sums.add(seen[0], seen[1], right.transpose(-1, -2))


def pooled_across_ranks(hessians: dict[str, torch.Tensor], rows: dict[str, int]) -> dict[str, int]:
    """Under a process group of 2 or more ranks, every rank's statistics become those of all ranks' probes together
    (the row-weighted mean of each ``H``, in place), and the rows their sum; returned. Without this each rank fits its
    own factors from its own probe batches (a datamodule that shards its data per rank gives each rank other ones) and
    FSDP, which keeps each rank's shard of its own factors, would assemble a correction no rank fitted; and GPTQ would
    round each rank's rows of a weight from another ``H``, so the shards (or DDP's copies) would differ from a
    one-process rounding of the same samples. In place: shared matrices (q/k/v) stay shared.

    A collective: every rank calls it, with the same layers (the model and the surgery are the same on every rank).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return rows
    names = sorted(name for name in rows if name in hessians)
    # NCCL sends device tensors only; gloo (and MPI) host ones
    backend = str(dist.get_backend())
    accelerator = None if "gloo" in backend or "mpi" in backend else torch.accelerator.current_accelerator()
    wire = torch.device("cpu") if accelerator is None else torch.device(accelerator.type, torch.accelerator.current_device_index())
    counts = torch.tensor([rows[name] for name in names], dtype=torch.float64, device=wire)
    totals = counts.clone()
    dist.all_reduce(totals)
    done: set[int] = set()  # q/k/v (gate/up) share one tensor: pooled once
    for name, count, total in zip(names, counts.tolist(), totals.tolist()):
        tensor = hessians[name]
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        weighted = tensor.to(wire, torch.float64) * count
        dist.all_reduce(weighted)
        tensor.copy_((weighted / max(total, 1.0)).to(tensor.device, tensor.dtype))
    return {**rows, **{name: int(total) for name, total in zip(names, totals.tolist())}}


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


# why a quantized layer keeps nearest rounding under rounding="gptq", and what a user can do about it
_NO_GRID = ("its mode ({}) has no GPTQ code grid and rounds to nearest", "GPTQ rounds bitsandbytes' 4-bit modes and "
            "nf4-torchao; 8-bit modes lose little to nearest rounding; pick a 4-bit mode for them with layer_modes "
            "if their error matters")
_TRANSPOSED = ("a transposed convolution, whose stored matrix is no linear map of its input patches", "keep them in "
               "full precision with ignore_modules if their error matters")
_LOOKUP = ("an input embedding, a lookup with no input to round against", "nothing to do; quantize_embeddings=False "
           "keeps them in the compute dtype")
_UNREACHED = ("the probe forward never ran it (no input statistics)", "pass a probe_batch whose forward(batch) runs "
              "them, or keep them in full precision with ignore_modules")
_UNREAD = ("its weight is read directly by {}, and the probe forward never reached that read", _UNREACHED[1])
_NO_TOKEN = ("an expert the probe batch routed no token to", "a larger probe_batch reaches it")
_FEW_TOKENS = (f"an expert the probe batch routed fewer than {EXPERT_MIN_TOKENS} tokens to (too few to round against)", _NO_TOKEN[1])


def nearest_reasons(
    module: nn.Module, names: Sequence[str], hessians: Mapping[str, torch.Tensor], routed: Optional[Mapping[str, int]] = None
) -> dict[str, tuple[str, str]]:
    """``{layer: (why, fix)}`` for each quantized layer of ``names`` that ``rounding="gptq"`` left rounded to nearest
    (a layer kept unquantized is not one). ``routed``: ``{expert's Linear: probe tokens routed to it}``
    (:meth:`GPTQRounding.measured`)."""
    found: dict[str, tuple[str, str]] = {}
    routed = routed or {}
    for name in names:
        layer = module.get_submodule(name)
        storage = stored_in(layer) or layer
        fmt = format_of(storage)
        if fmt is None or grid_of(layer) is not None and name in hessians:
            continue  # not quantized (a plan's "none"), or rounded
        if isinstance(layer, nn.Embedding):
            if grid_of(layer) is not None:  # a 4-bit table: rounded to nearest where a Linear would not be
                found[name] = _LOOKUP
            # an 8-bit table (int8, the default's): GPTQ rounds no 8-bit layer, so nothing is lost to say
        elif grid_of(layer) is None:
            found[name] = (_NO_GRID[0].format(fmt.name), _NO_GRID[1])
        elif _transposed_conv(layer):
            found[name] = _TRANSPOSED
        elif served_reader(layer) is not None:
            found[name] = (_UNREAD[0].format(served_reader(layer) or "the model"), _UNREAD[1])
        elif name in routed:  # an expert the router (nearly) never chose on the probe
            found[name] = _NO_TOKEN if routed[name] == 0 else _FEW_TOKENS
        else:
            found[name] = _UNREACHED
    return found


def nearest_warning(
    module: nn.Module, names: Sequence[str], hessians: Mapping[str, torch.Tensor], routed: Optional[Mapping[str, int]] = None
) -> Optional[str]:
    """The warning at the surgery (fit start) naming the quantized layers of ``names`` that ``rounding="gptq"`` left
    rounded to nearest, by reason, with the fix; ``None`` if GPTQ rounded them all. ``routed``: as :func:`nearest_reasons`."""
    reasons: dict[tuple[str, str], list[str]] = {}
    for name, why in nearest_reasons(module, names, hessians, routed).items():
        reasons.setdefault(why, []).append(name)
    if not reasons:
        return None
    total = sum(len(n) for n in reasons.values())
    return (
        f"QuantizedPrecision(rounding='gptq'): {total} quantized layer(s) keep nearest rounding (more output error than "
        "GPTQ's): " + "; ".join(f"{name_list(found)}: {why} (fix: {fix})" for (why, fix), found in reasons.items()) + "."
    )


def digest(module: nn.Module, names: Sequence[str]) -> str:
    """A CRC32 of the packed 4-bit weights of ``names`` (what a resume must rebuild bit for bit)."""
    crc = 0
    for name in names:
        grid = grid_of(module.get_submodule(name))
        if grid is not None:
            crc = zlib.crc32(grid.packed.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return f"{crc:08x}"


def rounded_digest(module: nn.Module, names: Sequence[str]) -> tuple[list[str], str]:
    """The layers of ``names`` stored on a code grid (those GPTQ rounded) and their :func:`digest`, in one pass."""
    rounded, crc = [], 0
    for name in names:
        grid = grid_of(module.get_submodule(name))
        if grid is not None:
            rounded.append(name)
            crc = zlib.crc32(grid.packed.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return rounded, f"{crc:08x}"


DIGEST_KEY = "gptq_digest"  # the CRC of the GPTQ-rounded base, in the checkpoint's lightning_hbm part


class GPTQRounding:
    """The GPTQ rounding of one plan (``QuantizedPrecision(rounding="gptq")``).

    :attr:`hessians` set in the checks (:meth:`measured`, from ``Measures.measure_model``: one probe forward, every
    target's input statistics and each expert's), then :meth:`finish` after the
    quantization rounded the layers with them (frees them, takes the CRC of the rounded weights and compares it with
    the one of the checkpoint being resumed), :meth:`save` with each checkpoint.
    """

    def __init__(self) -> None:
        #: ``{layer name: 2 X^T X}`` on the probe (measured in the checks, freed after the quantization)
        self.hessians: Optional[dict[str, torch.Tensor]] = None
        #: CRC32 of the GPTQ-rounded 4-bit weights (saved with checkpoints, compared on resume)
        self.digest: Optional[str] = None
        #: ``{expert's Linear: probe tokens routed to it}`` of the surgery under way (:meth:`measured`)
        self.routed: dict[str, int] = {}

    def measured(self, hessians: Mapping[str, torch.Tensor], rows: Mapping[str, int], experts: Collection[str] = ()) -> None:
        """Keep the input statistics of the probe forward (:func:`input_statistics`) to round with. ``experts``: the
        names of the experts' Linears, whose rows are the tokens the router sent them: one routed fewer than
        :data:`EXPERT_MIN_TOKENS` keeps nearest rounding (named at :meth:`finish`), never an error."""
        self.routed = {name: rows.get(name, 0) for name in experts}
        self.hessians = {name: h for name, h in hessians.items() if self.routed.get(name, EXPERT_MIN_TOKENS) >= EXPERT_MIN_TOKENS}

    def finish(self, module: nn.Module, quantized: Sequence[str], layer_modes: Optional[dict[str, str]], saved: Optional[str]) -> None:
        """After the quantization of ``quantized``: log what was rounded, keep its CRC, check it against ``saved`` (the CRC
        of the checkpoint being resumed, ``None``: none).

        Raises:
            ValueError: the checkpoint being resumed was trained on a base rounded otherwise (another probe batch).
        """
        hessians, routed = self.hessians or {}, self.routed
        self.hessians, self.routed = None, {}  # in_features**2 floats per layer input: not kept for training
        rounded, self.digest = rounded_digest(module, [n for n in quantized if n in hessians])  # one pass: which, and their CRC
        warning = nearest_warning(module, [n for n in quantized if n not in rounded and (layer_modes or {}).get(n) != "none"], hessians, routed)
        log.info("lightning_hbm: GPTQ rounding of %d 4-bit layers on the probe batch (CRC %s)", len(rounded), self.digest)
        if warning is not None:  # nothing silent: by name, reason and fix
            rank_zero_warn(warning)
        if saved is not None and saved != self.digest:
            raise ValueError(
                f"The GPTQ rounding rebuilt for this resume (CRC {self.digest}) differs from the one the "
                f"checkpoint was trained with (CRC {saved}): the probe batch differs (or the weights on another device). "
                "Resume with the same probe_batch (or datamodule) as the run that saved it; nothing has been trained yet."
            )

    def save(self, meta: dict[str, Any]) -> None:
        """Into a checkpoint's lightning_hbm part: the CRC a resume compares its own rounding with."""
        if self.digest is not None:
            meta[DIGEST_KEY] = self.digest


__all__ = [
    "DAMP", "DIGEST_KEY", "EXPERT_MIN_TOKENS", "GPTQRounding", "rounded_digest", "ROUNDINGS", "conv_geometry", "digest", "gptq_indices", "gptq_round_", "grid_of", "input_hessians", "input_statistics",
    "nearest_reasons", "nearest_warning", "pack_indices", "patch_gram", "patches", "pooled_across_ranks",
]
