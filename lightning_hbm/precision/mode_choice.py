"""The mode choice of one ``Quantization``: the layer modes measured on the probe, once a surgery.

Two choices, each handed the settings, the probe (:class:`~lightning_hbm.probe.Probe`, drawn once by the measures)
and the GPTQ statistics, each returning what it measured: the Linear layers' under a target (``max_bytes_per_param``
or ``min_cosine``: :func:`linear_modes`), and the convolutions' under a 4-bit mode (issue 53: :func:`conv_modes`, a
:class:`ConvChoice`). What the choice cannot measure or reach is said at fit start, with the figure and the fix. The
``Quantization`` takes the checkpoint's modes instead where a resume has them, and keeps what the choice returns.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Mapping, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.sensitivity import CONV_MIN_COSINE, CONV_TARGET_COSINE, SensitivityReport, choose_layer_modes, unmeasured_convs_warning, widened_convs_warning
from lightning_hbm.probe import Probe, has_forward
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
    )  # fmt: skip
    log.info("lightning_hbm: mixed precision plan: %s", report.summary(config.format.name))
    return report


def conv_modes(
    module: nn.Module, names: list[str], config: QuantizationConfig, probe: Callable[[], Probe], hessians: Optional[Mapping[str, torch.Tensor]]
) -> ConvChoice:
    """The convolutions' mode choice under a 4-bit mode (issue 53): each one's output error measured on the probe, the
    most sensitive widened (``sensitive_mode``) until the probe output cosine reaches ``min_cosine`` (default
    :data:`CONV_TARGET_COSINE`, above the threshold held out because the probe reads high); under it, a warning naming
    the figure. Without a probe batch: logged (a BatchNorm conv net: a warning, with the figure); a probe the model
    cannot run: a warning. A BatchNorm conv net chosen to the target: the warning that held out such choices measured
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
            hessians=hessians, strict=False, tap=config.accuracy_at,
        )  # fmt: skip
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
    return (
        f"lightning_hbm: the convolutions stored in {mode} (widest plan of sensitive_mode={config.sensitive_argument()!r}: "
        f"{report.bytes_per_param:.3f} bytes per conv weight) give a probe output cosine of {report.cosine:.4f} < {target} "
        f"against the unquantized model (uniform {mode}: {report.uniform_cosine:.4f}). Fix: QuantizedPrecision(..., "
        f"sensitive_mode=['int8', 'none']) or mode='int8'{wider}."
    )


__all__ = ["ConvChoice", "conv_modes", "linear_modes", "missed_target_warning"]
