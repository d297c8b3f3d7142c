"""``Quantization``: what one ``QuantizedPrecision`` stores quantized, in which mode and how it is rounded.

:class:`~lightning_hbm.QuantizedPrecision` is the Lightning side of quantization (dtype hooks, the surgery entry,
checkpoint hooks); this object is the rest, one per plugin, over its parts, each handed a value: its settings (a frozen
:class:`~lightning_hbm.precision.config.QuantizationConfig`), the **targets** listed once a surgery
(:class:`~lightning_hbm.precision.target_listing.TargetListing`, a :class:`~lightning_hbm.precision.targets.Listing`
that LoRA's checks, :meth:`Quantization.targets`, reuse), what is **measured** on the model as built
(:class:`~lightning_hbm.precision.measures.Measures`: the probe, the GPTQ rounding's statistics, the correction, the
smoothing, the accuracy check's reference), the **layer modes** ``{layer name: mode name}`` pinned, measured or
resumed (:mod:`~lightning_hbm.precision.mode_choice`), and the **resume** settings saved and compared
(:class:`~lightning_hbm.precision.saved_settings.SavedSettings`).

At the surgery points, one way: :meth:`~Quantization.check` in the checks (nothing changes: the targets listed once,
then :func:`~lightning_hbm.precision.mode_choice.measure_and_choose`: the measures, the layer modes once, the
reference), and :meth:`~Quantization.convert` at the quantization point (the targets and measures handed on, the
quantization, :func:`~lightning_hbm.precision.targets.quantize_listed`, then the record and the accuracy check). Both
take the Trainer of the run (or ``None``): the probe batch and the checkpoint being resumed are read from it.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import nullcontext
from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_hbm import resume
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm.precision.accuracy import ConvAccuracy, accuracy_at_unused, check_accuracy, check_accuracy_at
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.correction import CorrectionReport
from lightning_hbm.precision.gptq import DIGEST_KEY, GPTQRounding
from lightning_hbm.precision.int4_asym import regrid_warning
from lightning_hbm.precision.int8_dynamic import report_unsmoothed
from lightning_hbm.precision.measures import CORRECTION_PROBE_TOKENS, Measures, on_fake_tensors
from lightning_hbm.precision.mode_choice import ConvChoice, measure_and_choose
from lightning_hbm.precision.saved_settings import SavedSettings, saved_meta
from lightning_hbm.precision.sensitivity import CONV_MIN_COSINE, SensitivityReport
from lightning_hbm.precision.smoothing import SmoothingReport
from lightning_hbm.precision.target_listing import KEPT_UNDER, TargetListing, modules_to_save
from lightning_hbm.precision.targets import Listing, TargetRule, _validate, layer_modes_of, quantize_listed

log = logging.getLogger(__name__)


class Quantization:
    """What one ``QuantizedPrecision`` quantizes and how: its settings (a :class:`QuantizationConfig`) and what its
    surgeries decide (module docstring).

    Args:
        config: the settings (the plugin's arguments, checked).
        owner: the name the settings are saved under in a checkpoint's ``configs`` (the plugin's class name).
    """

    def __init__(self, config: QuantizationConfig, owner: str) -> None:
        self._config = config
        #: what is measured on the model as built (the probe, the inputs' statistics, the smoothing, the reference)
        self.measures = Measures(config, owner)
        #: its parts: the GPTQ rounding, the calibrated low-rank correction of each quantized layer, the smoothing of
        #: layers stored in ``int8-dynamic-smooth`` (each ``None``: off)
        self.gptq, self.correction, self.smoothing = self.measures.gptq, self.measures.correction, self.measures.smoothing
        #: the per-layer modes ``{layer name: mode name}`` (``None``: every layer in ``mode``): pinned, measured or resumed
        self.layer_modes: Optional[dict[str, str]] = config.pinned_layer_modes
        #: the input embeddings ``quantize_embeddings`` stores in another mode than ``mode`` ``{name: mode}`` (the
        #: setting's, so neither saved with the plan nor compared on resume; ``plugin.layer_modes`` lists them)
        self.embedding_modes: dict[str, str] = {}
        #: what the sensitivity-aware choice measured (``None`` without a target)
        self.report: Optional[SensitivityReport] = None
        #: what the convolutions' mode choice measured (``None``: no convolution in a 4-bit mode, or not measured)
        self.conv_report: Optional[SensitivityReport] = None
        #: the quantized model's output cosine on the probe, any mode (:mod:`~lightning_hbm.precision.accuracy`;
        #: ``None``: no quantized convolution, or not measured)
        self.conv_accuracy: Optional[ConvAccuracy] = None
        # the convolutions' mode choice, whose warning that held out such choices measured under the target is said at
        # the quantization
        self._conv_choice: Optional[ConvChoice] = None
        #: where the quantized layers are built (the strategy's root device; ``None``: where the weights are)
        self.device: Optional[torch.device] = None
        self.owner = owner
        #: what is saved with each checkpoint and compared at a resume (and which run's surgery took ``layer_modes``)
        self.saved = SavedSettings(config, owner)
        #: the targets of the surgery under way, listed once
        self.target_listing = TargetListing(config, owner)

    @property
    def config(self) -> QuantizationConfig:
        """The settings (frozen; the planner swaps ``mode`` for its fake-tensor twin with ``dataclasses.replace``: each
        part is handed the new settings)."""
        return self._config

    @config.setter
    def config(self, config: QuantizationConfig) -> None:
        self._config = self.saved.config = self.target_listing.config = self.measures.config = config

    @property
    def rounding_digest(self) -> Optional[str]:
        """CRC32 of the GPTQ-rounded 4-bit weights (saved with checkpoints, compared on resume; ``None``: not rounded)."""
        return self.gptq.digest if self.gptq is not None else None

    @property
    def correction_report(self) -> Optional[CorrectionReport]:
        """What the last surgery's calibrated correction did (``None``: off, or not run yet)."""
        return None if self.correction is None else self.correction.report

    @property
    def input_shifts(self) -> Optional[dict[str, Tensor]]:
        """``{layer name: int8 exponents}`` measured (or resumed) at fit start."""
        return None if self.smoothing is None else self.smoothing.shifts

    @property
    def smoothing_report(self) -> Optional[SmoothingReport]:
        """What the smoothing measured (``None`` when resumed or not smoothed)."""
        return None if self.smoothing is None else self.smoothing.report

    # ------------------------------------------------------------------ targets

    def listing(self, module: nn.Module) -> Listing:
        """The targets of ``module`` and the layers left alone with (reason, deliberate), listed once per surgery."""
        return self.target_listing.listing(module)

    def _listed(self, module: nn.Module, trainer: Any) -> tuple[TargetRule, Listing]:
        """The rule of this surgery and its listing of ``module`` (:meth:`TargetListing.listed`)."""
        return self.target_listing.listed(module, trainer)

    def targets(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, layer)`` of every layer quantized in ``module``, before any change."""
        return self.listing(module)[0]

    # ------------------------------------------------------------------ the surgery points

    def check(self, module: nn.Module, trainer: Any) -> None:
        """The checks of the surgery (nothing changes): list the targets, validate, measure what the plan needs.

        Measured here, before the first change: an unreachable target fails with the model untouched, and on resume
        the plan exists before the saved settings (the plan included) are compared with this run's.

        Raises:
            ValueError: the model cannot be quantized with these settings, or a target cannot be met.
        """
        self.target_listing.reset()  # a new surgery: list the model as it is now
        if self.config.layer_modes is None:
            self.layer_modes = self.conv_report = None  # a plugin reused by another Trainer measures again
        self.saved.taken_by(trainer)
        rule, listing = self._listed(module, trainer)
        _validate(module, rule, listing, self.config.format, self.config.torch_dtype)
        fake = on_fake_tensors(module)  # the planner's trace (a model cut to fewer blocks): nothing is measured there
        check_accuracy_at(module, None if fake else self.config.accuracy_at)
        targets = listing.targets
        self.embedding_modes = rule.embedding_modes(listing, {})
        if self.config.layer_modes is not None or isinstance(self.config.quantize_embeddings, str):
            layer_modes_of(targets, self.config.format, rule.embedding_modes(listing, self.layer_modes or {}), listing.skipped)
        warning = regrid_warning(targets, self.config.format.name)
        if warning is not None:
            rank_zero_warn(warning)
        if self.config.quantize_embeddings:
            self.target_listing.say_embeddings_kept(module)  # kept in the compute dtype: said
        # what the quantization measures, the layer modes once, the reference (:func:`~lightning_hbm.precision.mode_choice.measure_and_choose`)
        self.conv_accuracy = None
        chosen = measure_and_choose(module, targets, trainer, fake, self.measures, self.saved, self.settings(), self.layer_modes)
        self.layer_modes, self.report, self._conv_choice = chosen.layer_modes, chosen.report, chosen.conv
        if chosen.conv is not None:
            self.conv_report = chosen.conv.report
        said = accuracy_at_unused(module, None if fake else self.config.accuracy_at, self.measures.reference, chosen.recorded)  # never called: raised
        if said is not None:
            rank_zero_warn(said)

    def convert(self, module: nn.Module, trainer: Any) -> list[str]:
        """Quantize the targets of ``module`` in place, one way, each step handing its value to the next: the targets the
        checks listed, what they measured (both done now if the checks did not run), the quantization
        (:func:`~lightning_hbm.precision.targets.quantize_listed`) under the smoothing exponents, then the record:
        what it did, said and kept. Returns the names of the layers quantized.

        Raises:
            ValueError: as :func:`~lightning_hbm.precision.quantize_model`, or a resumed GPTQ rounding that differs.
        """
        rule, listed = self._listed(module, trainer)  # the checks' targets, handed on
        self.embedding_modes = rule.embedding_modes(listed, {})
        correction, smoothing = self.correction, self.smoothing
        inputs = correction is not None and correction.hessians is None and correction.saved is None
        smooth = smoothing is not None and smoothing.shifts is None
        if inputs or smooth:  # a plain call that did not run the checks
            self.measures.measure_model(module, listed[0], trainer, inputs, smooth, self.settings())
        hessians = self.gptq.hessians if self.gptq is not None else None
        if correction is not None:
            correction.start()
        config = self.config
        with smoothing.attached(module) if smoothing is not None else nullcontext():
            quantized = quantize_listed(module, rule, listed, config.format, config.torch_dtype, self.layer_modes or {}, self.device, hessians, correction)
        self.target_listing.reset()  # the model changed: the next surgery lists it again
        log.info("lightning_hbm: %d layers stored as %s", len(quantized), config.format.name)
        if smoothing is not None:  # read where the layer is defined: the smoothing's module is not entered again
            report_unsmoothed(module, quantized, smoothing.shifts)
        if self.gptq is not None and hessians is not None:  # the CRC checked against the checkpoint being resumed
            self.gptq.finish(module, quantized, self.layer_modes, resume.saved_part(trainer).get(DIGEST_KEY))
        if correction is not None:
            correction.finish(module)
        # the quantized model's output on the probe against the model as built (any mode): the reference handed on
        reference, self.measures.reference = self.measures.reference, None
        threshold = config.min_cosine if config.min_cosine is not None else CONV_MIN_COSINE
        # measured where the checks measured (a LightningModule without forward: the reference's submodule), the
        # bitsandbytes layers left as quantized (a checkpoint being resumed loads into them next)
        with bnb_compat.forward_as_quantized(module) if reference is not None else nullcontext():
            self.conv_accuracy = check_accuracy(module, reference, quantized, self.layer_modes or {}, config, threshold)
        # the mode choice's warning, where the measured figure did not say more, nor was quiet on 32 samples (session 36)
        # (not where the modes were chosen on those same samples: quiet there by construction, session 37)
        choice, self._conv_choice, measured = self._conv_choice, None, self.conv_accuracy
        said = measured is not None and (measured.warned or (measured.quiet_on_enough and measured.samples > (choice.chosen_on if choice else 0)))
        if choice is not None and choice.gap is not None and not said:
            rank_zero_warn(choice.gap)
        return quantized

    def probe(self, trainer: Any) -> Any:
        """The batch the layer modes are measured on (:meth:`~lightning_hbm.precision.measures.Measures.probe`)."""
        return self.measures.probe(trainer)

    # ------------------------------------------------------------------ resume (:class:`SavedSettings`)

    def settings(self) -> dict[str, Any]:
        """The settings a resume compares (:meth:`SavedSettings.settings`, the embeddings as the last listing kept them)."""
        return self.saved.settings(self.target_listing.embeddings_kept)

    def saved_layer_modes(self, trainer: Any) -> Optional[dict[str, str]]:
        """The layer modes in the checkpoint ``trainer`` is resuming, if it was saved with these settings (else ``None``)."""
        return self.saved.saved_layer_modes(trainer, self.settings())

    def saved_plan(self, trainer: Any) -> Optional[dict[str, str]]:
        """Deprecated: the old name of :meth:`saved_layer_modes` ("plan" names the planner's, issue 54)."""
        warnings.warn("Quantization.saved_plan is deprecated: use Quantization.saved_layer_modes (the same result).", DeprecationWarning, stacklevel=2)
        return self.saved_layer_modes(trainer)

    def resume_config(self, trainer: Any) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint (``trainer``: the run's, or ``None``)."""
        return self.saved.resume_config(trainer, self.settings(), self.layer_modes)

    def save(self, meta: dict[str, Any]) -> None:
        """Into the lightning_hbm part ``meta`` of a checkpoint: the GPTQ CRC, then the smoothing exponents (:meth:`Measures.save`)."""
        self.measures.save(meta)


def __getattr__(name: str) -> Any:
    # the old name of Quantization ("plan" names the planner's, issue 54): importable, with a warning naming the new one
    if name == "QuantizationPlan":
        warnings.warn(f"{__name__}.QuantizationPlan is deprecated: use Quantization (the same class).", DeprecationWarning, stacklevel=2)
        return Quantization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CORRECTION_PROBE_TOKENS", "DIGEST_KEY", "KEPT_UNDER", "GPTQRounding", "Quantization", "QuantizationConfig", "modules_to_save", "saved_meta"]
