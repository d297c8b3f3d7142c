"""Sensitivity-aware mixed precision: which Linear (and conv) layers to store in a wider mode under a byte budget.

What it shrinks: the **parameters** term, at a chosen quality. Quantizing every Linear the same
way gives exactly the quality of plain bitsandbytes; on pretrained models a few layers carry most
of the error. This module measures, on a probe batch, what each layer's quantization costs at the
model's *output* (the metric :class:`~lightning_hbm.QuantizationQuality` logs: mean cosine
similarity of output rows), then chooses per layer between the base mode (e.g. ``nf4-dq``) and
wider modes (``sensitive_mode``; by default for ``nf4-dq`` its 32-weight blocks ``nf4-dq-b32`` at
+0.016 B/param and ``int8`` at about +0.49) so as to meet a byte budget (``max_bytes_per_param``)
and/or a quality target (``min_cosine``).

How it chooses:

1. sensitivity: one forward of the probe batch per layer, with only that layer in the base mode:
   the end-to-end error it causes alone (weight SQNR, or a layer's own output error, misses how
   much of it reaches the output);
2. the other modes of each layer: one forward with hooks measures how much each mode shrinks the
   layer's own output error on its real probe input; the layer's end-to-end error is scaled by
   that ratio (blocks of 32 cut a layer's error by ~20 % for 3 % more bytes, int8 by ~98 % for
   twice the bytes);
3. the choice is a multiple-choice knapsack: each layer's modes on the lower convex hull of
   (bytes, error), moves taken best error removed per byte first (every prefix is the best choice
   for its bytes if errors add up). Under a budget the moves that fit are taken; with
   ``min_cosine`` the cheapest prefix that measures at the target (binary search, a forward each);
4. under a byte budget, the plain ranking by error alone in int8 (the issue's baseline) is
   measured too and kept if it is better on the probe.

Cost: one probe forward per Linear plus about four, on the model as built (layers are swapped in
and back; nothing stays changed).

The choice is a ``{layer name: mode name}`` map (``layer_modes``); :func:`predict_parameter_bytes` turns it into the
exact parameter bytes of the quantized model (what :func:`lightning_hbm.memory.parameter_bytes`
measures afterwards), for a planner to call before any quantization.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers import LayerKind, kind_of
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.gptq import gptq_round_, grid_of
from lightning_hbm.precision.read_layers import read_local_errors, swapped_copy
from lightning_hbm.precision.registry import get_format, to_dtype
from lightning_hbm.probe import Probe, compare_outputs, eval_no_grad
from lightning_hbm.probe_record import Call, Selection, agreeing_calls, diverging, recording_selections

#: ``sensitive_mode`` (and plan entry) that keeps a layer unquantized in the compute dtype, frozen.
UNQUANTIZED = "none"

#: the probe output cosine the convolutions of a model stored in a 4-bit mode are chosen to (issue 53: a conv net
#: with BatchNorm statistics like a trained network's loses far more than a transformer does: ResNet18 0.91,
#: EfficientNet-B0 0.59, a YOLO-style detector 0.10 in nf4-dq); a choice under it is a warning naming the figure
CONV_MIN_COSINE = 0.98

#: the probe output cosine the convolutions' modes are chosen to by default (formerly ``CONV_PLAN_TARGET``): above
#: :data:`CONV_MIN_COSINE`, because the choice stops at the first set of modes that measures its target on the probe it
#: was chosen on, and held out the same modes measured 0.002-0.02 less (issue 53, ``benchmarks/conv_default.py``, four
#: BatchNorm conv nets, two seeds: chosen to 0.98, 0.9605-0.9785 held out; chosen to 0.985, ResNet18 0.982 on both seeds at 0.567 bytes per conv weight)
CONV_TARGET_COSINE = 0.985


def unmeasured_convs_warning(module: nn.Module, names: Sequence[str], mode: str) -> Optional[str]:
    """The fit-start warning for convolutions stored in the 4-bit ``mode`` with no probe batch to choose their modes on (a
    ``trainer.validate`` of a model with no train dataloader, without ``probe_batch``), or ``None``.

    Said for a model with BatchNorm layers, where the loss was measured: with statistics like a trained network's,
    uniform 4-bit convolutions collapse the output (issue 53; ``benchmarks/conv_default.py``, the library's default
    on four conv nets, held-out centred cosine: ResNet18 0.91, EfficientNet-B0 0.59-0.72, a YOLO-style detector
    0.10-0.20, a MobileNetV3-FPN backbone 0.24-0.38). Without BatchNorm the measured loss is smaller (a UNet or Wav2Vec2
    0.96, a ViT's single patch embedding less): not this warning; the fit-start accuracy check says that it measured
    nothing (:func:`~lightning_hbm.precision.accuracy.unmeasured_reference_warning`, session 27; was a log line).
    """
    if not names or not _has_batchnorm(module):
        return None
    return (
        f"lightning_hbm: the {len(names)} convolutions of this BatchNorm conv net are stored in {mode} without a "
        "measured plan: no probe batch (no QuantizedPrecision(probe_batch=...) and no train dataloader to draw one from). "
        "With BatchNorm statistics like a trained network's, uniform 4-bit convolutions lose much of the output "
        "(measured, held-out output cosine against the unquantized model: ResNet18 0.91, EfficientNet-B0 0.59, a "
        f"YOLO-style detector 0.10; the planned convolutions reach {CONV_TARGET_COSINE} on the probe at 0.57-0.95 "
        "bytes per conv weight, 0.960-0.982 held out). Fix: QuantizedPrecision(probe_batch=<one training batch>) or "
        "a train dataloader (trainer.fit(model, train_dataloaders=...)) to plan them, or QuantizedPrecision(mode='int8', dtype='float32') (held out "
        "0.989-0.9996 at about 1 byte per weight)."
    )


def _has_batchnorm(module: nn.Module) -> bool:
    return any(isinstance(m, torch_compat.BatchNormBase) for m in module.modules())


def widened_convs_warning(
    module: nn.Module, report: SensitivityReport, mode: str, target: float, threshold: Optional[float] = None
) -> Optional[str]:
    """The fit-start warning for a BatchNorm conv net whose convolutions' mode choice reached ``target`` on the probe batch
    only by widening some of them, or ``None`` (no BatchNorm, or uniform ``mode`` already at the target).

    The choice stops at the first set of modes that measures ``target`` on the probe it was chosen on; on images the
    probe never saw the same modes measured less (issue 53, the library's default on the four conv nets, two seeds each,
    ``benchmarks/conv_default.py``: chosen to 0.98, 0.9605-0.9785 held out; chosen to :data:`CONV_TARGET_COSINE`,
    0.9605-0.9822), so the model as trained may be under ``threshold`` (default: ``target``) on new data. The fix
    named is the one measured at 0.98 or more held out on all eight: ``int8`` computed in float32 (int8 in bfloat16
    0.974-0.9993). Said at the quantization only where the fit-start accuracy check neither warned nor measured at
    least 32 samples quiet (:attr:`~lightning_hbm.precision.accuracy.ConvAccuracy.quiet_on_enough`, session 36: there it fired on 12
    accurate models of 14 runs, the other 2 under 0.98 by 0.0003 at most).
    """
    if not _has_batchnorm(module) or report.uniform_cosine >= target or report.cosine < target:
        return None  # under the target the choice's own warning names the figure
    threshold = target if threshold is None else threshold
    return (
        f"lightning_hbm: the convolutions of this BatchNorm conv net are planned to a probe output cosine of "
        f"{report.cosine:.4f} (uniform {mode}: {report.uniform_cosine:.4f}) at {report.bytes_per_param:.3f} bytes per "
        f"conv weight, measured on the probe batch the plan was chosen on. On images the probe never saw, such plans "
        f"measured 0.976-0.982 (issue 53: ResNet18 0.982, EfficientNet-B0 0.976-0.978, a YOLO-style detector 0.977, "
        f"held out), around {threshold}. Fix for at least {threshold} on new data: QuantizedPrecision(mode='int8', "
        "dtype='float32') (held out 0.989-0.9996 at about 1 byte per weight; int8 in bfloat16 0.974-0.9993)."
    )


@lru_cache(maxsize=256)
def weight_bytes(mode: str, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """Exact bytes of one frozen ``Linear(in_features, out_features)`` weight stored in ``mode``.

    Quantization constants are included, the bias is not. Measured by quantizing a zero weight of
    that shape once on CPU (storage sizes depend on the shape only), so it is exact for every mode,
    registered ones included.
    """
    if mode == UNQUANTIZED:
        return in_features * out_features * dtype.itemsize
    with torch_compat.real_tensors():  # also under the planner's fake mode (session 38: plan() with a sensitivity plan failed)
        linear = nn.Linear(in_features, out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)
        return parameter_bytes(get_format(mode).replace(linear, dtype, torch.device("cpu")))


def predict_parameter_bytes(
    module: nn.Module, layer_modes: Optional[Mapping[str, str]] = None, dtype: Any = "bfloat16", *,
    plan: Optional[Mapping[str, str]] = None,
) -> int:
    """Parameter bytes of ``module`` once quantized with ``layer_modes`` (``{layer name: mode name}``, as
    ``QuantizedPrecision(layer_modes=...)`` takes), computed on the unquantized model.

    Every named layer's weight takes :func:`weight_bytes` of its mode; every other floating
    parameter (biases, embeddings, norms) is cast to ``dtype``, as ``QuantizedPrecision`` does.
    ``plan``: the former name of ``layer_modes`` (issue 54: "plan" names the planner's), accepted with a warning.
    """
    layer_modes = _layer_modes_argument(layer_modes, plan)
    dtype = to_dtype(dtype)
    quantized = {id(module.get_submodule(name).weight) for name in layer_modes}
    total = 0
    for param in module.parameters():  # deduplicated: a tied weight is counted once
        if id(param) not in quantized:
            total += param.numel() * (dtype.itemsize if param.is_floating_point() else param.element_size())
    for name, mode in layer_modes.items():
        layer = module.get_submodule(name)
        total += weight_bytes(mode, *cast(LayerKind, kind_of(layer)).features(layer), dtype)  # e.g. Conv1D stores [in, out]; a named layer has a kind
    return total


def _layer_modes_argument(layer_modes: Optional[Mapping[str, str]], plan: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    """``predict_parameter_bytes``'s ``layer_modes``, given under its former keyword ``plan`` (warned) or its own."""
    if plan is not None:
        if layer_modes is not None:
            raise TypeError(
                "predict_parameter_bytes(layer_modes=..., plan=...): plan is the former name of layer_modes; pass the "
                "{layer name: mode name} dict once, as layer_modes."
            )
        warnings.warn(
            "predict_parameter_bytes(plan=...) is deprecated: pass layer_modes=... (the same {layer name: mode name} dict).",
            DeprecationWarning,
            stacklevel=3,
        )
        return plan
    if layer_modes is None:
        raise TypeError(
            "predict_parameter_bytes() needs layer_modes, the {layer name: mode name} dict of the layers to quantize "
            "(e.g. {'fc1': 'nf4'}; {} for none)."
        )
    return layer_modes


@dataclass
class SensitivityReport:
    """The chosen per-layer modes and what was measured to choose them (probe-batch figures); formerly
    ``SensitivityPlan`` ("plan" names the planner's)."""

    modes: dict[str, str]
    #: output cosine with every layer in the base mode ("before") and with the plan ("after")
    uniform_cosine: float
    cosine: float
    #: bytes of the quantizable weights per quantizable parameter: uniform base mode, and the plan
    uniform_bytes_per_param: float
    bytes_per_param: float
    #: ``name -> 1 - cosine`` with only that layer quantized in the base mode (its sensitivity)
    solo_error: dict[str, float] = field(default_factory=dict)
    #: the module whose output the figures measure, where the model's own output changed shape (a detector's boxes
    #: after score thresholding and NMS: :meth:`_Swapper.measuring_point`); ``None``: the model's output
    measured_at: Optional[str] = None

    def summary(self, base: str) -> str:
        counts = Counter(self.modes.values())
        wider = {mode: sorted(n for n, m in self.modes.items() if m == mode) for mode in counts if mode != base}
        split = ", ".join(f"{counts[mode]} in {mode}" for mode in sorted(wider)) or "none in a wider mode"
        return (
            f"{split}, the other {counts[base]} of {len(self.modes)} Linear layers in {base}: "
            f"{self.bytes_per_param:.4f} B/param (uniform {base}: {self.uniform_bytes_per_param:.4f}); probe output "
            f"cosine {self.uniform_cosine:.5f} -> {self.cosine:.5f}. Wider layers: {wider}"
        )


def measured_rounded(kind: LayerKind) -> bool:
    """Whether a plan measures a layer of ``kind`` GPTQ-rounded (``rounding="gptq"``), as it will be stored; if not,
    rounded to nearest, and stored GPTQ-rounded all the same.

    Convolutions are measured rounded to nearest: a conv net's probe gives its late layers far fewer patches than
    inputs (4 images of 64 px: 16 rows for ResNet18's 4608-input convolutions), so GPTQ fits the probe and the plan,
    measured rounded, stops at the probe target while images the probe never saw lose much more (issue 53: the
    YOLO-style detector 0.98 on the probe, 0.75 held out, at 0.55 B; ResNet18 0.956). Measured to nearest (the plan of
    ``rounding="nearest"``) and stored rounded, the held-out cosine is the nearest plan's or better at its bytes
    (ResNet18 0.976 -> 0.982; benchmarks/conv_gptq.py).
    """
    return kind.wrap is None


class _Swapper:
    """Puts quantized copies of chosen layers into the model of ``probe`` for one probe forward, then the originals
    back."""

    def __init__(
        self, probe: Probe, layers: Mapping[str, nn.Module], dtype: torch.dtype, hessians: Optional[Mapping[str, torch.Tensor]] = None
    ) -> None:
        self.probe, self.module, self.layers, self.dtype, self.hessians = probe, probe.module, layers, dtype, hessians or {}
        self._variants: dict[tuple[str, str], nn.Module] = {}
        # every probe forward draws what the first drew (a forward that draws noise, a diffusion training step, was
        # measured against other draws: 0.03 and every convolution widened), and the user's RNGs are left as they were
        self.rngs = torch_compat.rng_states()
        #: the module whose output is measured instead of the model's (:meth:`measuring_point`); ``None``: the model's
        self.tap: Optional[str] = None
        self.built = {name for name, _ in self.module.named_modules()}

    def forward(self) -> torch.Tensor:
        """The model's output on the probe batch (or the :attr:`tap`'s, each sample's outputs one row) with the first
        forward's random draws."""
        with torch_compat.drawing_as(self.rngs):
            if self.tap is None:
                return self.probe.output()
            taken: list[Any] = []
            handle = self.module.get_submodule(self.tap).register_forward_hook(lambda m, a, out: taken.append(out))
            try:
                self.probe.forward()
            finally:
                handle.remove()
            leaves = [t for t in tree_flatten(taken[0])[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            rows = len({t.shape[0] if t.dim() else 0 for t in leaves}) == 1 and leaves[0].dim() > 0
            return torch.cat([t.reshape(t.shape[0], -1) if rows else t.reshape(1, -1) for t in leaves], 1)

    def measuring_point(self, names: Sequence[str], base: str, reference: torch.Tensor) -> torch.Tensor:
        """The reference output to plan on. A model whose output changes shape with its layers in ``base`` (a detector's
        boxes after score thresholding and NMS: a number that depends on the scores), or whose data-dependent selections
        (sort, top-k, a boolean mask, NMS: :func:`~lightning_hbm.probe_record.recording_selections`) pick otherwise (the same
        number of boxes, other ones or in another order), is measured at the outputs of the last module call before the
        first whose outputs change shape or the first selection that differs (the heads, before the post-processing);
        every candidate is then measured there. Cost: one forward more for a model that selects, two when it is tapped.

        Raises:
            ValueError: the output changes or selects otherwise and no module's output before that keeps its shape.
        """
        want: list[Call] = []
        got: list[Call] = []
        picked: list[Selection] = []
        uniform = self.output({name: base for name in names}, got, picked)
        if uniform.shape == reference.shape and not picked:
            return reference
        as_built: list[Selection] = []
        self.output({}, want, as_built)
        diverged = diverging(as_built, picked)
        if uniform.shape == reference.shape and diverged is None:
            return reference
        cut = diverged[0] if diverged is not None else len(want)
        agreeing = [call for call, _ in agreeing_calls(want[:cut], got[:cut]) if call.key[0]]
        if not agreeing:
            how = f"{diverged[1]}" if diverged is not None else "post-processing that keeps a score-dependent number of boxes or masks"
            raise ValueError(
                f"the model's output changes with its layers in {base} ({list(reference.shape)} as built, {list(uniform.shape)}: "
                f"{how}) and no module's output before that keeps its shape; QuantizedPrecision(accuracy_at=<the heads' module>) names one"
            )
        self.tap = agreeing[-1].key[0]  # the last to return: the closest to the output
        return self.output({})

    def variant(self, name: str, mode: str, keep: bool = True) -> nn.Module:
        """``name`` quantized in ``mode``; ``keep=False``: built for one use, not cached (every layer's
        variant in every mode at once would hold about the model's bf16 size again)."""
        if mode == UNQUANTIZED:
            return self.layers[name]  # the probe runs the model as built: unquantized is the reference
        key = (name, mode)
        if key not in self._variants:
            layer, kind = self.layers[name], cast(LayerKind, kind_of(self.layers[name]))
            linear = cast(nn.Linear, layer if kind.wrap is None else cast(Any, kind.to_linear)(layer))  # a conv: its weight matrix
            # a copy holding a clone of the bias: bitsandbytes casts its layer's bias in place at the first
            # forward, and the mode's replace() shares the bias with the model's own Linear
            source = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            source.weight = linear.weight
            if linear.bias is not None:
                source.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
            fmt = get_format(mode)
            quantized = fmt.replace(source, self.dtype, None)
            if name in self.hessians and grid_of(quantized) is not None and measured_rounded(kind):
                gptq_round_(quantized, linear.weight, self.hessians[name])  # measured as it will be stored
            if kind.wrap is not None:  # a convolution around the stored matrix, its bias copied in the compute dtype
                quantized = kind.wrap(layer, quantized, fmt.dequantize, self.dtype)
                if layer.bias is not None:
                    quantized.bias = nn.Parameter(cast(torch.Tensor, layer.bias).detach().to(self.dtype), requires_grad=False)
            # eval, as the probe model: bitsandbytes' int8 layer computes LLM.int8 (8-bit activations) in eval and
            # a float matmul of its dequantized weight when training on CPU (on GPU always LLM.int8)
            # a layer whose weight the model's code reads (Swin's qkv): a copy serving reads (precision/read_layers.py)
            variant = swapped_copy(layer, source, quantized, self.dtype)
            if not keep:
                return variant
            self._variants[key] = variant
        return self._variants[key]

    def _put(self, name: str, layer: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        setattr(self.module.get_submodule(parent_name) if parent_name else self.module, child, layer)

    def output(self, choice: Mapping[str, str], calls: Optional[list[Call]] = None, selections: Optional[list[Selection]] = None) -> torch.Tensor:
        """The output with ``choice`` swapped in; ``calls``: filled with the calls of the modules of the model as built
        (a swapped layer under its name, not its own submodules), and ``selections`` with its data-dependent selections."""
        try:
            for name, mode in choice.items():
                self._put(name, self.variant(name, mode))
            with ExitStack() as stack:  # one forward call, its module calls and selections recorded when asked
                recorded = stack.enter_context(self.probe.recording_calls({n for n, _ in self.module.named_modules()} & self.built)) if calls is not None else None
                picked = stack.enter_context(recording_selections(recorded)) if recorded is not None else None
                output = self.forward().float()
            if calls is not None and recorded is not None:
                calls[:] = recorded
            if selections is not None and picked is not None:
                selections[:] = picked
            return output
        finally:
            for name in choice:
                self._put(name, self.layers[name])


def ladder(base: str, sensitive: Any) -> tuple[str, ...]:
    """The wider modes a layer may take instead of ``base``: ``sensitive`` as given, or ``"auto"``: the
    format's own ``ladder`` (``nf4-dq``: ``nf4-dq-b32``, ``int8``; int8 modes: ``none``)."""
    if sensitive == "auto":
        return get_format(base).ladder
    return (sensitive,) if isinstance(sensitive, str) else tuple(sensitive)


class BudgetError(ValueError):
    """A ``max_bytes_per_param`` no plan can meet (:func:`_check_budget`), told apart from a probe the model cannot run:
    the convolutions' plan stores them uniform and says so (session 42), the Linears' raises it."""


def _check_budget(
    max_bytes_per_param: Optional[float], uniform: float, widest: float, base: str, sensitive: Sequence[str],
    weights: int = 0, layers: int = 0, fixed: float = 0.0,
) -> None:
    if max_bytes_per_param is not None and max_bytes_per_param < uniform:
        # a model whose quantizable layers are few and tiny (a conv net's 32 x 5 head) pays each layer's fixed
        # constants over few weights: over a byte per weight in a 4-bit mode (session 39), said as the cause
        few = (f" These {layers} layers hold only {weights:,} weights, so each layer's fixed constants dominate; "
               "the budget counts these layers only." if uniform > 1.0 and layers else "")
        # the calibrated correction's factors are in the figure (stored beside every quantized layer), said with the fix
        corrected = (f" That includes the calibrated correction's factors (correction_rank), {fixed:.4f} bytes per parameter: "
                     "a smaller correction_rank leaves more of the budget to the weights." if fixed else "")
        raise BudgetError(
            f"max_bytes_per_param={max_bytes_per_param} cannot be met: storing every quantizable layer in {base!r} "
            f"already takes {uniform:.4f} bytes per parameter, the least reachable with this mode (every layer in "
            f"the widest of {list(sensitive)}: {widest:.4f}).{few}{corrected} Raise max_bytes_per_param to at least "
            f"{uniform:.4f}, or pick a smaller mode."
        )


def greedy_layer_modes(
    solo: Mapping[str, float], cost: Mapping[str, Mapping[str, int]], base: str, sensitive: str, budget: float
) -> tuple[dict[str, str], int]:
    """The baseline: the layers with the largest error alone in ``sensitive`` while ``budget`` bytes allow."""
    choice, used = {n: base for n in solo}, sum(c[base] for c in cost.values())
    for name in sorted(solo, key=lambda n: (-solo[n], n)):
        extra = cost[name][sensitive] - cost[name][base]
        if used + extra > budget:
            break
        choice[name], used = sensitive, used + extra
    return choice, used


def upgrade_moves(
    error: Mapping[str, Mapping[str, float]], cost: Mapping[str, Mapping[str, int]]
) -> list[tuple[str, str, int]]:
    """Every layer's steps up its lower convex hull of (bytes, error), best error removed per byte first.

    The classic greedy for a multiple-choice knapsack: along a layer's hull the error removed per extra
    byte only falls, so taking moves in this order keeps each layer's moves in their order, and every
    prefix is the best plan for its bytes under the additive error model. Returns ``(layer, mode, bytes)``.
    """
    moves = []
    for name in sorted(error):
        points = sorted(cost[name].items(), key=lambda item: (item[1], error[name][item[0]]))
        hull = [points[0]]  # (mode, bytes), the cheapest first: the base mode
        for mode, nbytes in points[1:]:
            if error[name][mode] >= error[name][hull[-1][0]]:
                continue  # more bytes, no less error: never worth it
            while len(hull) >= 2:  # drop a middle point above the segment from its neighbours
                (m0, b0), (m1, b1) = hull[-2], hull[-1]
                if (error[name][m0] - error[name][m1]) * (nbytes - b1) <= (error[name][m1] - error[name][mode]) * (b1 - b0):
                    hull.pop()
                else:
                    break
            hull.append((mode, nbytes))
        for (m0, b0), (m1, b1) in zip(hull, hull[1:]):
            moves.append((name, m1, b1 - b0, (error[name][m0] - error[name][m1]) / max(b1 - b0, 1)))
    moves.sort(key=lambda move: (-move[3], move[0], move[2]))
    return [(name, mode, extra) for name, mode, extra, _ in moves]


def _local_errors(swapper: _Swapper, modes: Sequence[str]) -> dict[str, dict[str, float]]:
    """``name -> mode -> |layer_mode(x) - layer(x)|^2`` on each layer's own probe input, in one forward."""
    errors: dict[str, dict[str, float]] = {}

    def hook(name: str) -> Any:
        def record(layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
            errors[name] = {
                m: 0.0 if m == UNQUANTIZED else float((swapper.variant(name, m, keep=False)(args[0]).float() - output.float()).square().sum())
                for m in modes
            }

        return record

    handles = [layer.register_forward_hook(hook(name)) for name, layer in swapper.layers.items()]
    try:
        swapper.forward()
    finally:
        for handle in handles:
            handle.remove()
    return errors


def choose_layer_modes(
    module: nn.Module,
    names: Sequence[str],
    base: str,
    sensitive: Any,
    dtype: Any,
    probe: Any,
    max_bytes_per_param: Optional[float] = None,
    min_cosine: Optional[float] = None,
    hessians: Optional[Mapping[str, torch.Tensor]] = None,
    strict: bool = True,
    tap: Optional[str] = None,
    fixed_bytes: Optional[Mapping[str, int]] = None,
) -> SensitivityReport:
    """Choose ``base`` or one of the ``sensitive`` modes for each layer in ``names`` (changed back afterwards): Linears,
    and convolutions (their weight matrix, :mod:`lightning_hbm.layers.conv`).

    ``sensitive``: a mode, several (e.g. ``["nf4-dq-b32", "int8"]``) or ``"auto"`` (the base format's ``ladder``).
    With ``max_bytes_per_param`` alone the budget is filled; with ``min_cosine`` the cheapest plan of the
    sequence reaching it is taken. A budget that cannot be met raises a ``ValueError`` naming the best
    reachable figure, before anything changes (``strict=False``: the plan closest to ``min_cosine`` is returned, its
    cosine said in the result). ``fixed_bytes``: bytes a layer stores in any quantized mode beside its weight (the
    calibrated correction's factors, ``correction_rank``): in every byte figure and in the budget, so that
    ``max_bytes_per_param`` bounds all that is stored (session 40: they were stored on top of it, unsaid). ``hessians``: 4-bit Linears are measured GPTQ-rounded
    (``QuantizedPrecision(rounding="gptq")``), convolutions rounded to nearest (:func:`measured_rounded`).
    Deterministic for a fixed probe batch. Cost: one probe
    forward per layer (its error alone) and a few more (below), each with one layer or one plan swapped in.
    ``tap``: the module whose output is measured instead of the model's (``QuantizedPrecision(accuracy_at=...)``).
    """
    # One function on purpose (about 70 lines): the three measuring steps below share the swapper, the reference output
    # and the cosine closure over them; split, each step would take all of them as arguments.
    dtype, wider = to_dtype(dtype), ladder(base, sensitive)
    if not names:  # nothing to plan (a conv net's Linear plan under min_cosine): was a ZeroDivisionError
        return SensitivityReport({}, 1.0, 1.0, 0.0, 0.0)
    modes = (base, *wider)
    layers = {name: module.get_submodule(name) for name in names}
    features = {n: cast(LayerKind, kind_of(lay)).features(lay) for n, lay in layers.items()}  # a conv: its weight matrix
    total_params = sum(math.prod(f) for f in features.values())
    fixed = fixed_bytes or {}
    cost = {n: {m: weight_bytes(m, *features[n], dtype) + (0 if m == UNQUANTIZED else fixed.get(n, 0)) for m in modes} for n in layers}
    uniform_bytes = sum(c[base] for c in cost.values())
    widest = sum(max(c.values()) for c in cost.values()) / total_params
    _check_budget(max_bytes_per_param, uniform_bytes / total_params, widest, base, wider, total_params, len(layers), sum(fixed.get(n, 0) for n in layers) / total_params)
    budget = math.inf if max_bytes_per_param is None else max_bytes_per_param * total_params
    swapper = _Swapper(Probe(module, probe), layers, dtype, hessians)  # the model and its batch, handed down once
    with eval_no_grad(module):
        swapper.tap = tap
        reference = swapper.output({}) if tap else swapper.measuring_point(names, base, swapper.output({}))

        def cosine(choice: Mapping[str, str]) -> float:
            return compare_outputs(swapper.output(choice), reference, lm=False)["quant/cosine_similarity"]

        # 1. sensitivity: the output error each layer causes alone in the base mode (one forward each)
        solo = {n: 1 - cosine({n: base}) for n in names}
        # 2. the other modes of a layer, by how much they shrink its own output error on the probe (one
        #    forward for all layers and modes): a layer's end-to-end error scales with its local error
        local = _local_errors(swapper, modes)
        missed = {n: swapper.layers[n] for n in names if n not in local}  # read, never called (precision/read_layers.py)
        if missed:
            local.update(read_local_errors(module, missed, modes, probe, lambda n, m: swapper.variant(n, m, keep=False)))
        error = {n: {m: solo[n] * local[n][m] / max(local[n][base], 1e-30) for m in modes} for n in names}
        # 3. the best plan for each byte count under the additive model: moves up each layer's hull, in order
        choices, used, blocked = [({n: base for n in names}, uniform_bytes)], uniform_bytes, set()
        # a wider mode may take fewer bytes than the base on a small layer (nf4-dq's constants on a 3-channel conv):
        # climbed from the base's bytes, it is the first move, its real bytes counted
        floor = {n: {m: b if m == base else max(b, c[base] + 1) for m, b in c.items()} for n, c in cost.items()}
        for name, mode, _ in upgrade_moves(error, floor):
            extra = cost[name][mode] - cost[name][choices[-1][0][name]]
            if name in blocked or used + extra > budget:
                blocked.add(name)  # a layer's later moves start where this one ends: skipped with it
                continue
            choices.append(({**choices[-1][0], name: mode}, used + extra))
            used += extra
        choice, used, current, uniform_cosine = _pick(choices, cosine, min_cosine)
        if min_cosine is None and max_bytes_per_param is not None and "int8" in wider:
            # one more forward: the plain ranking by error alone in int8 (the baseline), kept if it
            # measures better on the probe
            greedy, greedy_used = greedy_layer_modes(solo, cost, base, "int8", budget)
            greedy_cosine = cosine(greedy)
            if greedy_cosine > current:
                choice, used, current = greedy, greedy_used, greedy_cosine
    result = SensitivityReport(
        dict(sorted(choice.items())), uniform_cosine, current, uniform_bytes / total_params, used / total_params, solo, swapper.tap
    )
    if strict and min_cosine is not None and current < min_cosine:
        reach = f"within max_bytes_per_param={max_bytes_per_param}" if max_bytes_per_param is not None else f"with the widest of {list(wider)}"
        widen = "" if UNQUANTIZED in wider else ", or add 'none' (the compute dtype) to sensitive_mode"
        raise ValueError(
            f"min_cosine={min_cosine} cannot be met: the best probe output cosine reachable {reach} is {current:.5f} "
            f"at {result.bytes_per_param:.4f} bytes per parameter. Lower min_cosine or raise max_bytes_per_param{widen}."
        )
    return result


def _pick(
    choices: list[tuple[dict[str, str], int]], cosine: Any, min_cosine: Optional[float]
) -> tuple[dict[str, str], int, float, float]:
    """The choice to keep from the nested sequence ``choices`` (each one more move than the last): the last one
    under a byte budget; with ``min_cosine``, the first one that reaches it (binary search over measured
    cosines: the sequence removes error at every step, so cosine grows nearly monotonically)."""
    uniform_cosine = cosine(choices[0][0])
    if min_cosine is None:
        choice, used = choices[-1]
        return choice, used, cosine(choice) if len(choices) > 1 else uniform_cosine, uniform_cosine
    measured = {0: uniform_cosine}
    low, high = 0, len(choices) - 1
    if uniform_cosine < min_cosine:
        measured[high] = cosine(choices[high][0])
        if measured[high] < min_cosine:
            return (*choices[high], measured[high], uniform_cosine)  # the caller names the best reachable figure
        while high - low > 1:  # invariant: plans[low] misses the target, plans[high] reaches it
            middle = (low + high) // 2
            measured[middle] = cosine(choices[middle][0])
            low, high = (middle, high) if measured[middle] < min_cosine else (low, middle)
    else:
        high = 0
    return (*choices[high], measured[high], uniform_cosine)


def check_layer_mode_args(
    mode: str,
    max_bytes_per_param: Any,
    min_cosine: Any,
    sensitive_mode: Any,
    probe_batch: Any,
    layer_modes: Any,
) -> None:
    """``QuantizedPrecision``'s checks of the mixed-precision arguments, at construction."""
    for name, value in (("max_bytes_per_param", max_bytes_per_param), ("min_cosine", min_cosine)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"QuantizedPrecision({name}={value!r}): pass a finite number, or None for no target.")
    if max_bytes_per_param is not None and max_bytes_per_param <= 0:
        raise ValueError(f"QuantizedPrecision(max_bytes_per_param={max_bytes_per_param}): must be > 0 (bf16 is 2.0).")
    if min_cosine is not None and not -1.0 < min_cosine <= 1.0:
        raise ValueError(f"QuantizedPrecision(min_cosine={min_cosine}): must be in (-1, 1], e.g. 0.99.")
    if sensitive_mode != "auto":
        wider = ladder(mode, sensitive_mode) if isinstance(sensitive_mode, (str, list, tuple)) else ()
        if not wider or not all(isinstance(m, str) for m in wider):
            raise ValueError(
                f"QuantizedPrecision(sensitive_mode={sensitive_mode!r}): pass 'auto', a mode name or a non-empty list "
                "of mode names, e.g. ['nf4-dq-b32', 'int8'] or 'none' (the compute dtype)."
            )
        for wide in wider:
            if wide != UNQUANTIZED:
                get_format(wide)  # unknown name: ValueError listing the valid ones
        if mode in wider and (max_bytes_per_param is not None or min_cosine is not None):
            raise ValueError(
                f"QuantizedPrecision(mode={mode!r}, sensitive_mode={sensitive_mode!r}): the sensitive layers need a "
                "wider mode than the others, e.g. sensitive_mode='int8' or 'none' (16-bit), or 'auto'."
            )
    if probe_batch is not None and not isinstance(probe_batch, (torch.Tensor, tuple, list, Mapping)):
        raise TypeError(
            f"QuantizedPrecision(probe_batch=...) must be a tensor, an (inputs, targets) tuple/list or a dict of "
            f"tensors, got {type(probe_batch).__name__}. Pass None to use the datamodule's first training batch."
        )
    if layer_modes is not None:
        if max_bytes_per_param is not None or min_cosine is not None:
            raise ValueError(
                "QuantizedPrecision: pass either layer_modes (a fixed plan) or a target (max_bytes_per_param / "
                "min_cosine) to choose one, not both."
            )
        if not isinstance(layer_modes, Mapping):
            raise TypeError(f"layer_modes must be a dict {{layer name: mode name}}, got {type(layer_modes).__name__}.")
        for layer_mode in layer_modes.values():
            if layer_mode != UNQUANTIZED:
                get_format(layer_mode)


#: the former names (issue 54: "plan" names the planner's), importable with a DeprecationWarning naming the new one
_RENAMED = {"SensitivityPlan": "SensitivityReport", "choose_plan": "choose_layer_modes", "greedy_plan": "greedy_layer_modes",
            "check_plan_args": "check_layer_mode_args", "CONV_PLAN_TARGET": "CONV_TARGET_COSINE",
            "unplanned_convs_warning": "unmeasured_convs_warning", "planned_convs_warning": "widened_convs_warning"}


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"lightning_hbm.precision.sensitivity.{name} is deprecated: use {new} (the same {_kind(name)}).",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _kind(name: str) -> str:
    return "value" if name.isupper() else "class" if name[0].isupper() else "function"
