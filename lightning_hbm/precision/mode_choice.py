"""The mode choice of one ``Quantization``: the layer modes measured on the probe, once a surgery.

:func:`measure_and_choose` is the checks' step: the probe drawn once (:class:`~lightning_hbm.precision.measures.Measures`),
what the quantization measures on it, then the layer modes once (taken from the checkpoint being resumed with these
settings, :class:`~lightning_hbm.precision.saved_settings.SavedSettings`, else measured), then the accuracy check's
reference; it returns what it chose (:class:`ModesChosen`) for the ``Quantization`` to keep. Two choices, each handed the settings, the probe (:class:`~lightning_hbm.probe.Probe`, drawn once by the measures)
and the GPTQ statistics, each returning what it measured: the Linear layers' under a target (``max_bytes_per_param``
or ``min_cosine``: :func:`linear_modes`), and the convolutions' under a 4-bit mode (issue 53: :func:`conv_modes`, a
:class:`ConvChoice`). What the choice cannot measure or reach is said at fit start, with the figure and the fix. The
checkpoint's modes are taken instead where a resume has them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import nullcontext
from typing import Any, Callable, Mapping, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_hbm.layers import CONV, kind_of
from lightning_hbm.layers.correction import storage_dtype
from lightning_hbm.precision.accuracy import CHECK_SAMPLES, Reference
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.conv_correction import conv_correction_bytes, is_conv
from lightning_hbm.precision.measures import Measures, one_batch
from lightning_hbm.precision.saved_settings import SavedSettings
from lightning_hbm.precision.sensitivity import CONV_MIN_COSINE, CONV_TARGET_COSINE, BudgetError, SensitivityReport, choose_layer_modes, unmeasured_convs_warning, widened_convs_warning
from lightning_hbm.precision.target_listing import linear_names
from lightning_hbm.probe import Probe, forwarding, has_forward
from lightning_hbm.probe_batch import samples

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ConvChoice:
    """What the convolutions' mode choice measured (:func:`conv_modes`)."""

    #: the choice (``None``: the model went unmeasured: no probe batch, or a probe it cannot run)
    report: Optional[SensitivityReport] = None
    #: the convolutions stored wider than ``mode`` ``{name: mode}``
    widened: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the warning that held out such choices measured under the target (said at the quantization, where the measured
    #: figure does not say more)
    gap: Optional[str] = None
    #: the model going unmeasured was said (a warning): the accuracy check does not say it again
    said_unmeasured: bool = False
    #: the samples the modes were chosen on: a check quiet on those same samples is quiet by construction, so it does
    #: not stand in for :attr:`gap` (session 37: a first batch of 32 chose and checked the same 32 images)
    chosen_on: int = 0


@dataclasses.dataclass
class ModesChosen:
    """What the checks' step chose (:func:`measure_and_choose`), kept by the ``Quantization``."""

    #: the per-layer modes ``{layer name: mode name}`` (``None``: every layer in ``mode``)
    layer_modes: Optional[dict[str, str]]
    #: what the Linear layers' choice under a target measured (``None``: not measured)
    report: Optional[SensitivityReport] = None
    #: the convolutions' choice (``None``: not made: no convolution in a 4-bit mode, a pinned plan, a resume)
    conv: Optional[ConvChoice] = None
    #: the names of the layers the accuracy check's reference records (none: not measured)
    recorded: list[str] = dataclasses.field(default_factory=list)


def measure_and_choose(
    module: nn.Module, targets: list[tuple[str, nn.Module]], trainer: Any, fake: bool, measures: Measures,
    saved: SavedSettings, settings: dict[str, Any], layer_modes: Optional[dict[str, str]],
) -> ModesChosen:  # fmt: skip
    """The checks' measures on the model as built, handed the targets listed: the probe drawn once, the inputs'
    statistics and the smoothing (:meth:`~lightning_hbm.precision.measures.Measures.measure_model`), then the layer
    modes (the Linears', then the convolutions'; ``layer_modes``: the modes before, a pinned plan or ``None``), then the
    accuracy check's reference (kept in ``measures`` for the quantization). ``settings``: the settings a resume
    compares, read once the targets are listed; ``fake``: the planner's trace, where nothing is measured."""
    config = measures.config
    # a LightningModule without forward: measured through the submodule its training_step calls (issue 53)
    measures.stepped = None
    stepping = [name for name, _ in targets] if not fake and not has_forward(module) else None
    # drawn at the first measure, then handed to each; a conv net's accuracy check measures more samples (session 35)
    conv_net = stepping is None and not fake and any(CONV.matches(layer) for _, layer in targets)
    drawn, checked = measures.probes_once(module, trainer, CHECK_SAMPLES if conv_net else 0)
    probe = drawn if stepping is None else functools.cache(lambda: measures.stepping(drawn(), stepping))
    chosen = ModesChosen(layer_modes)
    with forwarding(module, lambda: measures.stepped):
        measures.measure_model(module, targets, trainer, True, True, settings, probe)  # smoothed before the plan, which measures it
        hessians = measures.gptq.hessians if measures.gptq is not None else None
        if config.measures_layer_modes and not fake:  # the planner: no real weights to measure (see chosen_convolutions)
            with measures.smoothing.attached(module) if measures.smoothing is not None else nullcontext():
                # resuming: the plan the checkpoint was trained with (a fresh model may differ), else measured
                chosen.layer_modes = saved.saved_layer_modes(trainer, settings)
                if chosen.layer_modes is not None:
                    log.info("lightning_hbm: mixed precision plan taken from the checkpoint being resumed")
                else:
                    chosen.report = linear_modes(module, linear_names(targets), config, probe, hessians)
                    chosen.layer_modes = chosen.report.modes
        convs = [name for name, layer in targets if CONV.matches(layer)]
        # every model quantized is measured (session 32; was: only those with a quantized convolution, and a Pix2Struct
        # lost its output in nf4-dq, cosine 0.965, unsaid): the reference records every quantized layer's input
        # (a validate/predict/test run measures only models with convolutions, as before: a model of Linears alone
        # is not worth opening the train loader, which such a run never asked for)
        chosen.recorded = [name for name, _ in targets] if convs or trainer is None or trainer.state.fn == "fit" else []
        measures.reference = Reference(chosen.recorded, convs) if chosen.recorded and not fake else None
        # the mode choice's first forward is the model as built: the reference, where the check measures its batch
        with measures.reference.recording(module) if measures.reference is not None and one_batch(drawn, checked) else nullcontext():
            said = _choose_conv_modes(module, convs, trainer, probe, hessians, saved, settings, chosen)
        measures.record_reference(module, probe if checked is drawn else checked, None if checked is drawn else drawn, said)
        if measures.reference is not None:  # the quantized model's forward runs where the model as built's ran
            measures.reference.stepped = measures.stepped
    measures.stepped = None
    return chosen


def _choose_conv_modes(
    module: nn.Module, names: list[str], trainer: Any, probe: Callable[[], Probe], hessians: Optional[Mapping[str, torch.Tensor]],
    saved: SavedSettings, settings: dict[str, Any], chosen: ModesChosen,
) -> bool:  # fmt: skip
    """The convolutions' modes under a 4-bit mode (:func:`conv_modes`), those it widens added to ``chosen``'s layer
    modes, the choice kept in ``chosen`` (its warning of a gap held out is said at the quantization). Not with a pinned
    plan, nor when resuming (the checkpoint's modes are taken). Returns whether it said the model went unmeasured (no
    probe batch, a probe it cannot run): the accuracy check does not say it again."""
    config = saved.config
    if not names or config.layer_modes is not None or config.format.peft_kind != "4bit":
        return False
    if saved.saved(trainer):
        # resuming: the plan the checkpoint was trained with (Linears' and convolutions'); none saved (a checkpoint
        # from before issue 53): every convolution in mode, as it was trained
        chosen.layer_modes = saved.saved_layer_modes(trainer, settings) or chosen.layer_modes
        return False
    chosen.conv = conv_modes(module, names, config, probe, hessians)
    if chosen.conv.widened:
        chosen.layer_modes = {**(chosen.layer_modes or {}), **chosen.conv.widened}
    return chosen.conv.said_unmeasured


def linear_modes(
    module: nn.Module, names: list[str], config: QuantizationConfig, probe: Callable[[], Probe], hessians: Optional[Mapping[str, torch.Tensor]]
) -> SensitivityReport:
    """The Linear layers' modes under ``max_bytes_per_param`` or ``min_cosine``, measured on the probe
    (:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`), logged.

    Raises:
        ValueError: no probe batch, or a target that cannot be met.
    """
    report = choose_layer_modes(
        module, names, config.format.name, config.sensitive_mode, config.torch_dtype, probe().batch,
        max_bytes_per_param=config.max_bytes_per_param, min_cosine=config.min_cosine, hessians=hessians,
        fixed_bytes=correction_bytes(module, names, config.correction_rank or 0, config.torch_dtype),
    )  # fmt: skip
    log.info("lightning_hbm: mixed precision plan: %s", report.summary(config.format.name))
    return report


def correction_bytes(module: nn.Module, names: list[str], rank: int, dtype: torch.dtype) -> dict[str, int]:
    """``{layer: bytes}`` of the calibrated correction's factors a rank-``rank`` correction stores beside each Linear-like
    layer of ``names`` (``r (in + out)`` values in the factors' 16-bit storage dtype under the compute ``dtype``,
    :func:`~lightning_hbm.layers.correction.storage_dtype`; ``r`` capped at ``min(in, out)``; a convolution's over its
    ``in x kernel`` patch, grouped and transposed ones none): what a byte budget counts with the weights
    (:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`)."""
    if not rank:
        return {}
    sizes = {}
    for name in names:
        layer = module.get_submodule(name)
        kind = kind_of(layer)
        if is_conv(layer):
            conv = conv_correction_bytes(layer, rank, dtype)
            if conv is not None:
                sizes[name] = conv
            continue
        if kind is None or kind.wrap is not None:
            continue
        in_features, out_features = kind.features(layer)
        sizes[name] = min(rank, out_features, in_features) * (in_features + out_features) * storage_dtype(dtype).itemsize
    return sizes


def conv_modes(
    module: nn.Module, names: list[str], config: QuantizationConfig, probe: Callable[[], Probe], hessians: Optional[Mapping[str, torch.Tensor]]
) -> ConvChoice:
    """The convolutions' mode choice under a 4-bit mode (issue 53): each one's output error measured on the probe, the
    most sensitive widened (``sensitive_mode``) until the probe output cosine reaches ``min_cosine`` (default
    :data:`CONV_TARGET_COSINE`, above the threshold held out because the probe reads high), within
    ``max_bytes_per_param`` where it is set (the calibrated correction's factors counted in it); under the target, a
    warning naming the figure (and the budget that stopped it). A budget under the convolutions' uniform bytes: stored
    uniform, a warning with the figure and the fix (session 42: the budget did not bound convolutions, EfficientNet-B0
    planned to 0.82 bytes per conv weight under max_bytes_per_param=0.6, unsaid). Without a probe batch: logged (a
    BatchNorm conv net: a warning, with the figure); a probe the model cannot run: a warning. A BatchNorm conv net chosen to the target: the warning that held out such choices measured
    under it (:func:`~lightning_hbm.precision.sensitivity.widened_convs_warning`), handed back to be said at the
    quantization, not where the check measured 32 samples quiet (session 36)."""
    target = config.min_cosine if config.min_cosine is not None else CONV_TARGET_COSINE
    try:
        batch = probe().batch
    except ValueError:
        unmeasured = unmeasured_convs_warning(module, names, config.format.name)
        if unmeasured is not None:  # a BatchNorm conv net: the loss is measured, said (issue 53)
            rank_zero_warn(unmeasured)
        log.info("lightning_hbm: %d convolutions stored in %s without a measured plan: no probe_batch", len(names), config.format.name)
        return ConvChoice(said_unmeasured=unmeasured is not None)
    try:  # on by default: a model or batch the probe cannot run is said, and the fit goes on as before issue 53
        if not has_forward(module):
            raise TypeError(f"{type(module).__name__} defines no forward for the probe batch")
        report = choose_layer_modes(
            module, names, config.format.name, config.sensitive_mode, config.torch_dtype, batch, min_cosine=target,
            hessians=hessians, strict=False, tap=config.accuracy_at, max_bytes_per_param=config.max_bytes_per_param,
            fixed_bytes=correction_bytes(module, names, config.correction_rank or 0, config.torch_dtype),
        )  # fmt: skip
    except BudgetError as error:
        # under the uniform mode's own bytes: stored in it, the least they take, and said (not raised: before session 42
        # the budget did not bound convolutions, and a model whose few tiny convolutions cannot meet it trained)
        rank_zero_warn(
            f"lightning_hbm: the {len(names)} convolutions are stored in {config.format.name}, every one, over the budget "
            f"({error})"
        )
        return ConvChoice(chosen_on=samples(batch))
    except (TypeError, ValueError, RuntimeError, KeyError, IndexError) as error:
        rank_zero_warn(
            f"lightning_hbm: {len(names)} convolutions stored in {config.format.name} without a measured plan ({error}). "
            f"With BatchNorm statistics like a trained network's, uniform 4-bit convolutions can lose much of the "
            "output (issue 53: ResNet18 cosine 0.91); pass QuantizedPrecision(probe_batch=...) the model's forward "
            "takes, or mode='int8'."
        )
        return ConvChoice(said_unmeasured=True)
    widened = {name: mode for name, mode in report.modes.items() if mode != config.format.name}
    log.info("lightning_hbm: convolutions' plan: %s", report.summary(config.format.name).replace("Linear layers", "convolutions"))
    # reached on the probe only: held out, a BatchNorm conv net measured under it (issue 53); said at the quantization
    # unless the quantized model's own figure is under the threshold there (one warning, the measured one)
    threshold = config.min_cosine if config.min_cosine is not None else CONV_MIN_COSINE
    gap = widened_convs_warning(module, report, config.format.name, target, threshold)
    if report.cosine < target:
        rank_zero_warn(missed_target_warning(config, report, target))
    return ConvChoice(report, widened, gap, chosen_on=samples(batch))


def missed_target_warning(config: Any, report: SensitivityReport, target: float) -> str:
    """The fit-start warning for a convolutions' mode choice that misses ``target`` at the widest of its ladder, with the fix;
    computing in a 16-bit dtype, the float32 the choice measures the rest of the model in (session 33: transformers'
    MobileNetV2, calibrated, 0.923-0.942 held out in bfloat16 with no convolution quantized)."""
    mode, dtype = config.format.name, config.torch_dtype
    wider = "" if dtype == torch.float32 else (
        f"; the plan measures the rest of the model in float32, and computing in {str(dtype).removeprefix('torch.')} loses "
        "more on its own on a net that amplifies small errors (transformers' MobileNetV2, calibrated: 0.923-0.942 held out "
        "with no convolution quantized): add dtype='float32' there (0.980-0.989 with sensitive_mode=['nf4-dq-b32', "
        "'int8', 'none'], min_cosine=0.99; benchmarks/README.md)"
    )
    budget = config.max_bytes_per_param
    if budget is not None:  # the budget stopped the widening (session 42): it is the setting to change
        return (
            f"lightning_hbm: the convolutions stored in {mode} (the widest plan of sensitive_mode="
            f"{config.sensitive_argument()!r} within max_bytes_per_param={budget}: {report.bytes_per_param:.3f} bytes per "
            f"conv weight) give a probe output cosine of {report.cosine:.4f} < {target} against the unquantized model "
            f"(uniform {mode}: {report.uniform_cosine:.4f}). Fix: a larger max_bytes_per_param, or none (the plan then "
            f"widens until the target, whatever the bytes){wider}."
        )
    return (
        f"lightning_hbm: the convolutions stored in {mode} (widest plan of sensitive_mode={config.sensitive_argument()!r}: "
        f"{report.bytes_per_param:.3f} bytes per conv weight) give a probe output cosine of {report.cosine:.4f} < {target} "
        f"against the unquantized model (uniform {mode}: {report.uniform_cosine:.4f}). Fix: QuantizedPrecision(..., "
        f"sensitive_mode=['int8', 'none']) or mode='int8'{wider}."
    )


__all__ = ["ConvChoice", "ModesChosen", "conv_modes", "linear_modes", "measure_and_choose", "missed_target_warning"]
