"""``Quantization``: what one ``QuantizedPrecision`` stores quantized, in which mode and how it is rounded.

:class:`~lightning_hbm.QuantizedPrecision` is the Lightning side of quantization (dtype hooks, the surgery entry,
checkpoint hooks); this object is the rest, one per plugin:

* its settings, a frozen :class:`~lightning_hbm.precision.config.QuantizationConfig` checked at construction (the
  plugin's arguments: same errors, same messages);
* the **targets**, the layers it quantizes and the ones it leaves alone (with why): listed once per surgery, in
  :meth:`Quantization.check` (a :class:`~lightning_hbm.precision.targets.Listing`); LoRA's checks
  (:meth:`Quantization.targets`) and the quantization reuse that listing (its Linear-like layers listed again only
  when preparing a layer kind replaced modules, e.g. ``nn.MultiheadAttention``);
* the **layer modes** ``{layer name: mode name}`` (:mod:`lightning_hbm.precision.mode_choice`), pinned by the
  user (``layer_modes``), measured on the probe or taken from the checkpoint being resumed;
* the **GPTQ rounding** (:class:`GPTQRounding`: input statistics, then the CRC of the rounded layers);
* the **smoothing** (:class:`~lightning_hbm.precision.smoothing.Smoothing`);
* the **resume metadata**: :meth:`Quantization.resume_config` (the settings a resume must share) and
  :meth:`Quantization.save` (the GPTQ CRC and the smoothing exponents, into each checkpoint).

It is called at the surgery points: :meth:`~Quantization.check` in the checks (before any change: the targets listed
once, then what the quantization measures, :mod:`~lightning_hbm.precision.measures`, then the layer modes once,
:mod:`~lightning_hbm.precision.mode_choice`, each handed the probe drawn once), and :meth:`~Quantization.convert` at
the quantization point, one way: the targets and measures of the checks handed on, the quantization
(:func:`~lightning_hbm.precision.targets.quantize_listed`), then the record. Both take the Trainer of the run (or
``None``): the probe batch and the checkpoint being resumed are read from it.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_hbm import resume
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm.layers import CONV
from lightning_hbm.precision.accuracy import CHECK_SAMPLES, ConvAccuracy, Reference, accuracy_at_unused, check_accuracy, check_accuracy_at
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.correction import CorrectionReport
from lightning_hbm.precision.gptq import DIGEST_KEY, GPTQRounding
from lightning_hbm.precision.int4_asym import regrid_warning
from lightning_hbm.precision.int8_dynamic import report_unsmoothed
from lightning_hbm.precision.measures import CORRECTION_PROBE_TOKENS, Measures, on_fake_tensors, one_batch
from lightning_hbm.precision.mode_choice import ConvChoice, conv_modes, linear_modes
from lightning_hbm.precision.saved_settings import SavedSettings, saved_meta
from lightning_hbm.precision.sensitivity import CONV_MIN_COSINE, SensitivityReport
from lightning_hbm.precision.smoothing import SmoothingReport
from lightning_hbm.precision.target_listing import KEPT_UNDER, TargetListing, linear_names, modules_to_save
from lightning_hbm.precision.targets import Listing, TargetRule, _validate, layer_modes_of, quantize_listed
from lightning_hbm.probe import Probe, forwarding, has_forward

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
        # the Trainer whose surgery measured or took ``layer_modes`` (weakly): a plugin reused by another Trainer compares
        # that run's plan at its resume, not the last fit's (session 32: a sweep's plugin refused its own checkpoint)
        self._modes_run: Optional[weakref.ref] = None
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
        #: what is saved with each checkpoint and compared at a resume
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

    def _say_embeddings_kept(self, module: nn.Module) -> None:
        """Warn about input embeddings ``quantize_embeddings`` keeps in the compute dtype (:meth:`TargetListing.say_embeddings_kept`)."""
        self.target_listing.say_embeddings_kept(module)

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
        self._modes_run = weakref.ref(trainer) if trainer is not None else None
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
            self._say_embeddings_kept(module)
        names = self._measured(module, targets, trainer, fake)  # what the quantization measures, the layer modes once, the reference
        said = accuracy_at_unused(module, None if fake else self.config.accuracy_at, self.measures.reference, names)  # never called: raised
        if said is not None:
            rank_zero_warn(said)

    def _measured(self, module: nn.Module, targets: list[tuple[str, nn.Module]], trainer: Any, fake: bool) -> list[str]:
        """The checks' measures on the model as built, handed the targets listed: the probe drawn once, the inputs'
        statistics and the smoothing (:meth:`~lightning_hbm.precision.measures.Measures.measure_model`), then the layer
        modes (the Linears', then the convolutions', :mod:`~lightning_hbm.precision.mode_choice`), then the accuracy
        check's reference (kept in the measures for the quantization). Returns the names of the layers the reference
        records (none: not measured)."""
        # a LightningModule without forward: measured through the submodule its training_step calls (issue 53)
        measures, settings = self.measures, self.settings()  # the settings a resume compares, read once the targets are listed
        measures.stepped = None
        stepping = [name for name, _ in targets] if not fake and not has_forward(module) else None
        # drawn at the first measure, then handed to each; a conv net's accuracy check measures more samples (session 35)
        conv_net = stepping is None and not fake and any(CONV.matches(layer) for _, layer in targets)
        drawn, checked = measures.probes_once(module, trainer, CHECK_SAMPLES if conv_net else 0)
        probe = drawn if stepping is None else functools.cache(lambda: measures.stepping(drawn(), stepping))
        with forwarding(module, lambda: measures.stepped):
            measures.measure_model(module, targets, trainer, True, True, settings, probe)  # smoothed before the plan, which measures it
            if self.config.measures_layer_modes:
                with self.smoothing.attached(module) if self.smoothing is not None else nullcontext():
                    self._choose_layer_modes(module, linear_names(targets), trainer, probe)
            convs = [name for name, layer in targets if CONV.matches(layer)]
            self._conv_choice = None
            # every model quantized is measured (session 32; was: only those with a quantized convolution, and a Pix2Struct
            # lost its output in nf4-dq, cosine 0.965, unsaid): the reference records every quantized layer's input
            # (a validate/predict/test run measures only models with convolutions, as before: a model of Linears alone
            # is not worth opening the train loader, which such a run never asked for)
            names = [name for name, _ in targets] if convs or trainer is None or trainer.state.fn == "fit" else []
            self.conv_accuracy, measures.reference = None, Reference(names, convs) if names and not fake else None
            # the mode choice's first forward is the model as built: the reference, where the check measures its batch
            with measures.reference.recording(module) if measures.reference is not None and one_batch(drawn, checked) else nullcontext():
                said = self._choose_conv_modes(module, convs, trainer, probe)
            measures.record_reference(module, probe if checked is drawn else checked, None if checked is drawn else drawn, said)
            if measures.reference is not None:  # the quantized model's forward runs where the model as built's ran
                measures.reference.stepped = measures.stepped
        measures.stepped = None
        return names

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
        if reference is not None:  # before the check's first forward of bitsandbytes 4-bit layers, as the surgery does
            # after the quantization: an eval forward on an AVX512-BF16 CPU would repack them for a kernel that bypasses autograd
            bnb_compat.disable_cpu_repacks(module)
        threshold = config.min_cosine if config.min_cosine is not None else CONV_MIN_COSINE
        # measured where the checks measured (a LightningModule without forward: the reference's submodule)
        self.conv_accuracy = check_accuracy(module, reference, quantized, self.layer_modes or {}, config, threshold)
        if reference is not None:  # as quantized: a checkpoint being resumed loads into it next
            bnb_compat.undo_int8_states(module)
        # the mode choice's warning, where the measured figure did not say more, nor was quiet on 32 samples (session 36)
        # (not where the modes were chosen on those same samples: quiet there by construction, session 37)
        choice, self._conv_choice, measured = self._conv_choice, None, self.conv_accuracy
        said = measured is not None and (measured.warned or (measured.quiet_on_enough and measured.samples > (choice.chosen_on if choice else 0)))
        if choice is not None and choice.gap is not None and not said:
            rank_zero_warn(choice.gap)
        return quantized

    def _choose_layer_modes(self, module: nn.Module, names: list[str], trainer: Any, probe: Callable[[], Probe]) -> None:
        """The Linear layers' modes under a target: the checkpoint's being resumed with these settings, else measured
        (:func:`~lightning_hbm.precision.mode_choice.linear_modes`)."""
        self.layer_modes = self.report = None  # a plugin reused by another Trainer measures again
        saved = self.saved_layer_modes(trainer)
        if saved is not None:  # resuming: rebuild the plan the checkpoint was trained with (a fresh model may differ)
            self.layer_modes = saved
            log.info("lightning_hbm: mixed precision plan taken from the checkpoint being resumed")
            return
        self.report = linear_modes(module, names, self.config, probe, self.gptq.hessians if self.gptq is not None else None)
        self.layer_modes = self.report.modes

    def _choose_conv_modes(self, module: nn.Module, names: list[str], trainer: Any, probe: Callable[[], Probe]) -> bool:
        """The convolutions' modes under a 4-bit mode (issue 53: :func:`~lightning_hbm.precision.mode_choice.conv_modes`),
        those it widens added to :attr:`layer_modes`, its warning of a gap held out kept for the quantization. Not with a
        pinned plan, nor when resuming (the checkpoint's modes are taken). Returns whether it said the model went
        unmeasured (no probe batch, a probe it cannot run): the accuracy check does not say it again."""
        if not names or self.config.layer_modes is not None or self.config.format.peft_kind != "4bit":
            return False
        if self.saved.saved(trainer):
            # resuming: the plan the checkpoint was trained with (Linears' and convolutions'); none saved (a checkpoint
            # from before issue 53): every convolution in mode, as it was trained
            self.layer_modes = self.saved_layer_modes(trainer) or self.layer_modes
            return False
        choice = conv_modes(module, names, self.config, probe, self.gptq.hessians if self.gptq is not None else None)
        self.conv_report, self._conv_choice = choice.report, choice
        if choice.widened:
            self.layer_modes = {**(self.layer_modes or {}), **choice.widened}
        return choice.said_unmeasured

    def probe(self, trainer: Any) -> Any:
        """The batch the layer modes are measured on (:meth:`~lightning_hbm.precision.measures.Measures.probe`)."""
        return self.measures.probe(trainer)

    # ------------------------------------------------------------------ resume

    def saved_layer_modes(self, trainer: Any) -> Optional[dict[str, str]]:
        """The layer modes in the checkpoint ``trainer`` is resuming, if it was saved with these settings (else ``None``)."""
        return self.saved.saved_layer_modes(trainer, self.settings())

    def saved_plan(self, trainer: Any) -> Optional[dict[str, str]]:
        """Deprecated: the old name of :meth:`saved_layer_modes` ("plan" names the planner's, issue 54)."""
        warnings.warn("Quantization.saved_plan is deprecated: use Quantization.saved_layer_modes (the same result).", DeprecationWarning, stacklevel=2)
        return self.saved_layer_modes(trainer)

    def resume_config(self, trainer: Any) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint (``trainer``: the run's, or ``None``)."""
        planned = self.config.layer_modes is not None or self._planned_for(trainer)
        return self.saved.resume_config(trainer, self.settings(), self.layer_modes if planned else None)

    def _planned_for(self, trainer: Any) -> bool:
        """Whether ``layer_modes`` is ``trainer``'s run's (its surgery measured or took it): a reused plugin's resume
        check runs before that run's surgery, when ``layer_modes`` is still the last fit's (another model's plan)."""
        return trainer is None or (self._modes_run is not None and self._modes_run() is trainer)

    def __getstate__(self) -> dict[str, Any]:
        # the weak references to this run's Trainer and model are this process's, not the plugin's settings: a Trainer
        # pickled or deep-copied after fit failed with "cannot pickle 'weakref.ReferenceType' object" (session 32); the
        # copy then compares the checkpoint's plan at a resume, as a plugin of no run does
        return {**self.__dict__, "_modes_run": None}

    def settings(self) -> dict[str, Any]:
        """The settings a resume compares (:meth:`SavedSettings.settings`, the embeddings as the last listing kept them)."""
        return self.saved.settings(self.target_listing.embeddings_kept)

    def save(self, meta: dict[str, Any]) -> None:
        """Into the lightning_hbm part ``meta`` of a checkpoint: the GPTQ CRC, then the smoothing exponents."""
        if self.gptq is not None:
            self.gptq.save(meta)
        if self.smoothing is not None:
            self.smoothing.save(meta)


def __getattr__(name: str) -> Any:
    # the old name of Quantization ("plan" names the planner's, issue 54): importable, with a warning naming the new one
    if name == "QuantizationPlan":
        warnings.warn(f"{__name__}.QuantizationPlan is deprecated: use Quantization (the same class).", DeprecationWarning, stacklevel=2)
        return Quantization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CORRECTION_PROBE_TOKENS", "DIGEST_KEY", "KEPT_UNDER", "GPTQRounding", "Quantization", "QuantizationConfig", "modules_to_save", "saved_meta"]
