"""SmoothQuant-style smoothing factors for ``int8-dynamic-smooth``, measured on a probe batch.

What it improves: the quality of ``int8-dynamic`` at (almost) the same **parameters** bytes. Dynamic
INT8 quantizes each token of a Linear's input with one scale, ``absmax(token) / 127``: when a few
input channels carry values 10-100x the others (the LayerNorm outputs of BERT-like encoders, GELU
outputs), those channels set the scale and every other channel is left a handful of levels. SmoothQuant
(Xiao et al., 2023) divides input channel ``j`` by ``s_j`` and multiplies weight column ``j`` by it,
which leaves ``x @ W.T`` unchanged and moves the range into the weights (quantized per output row, they
absorb it better), with

    s_j = max|X_j| ** alpha / max|W[:, j]| ** (1 - alpha)

Here ``s_j`` is rounded to a power of two (an int8 exponent: one byte per input channel, and the
division is exact in floating point; the rounding moves ``s_j`` by at most a factor sqrt(2), which
changes the error little). ``max|X_j|`` comes from hooks on every Linear during one no-grad forward of
the probe batch on the model as built (the same probe as ``QuantizationQuality`` and the sensitivity plan).

``alpha``: a number in [0, 1] applies to every layer; ``"auto"`` chooses per layer among
:data:`AUTO_ALPHAS` and "not smoothed", by the error of that layer's own output on the probe inputs it
really receives (one more forward, each candidate's quantized layer computed and dropped inside the hook:
no activation is kept); a layer is smoothed only for a clear gain (error below 0.9x unsmoothed), and if
the smoothed model's probe output is worse than the unsmoothed one's, nothing is smoothed (logged). Per
layer because the input statistics differ by layer (a LayerNorm output has a few huge channels, an
attention context has none) and one alpha for the model measured worse (all-MiniLM-L6-v2, 64 held-out
sentences, before the 0.9x rule: 0.99911 per layer, 0.99882 with 0.5 everywhere, 0.99824 with 0.8).
The end-to-end probe output cosine (the metric ``QuantizationQuality`` logs) is measured before
(plain ``int8-dynamic``) and after (smoothed) for the log: two more forwards.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from lightning_hbm import resume
from lightning_hbm.precision.int8_dynamic import MAX_SHIFT as _MAX_SHIFT
from lightning_hbm.precision.int8_dynamic import candidate_errors, report_unsmoothed, shifts_for
from lightning_hbm.precision.registry import to_dtype
from lightning_hbm.precision.sensitivity import _Swapper
from lightning_hbm.probe import Probe, compare_outputs
from lightning_hbm.record import attached_input_shifts as attached  # public here too (the exponents ride on the weights)

log = logging.getLogger(__name__)

#: the mode whose layers hold smoothing exponents
SMOOTH_MODE = "int8-dynamic-smooth"
#: the alphas ``"auto"`` tries per layer (besides not smoothing); SmoothQuant reports 0.5 for most models,
#: up to 0.75-0.85 for models with strong outliers
AUTO_ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
#: ``"auto"`` smooths a layer only if it cuts that layer's own output error on the probe below this fraction of
#: the unsmoothed error: gains of a few percent per layer (the random-weight test Llama has no outlier channels:
#: 9 of 28 layers at 0.92-1.0) did not survive end to end (probe cosine 0.99976 -> 0.99975), clear ones do
_MAX_ERROR_RATIO = 0.9


@dataclass
class SmoothingReport:
    """What :func:`choose_smoothing` measured: the exponents and the probe figures for the log."""

    #: ``name -> int8 exponents e`` (the layer stores ``W * 2**e`` and divides its input by ``2**e``)
    shifts: dict[str, torch.Tensor]
    #: ``name -> alpha`` chosen for the layer (``None``: not smoothed, zero exponents)
    alphas: dict[str, Optional[float]]
    #: probe output cosine vs the model as built: every layer in plain ``int8-dynamic``, and smoothed
    cosine_before: float = math.nan
    cosine_after: float = math.nan
    #: ``name -> {alpha: squared error of the layer's own output}`` (``"auto"`` only; alpha ``None``: not smoothed)
    layer_errors: dict[str, dict[Optional[float], float]] = field(default_factory=dict)
    #: ``"auto"`` measured a lower probe cosine smoothed than unsmoothed, and left every layer unsmoothed
    reverted: bool = False

    def summary(self, setting: Union[float, str]) -> str:
        smoothed = {n: a for n, a in self.alphas.items() if a is not None}
        counts: dict[float, int] = {}
        for a in smoothed.values():
            counts[a] = counts.get(a, 0) + 1
        per_alpha = ", ".join(f"alpha {a}: {c}" for a, c in sorted(counts.items()))
        left = sorted(set(self.alphas) - set(smoothed))
        if self.reverted:
            return (
                f"smoothing={setting!r}: no layer smoothed: the per-layer choice lowered the probe output cosine "
                f"({self.cosine_before:.6f} unsmoothed -> {self.cosine_after:.6f}), so every layer keeps zero exponents. "
                "Use mode 'int8-dynamic' to save the byte per input channel, or try a fixed smoothing alpha."
            )
        return (
            f"smoothing={setting!r}: {len(smoothed)} of {len(self.alphas)} Linear layers smoothed ({per_alpha or 'none'}); "
            f"probe output cosine {self.cosine_before:.6f} (int8-dynamic) -> {self.cosine_after:.6f} (smoothed)"
            + (f"; not smoothed (their output error on the probe did not drop by {1 - _MAX_ERROR_RATIO:.0%}): {left}" if left else "")
        )


def check_smoothing(smoothing: Any, smooths: bool, mode: str) -> Union[float, str, None]:
    """``QuantizedPrecision(smoothing=...)`` checked at construction; returns the setting (``"auto"`` by default)."""
    if smoothing is not None and not smooths:
        raise ValueError(
            f"QuantizedPrecision(mode={mode!r}, smoothing={smoothing!r}): smoothing applies to layers stored in "
            f"{SMOOTH_MODE!r}. Use QuantizedPrecision({SMOOTH_MODE!r}, smoothing={smoothing!r}), or drop smoothing."
        )
    if not smooths:
        return None
    if smoothing is None or smoothing == "auto":
        return "auto"
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
        raise ValueError(
            f"QuantizedPrecision(smoothing={smoothing!r}): pass the SmoothQuant migration strength alpha, a number in "
            "[0, 1] (0.5 is SmoothQuant's default), or 'auto' to choose it per layer on the probe batch."
        )
    return float(smoothing)


def check_saved_shifts(
    shifts: Any, path: Any, module: nn.Module, names: Optional[Sequence[str]] = None
) -> dict[str, torch.Tensor]:
    """The exponents a checkpoint holds (``meta["input_shifts"]``), checked before they touch a layer: a dict of
    int8 exponents within +-``_MAX_SHIFT``, one per input channel of a layer ``module`` has (and, with ``names``,
    exactly the layers being smoothed). A resealed or edited file would otherwise train on wrecked layers."""
    def refuse(what: str) -> ValueError:
        return ValueError(
            f"Checkpoint {path} holds smoothing exponents ({SMOOTH_MODE}) that {what}: the file was edited or belongs "
            "to another model. Resume from a checkpoint of this model; nothing was changed."
        )

    if not isinstance(shifts, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in shifts.items()):
        raise refuse("are not a dict of layer names to tensors")
    known = set(names) if names is not None else {n for n, _ in module.named_modules(remove_duplicate=False)}
    unknown = [n for n in shifts if n not in known]
    if unknown:
        raise refuse(f"name {len(unknown)} layer(s) this model does not smooth ({unknown[:5]})")
    if names is not None and set(names) - set(shifts):
        raise refuse(f"lack layers this model smooths ({sorted(set(names) - set(shifts))[:5]})")
    for name, shift in shifts.items():
        width = getattr(module.get_submodule(name), "in_features", None)
        if shift.dtype != torch.int8 or tuple(shift.shape) != (width,):
            raise refuse(f"do not fit layer {name!r}: {shift.dtype} of shape {tuple(shift.shape)}, expected int8 of shape ({width},)")
        if shift.numel() and int(shift.abs().max()) > _MAX_SHIFT:
            raise refuse(f"lie outside +-{_MAX_SHIFT} for layer {name!r} (largest {int(shift.abs().max())}): factors "
                         f"of 2**{int(shift.abs().max())} wreck the layer")
    return shifts


def _check_meta(meta: dict[str, Any], path: Any, module: nn.Module) -> None:
    if "input_shifts" in meta:
        check_saved_shifts(meta["input_shifts"], path, module)


# every checkpoint loaded through lightning_hbm's checkpoint IO, before Lightning copies a tensor
resume.register_meta_check(_check_meta)


def choose_smoothing(
    module: nn.Module, names: Sequence[str], alpha: Union[float, str], dtype: Any, probe: Any
) -> SmoothingReport:
    """The smoothing exponents of the Linears ``names`` of ``module`` (left unchanged), measured on ``probe``: the probe
    batch, or the :class:`~lightning_hbm.probe.Probe` of ``module`` its caller built once.

    ``alpha``: a number in [0, 1] for every layer, or ``"auto"`` (per layer, the candidate of
    :data:`AUTO_ALPHAS` or no smoothing with the smallest error of the layer's own output). Deterministic
    for a fixed probe batch. Costs 2 forwards of the probe with a fixed alpha, 3 with ``"auto"``, plus
    the layer candidates computed inside the hooks.

    One way, each step handing its value to the next: the inputs' ranges (:func:`~lightning_hbm.probe.input_absmax`),
    the candidate exponents and their errors (:mod:`~lightning_hbm.precision.int8_dynamic`, the layer that stores
    them), the choice, then the probe outputs unsmoothed and smoothed (one swapper, the exponents attached for both:
    only ``int8-dynamic-smooth`` reads them).
    """
    dtype = to_dtype(dtype)
    layers = cast(dict[str, nn.Linear], {name: module.get_submodule(name) for name in names})  # the Linears named
    alphas = AUTO_ALPHAS if alpha == "auto" else (float(alpha),)
    measured = probe if isinstance(probe, Probe) else Probe(module, probe)  # handed down to every forward below
    with measured.eval_no_grad():
        absmax, reference = measured.input_absmax(layers)
        unseen = sorted(set(layers) - set(absmax))
        if unseen:
            raise ValueError(
                f"Smoothing found no input for {unseen}: the probe batch's forward never calls them. Exclude them "
                "(QuantizedPrecision(ignore_modules=[...]) or layer_modes={name: 'int8-dynamic'}) or use a probe "
                "batch that reaches them."
            )
        candidates: dict[str, dict[Optional[float], torch.Tensor]] = {n: {a: shifts_for(absmax[n], layer.weight, a) for a in alphas} for n, layer in layers.items()}
        zero = {n: torch.zeros(layer.in_features, dtype=torch.int8) for n, layer in layers.items()}
        errors: dict[str, dict[Optional[float], float]] = {}
        chosen: dict[str, Optional[float]] = {n: float(alpha) for n in layers} if alpha != "auto" else {}
        if alpha == "auto":
            errors = candidate_errors(measured, layers, {n: {None: zero[n], **candidates[n]} for n in layers}, dtype)
            # the smallest error (ties: the smaller alpha, deterministic), if it is a clear gain over no smoothing
            best = {n: min(alphas, key=lambda a: (errors[n][a], a)) for n in layers}
            chosen = {n: a if errors[n][a] < _MAX_ERROR_RATIO * errors[n][None] else None for n, a in best.items()}
        shifts = {n: candidates[n][a] if a is not None else zero[n] for n, a in chosen.items()}
        swapper = _Swapper(measured, layers, dtype)
        with attached(module, shifts):  # read by int8-dynamic-smooth's layers only: the unsmoothed plan ignores them
            before, after = (swapper.output({n: mode for n in names}) for mode in ("int8-dynamic", SMOOTH_MODE))
    cosine = lambda out: compare_outputs(out, reference, lm=False)["quant/cosine_similarity"]  # noqa: E731
    report = SmoothingReport(shifts, chosen, cosine(before), cosine(after), errors)
    if alpha == "auto" and report.cosine_after < report.cosine_before:
        # layer by layer better, end to end worse on the probe: "auto" never makes the model worse than int8-dynamic
        report.shifts = {n: torch.zeros_like(shift) for n, shift in shifts.items()}
        report.alphas = {n: None for n in names}
        report.reverted = True
    return report


class Smoothing:
    """The smoothing of one ``QuantizedPrecision``: its setting, and the exponents measured (or resumed) at fit start.

    The plugin holds one when a layer may be stored in :data:`SMOOTH_MODE` (its mode, a sensitive mode or the plan)
    and calls it at three points: :meth:`measure` in the checks (before the sensitivity plan, which measures the
    smoothed layers), :meth:`attached` around the quantization and :meth:`save` with each checkpoint. After the
    quantization it hands :attr:`shifts` to :func:`~lightning_hbm.precision.int8_dynamic.report_unsmoothed`
    (:meth:`report_unsmoothed` does the same), so that this module is entered once more only, not twice.
    """

    def __init__(self, setting: Union[float, str]) -> None:
        #: ``"auto"`` or the alpha of every layer (a resume setting)
        self.setting = setting
        #: ``{layer name: int8 exponents}`` measured or resumed (``None`` before the checks; ``{}`` on fake weights)
        self.shifts: Optional[dict[str, torch.Tensor]] = None
        #: what :func:`choose_smoothing` measured (``None`` when nothing was measured: resumed, fake)
        self.report: Optional[SmoothingReport] = None

    @classmethod
    def configure(cls, smoothing: Any, modes: Sequence[str], mode: str) -> Optional["Smoothing"]:
        """The checked ``smoothing`` argument for a plugin whose layers may take ``modes`` (``None``: none smooths)."""
        setting = check_smoothing(smoothing, SMOOTH_MODE in modes, mode)
        return None if setting is None else cls(setting)

    def measure(self, module: nn.Module, names: Sequence[str], dtype: Any, probe: Callable[[], Probe],
                saved: Callable[[], Mapping[str, Any]], path: Any = None) -> None:
        """The exponents of the Linears ``names``: those of ``saved()`` (the lightning_hbm part of the checkpoint
        ``path`` being resumed with these settings, or empty), else measured on ``probe()`` (the model and its probe
        batch, drawn at the first call)."""
        self.shifts = self.report = None  # a plugin reused by another Trainer measures again
        if any(is_fake(module.get_submodule(name).weight) for name in names):
            self.shifts = {}  # the planner's shape-only model: the exponents change no byte
            return
        resumed = saved().get("input_shifts")
        if resumed is not None:
            # resuming: the factors the checkpoint was trained with, not factors measured on this model
            self.shifts = dict(check_saved_shifts(resumed, path, module, names))
            log.info("lightning_hbm: smoothing factors of %d layers taken from the checkpoint being resumed", len(self.shifts))
            return
        self.report = choose_smoothing(module, names, self.setting, dtype, probe())
        self.shifts = self.report.shifts
        log.info("lightning_hbm: %s", self.report.summary(self.setting))

    def attached(self, module: nn.Module) -> AbstractContextManager:
        return attached(module, self.shifts or {})

    def report_unsmoothed(self, module: nn.Module, quantized: Sequence[str]) -> None:
        """Warn about layers stored in :data:`SMOOTH_MODE` that got no exponents (only ``nn.Linear`` inputs are measured):
        :func:`~lightning_hbm.precision.int8_dynamic.report_unsmoothed` with these exponents."""
        report_unsmoothed(module, quantized, self.shifts)

    def save(self, meta: dict[str, Any]) -> None:
        """Into a checkpoint's lightning_hbm part: next to the settings, not in the state_dict, because an adapter-only
        checkpoint leaves the frozen base (and its ``input_shift`` buffers) out, and a resume rebuilds it from the
        model's weights with these same factors."""
        if self.shifts:
            meta["input_shifts"] = {name: shift.detach().cpu() for name, shift in self.shifts.items()}


__all__ = ["AUTO_ALPHAS", "SMOOTH_MODE", "Smoothing", "SmoothingReport", "attached", "check_saved_shifts", "check_smoothing",
           "choose_smoothing", "shifts_for"]
