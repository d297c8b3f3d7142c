"""``Measures``: what one ``Quantization`` measures on the model as built, before any change.

The probe (the model and its probe batch, :class:`~lightning_hbm.probe.Probe`: ``probe_batch``, else the first
training batches, drawn once a surgery and handed to each measure), then on it the inputs' statistics (GPTQ rounding
and the calibrated correction share them) and the smoothing exponents, each taken back instead from the checkpoint
being resumed with these settings (:meth:`Measures.resumed`, next to the probe it replaces), and the reference of
the fit-start accuracy check (the model as built's output, :class:`~lightning_hbm.precision.accuracy.Reference`).
Holds the parts that measure (the GPTQ rounding, the correction, the smoothing) and what the checks hand on to the
quantization (the reference, the submodule a LightningModule without forward is measured through); the settings a
resume compares are handed in by the ``Quantization``, read once a surgery.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor  # as layers/readers.py: no public home

from lightning_hbm import resume
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers.correction import saved_factors
from lightning_hbm.layers.experts import convertible_experts, expert_names
from lightning_hbm.precision.accuracy import CHECK_SAMPLES, Reference, unmeasured_reference_warning
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.correction import CalibratedCorrection
from lightning_hbm.precision.embedding_correction import TokenCounts
from lightning_hbm.precision.gptq import GPTQRounding, input_statistics
from lightning_hbm.precision.smoothing import Smoothing
from lightning_hbm.precision.target_listing import linear_names
from lightning_hbm.probe import Probe, Stepped, eval_no_grad, forward_on, stepped_inputs
from lightning_hbm.probe_batch import Drawn, doubled, first_and_joined, first_batches

log = logging.getLogger(__name__)

#: Tokens the default probe holds when ``correction_rank`` is set (the first training batches, joined): on the real
#: SmolLM2 after 150 LoRA steps a 512-token probe ended +1.49 % above 16-bit LoRA, a 2048-token one +0.74 % (issue 52).
CORRECTION_PROBE_TOKENS = 2048


def on_fake_tensors(module: nn.Module) -> bool:
    """Whether ``module`` holds fake tensors (the planner's trace): nothing to measure on."""
    return any(isinstance(p, FakeTensor) for p in module.parameters())


class Measures:
    """What one ``Quantization`` measures (module docstring).

    Args:
        config: the settings (the plugin's arguments, checked).
        owner: the name the settings are saved under in a checkpoint's ``configs`` (the plugin's class name).
    """

    def __init__(self, config: QuantizationConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.gptq = GPTQRounding() if config.rounding == "gptq" else None
        #: the calibrated low-rank correction of each quantized layer (``None``: off)
        self.correction = CalibratedCorrection(config.correction_rank, config.torch_dtype) if config.correction_rank else None
        #: the smoothing of layers stored in ``int8-dynamic-smooth`` (``None`` when no layer may be)
        self.smoothing = None if config.smoothing is None else Smoothing(config.smoothing)
        #: the model as built on the probe (recorded in the checks, handed to the quantization's accuracy check)
        self.reference: Optional[Reference] = None
        #: a LightningModule without forward: the submodule its training_step calls, measured instead (issue 53)
        self.stepped: Optional[Stepped] = None
        #: the accuracy check's own draw (:meth:`probes_once`: the first batches joined up to ``samples``), and how many
        #: samples it asks (``None``: it measures the surgery's probe, no samples asked)
        self.check_draw: Optional[tuple[Callable[[], Drawn], int]] = None

    def measure_model(
        self, module: nn.Module, targets: list[tuple[str, nn.Module]], trainer: Any, inputs: bool, smooth: bool,
        settings: dict[str, Any], probe: Optional[Callable[[], Probe]] = None,
    ) -> None:  # fmt: skip
        """What the quantization measures on the model as built, before any change: one probe forward for each target's
        input statistics (``inputs``: GPTQ rounding and the correction share them; the correction's factors are taken
        back from the checkpoint being resumed with these settings instead), then the smoothing exponents (``smooth``:
        of the ``nn.Linear`` targets, or the checkpoint's). Not on fake tensors (the planner): neither changes the bytes
        (the correction's factors are then zeros of their shapes, the exponents none). ``settings``: those a resume
        compares (:meth:`resumed`); ``probe``: the model and its probe batch of the surgery's checks
        (:meth:`probe_once`; ``None``: this call's own).

        Raises:
            ValueError: no probe batch, or one too small for ``correction_rank``.
        """
        fake = on_fake_tensors(module)
        resumed = self.resumed(trainer, settings) if trainer is not None and (self.correction is not None or self.smoothing is not None) else {}
        probe = probe or self.probe_once(module, trainer)
        correction = self.correction
        if inputs and correction is not None:
            correction.hessians = None
            # resuming with these settings: the file's factors, bit for bit (read where the layer declares its keys:
            # the correction's own module is entered once here, with the statistics, and once after the quantization)
            correction.saved = saved_factors(resumed.get("state_dict") or {}) if resumed else None
        fitting = correction is not None and correction.saved is None
        # an embedding's input is token ids: no input Gram, its rows' counts instead (the correction's)
        names = [name for name, layer in targets if not isinstance(layer, nn.Embedding)]
        embeddings = [name for name, layer in targets if isinstance(layer, nn.Embedding)] if correction is not None and fitting else []
        # the experts the surgery turns into Linears, measured per expert on the tokens routed to it (GPTQ's rounding
        # and the correction's): found once here, their Linears' names handed on
        experts = convertible_experts(module) if self.gptq is not None or fitting else {}
        per_expert = {linear for name, layer in experts.items() for linear in expert_names(name, layer)}
        if correction is not None and fitting:  # the planner's fake model gets factors only where a run can fit them
            correction.measurable = set(names) | per_expert | set(embeddings)
        if inputs and (self.gptq is not None or fitting) and not fake:
            with TokenCounts(module, embeddings) as counted:  # read in the same probe forward
                hessians, rows = input_statistics(module, names, probe().batch, experts)
            if self.gptq is not None:
                self.gptq.measured(hessians, rows, per_expert)
            if correction is not None and fitting:
                correction.measured(hessians, rows, per_expert, counted.counts)
        if smooth and self.smoothing is not None:
            path = trainer.ckpt_path if trainer is not None else None  # named in a refusal of the saved exponents
            self.smoothing.measure(module, linear_names(targets), self.config.torch_dtype, probe, lambda: resumed, path)

    def resumed(self, trainer: Any, settings: dict[str, Any]) -> dict[str, Any]:
        """The lightning_hbm part of the checkpoint ``trainer`` is resuming (as resume hands it over) when it was saved
        with ``settings`` (its layer modes aside), else empty: what the correction and the smoothing take back instead
        of measuring."""
        meta = resume.saved_part(trainer)
        config = meta.get("configs", {}).get(self.owner) or {}
        return meta if meta and all(config.get(k) == v for k, v in settings.items() if k != "layer_modes") else {}

    def save(self, meta: dict[str, Any]) -> None:
        """Into the lightning_hbm part ``meta`` of a checkpoint: the GPTQ CRC, then the smoothing exponents."""
        if self.gptq is not None:
            self.gptq.save(meta)
        if self.smoothing is not None:
            self.smoothing.save(meta)

    def probe(self, trainer: Any) -> Any:
        """The batch the layer modes are measured on: ``probe_batch``, else the first of the Trainer's train dataloader
        (a datamodule's, the loader passed to ``fit``, the module's own: :func:`~lightning_hbm.probe_batch.first_batch`);
        with ``correction_rank``, its first batches joined up to :data:`CORRECTION_PROBE_TOKENS` tokens.

        Raises:
            ValueError: no ``probe_batch`` and no train dataloader to draw one from.
        """
        if self.config.probe_batch is not None:
            return self.config.probe_batch
        correcting = self.correction is not None
        return first_batches(trainer, "QuantizedPrecision", CORRECTION_PROBE_TOKENS if correcting else 0, most=16 if correcting else 1)

    def probe_once(self, module: nn.Module, trainer: Any) -> Callable[[], Probe]:
        """The model and its probe batch (:meth:`probe`) for the measures of one surgery, handed to each: drawn at the
        first call (a resume may measure nothing), the same :class:`~lightning_hbm.probe.Probe` after (a batch that
        cannot be drawn raises at every call, as :meth:`probe`)."""
        return functools.cache(lambda: Probe(module, self.probe(trainer)))

    def probes_once(self, module: nn.Module, trainer: Any, samples: int) -> tuple[Callable[[], Probe], Callable[[], Probe]]:
        """The probe of the surgery's measures (:meth:`probe_once`) and the one its accuracy check measures: the same,
        but where ``samples`` (a conv net's :data:`~lightning_hbm.precision.accuracy.CHECK_SAMPLES`) is more than the
        first training batch holds and the plugin draws its probe itself (no ``probe_batch``, no ``correction_rank``):
        then the first batches joined up to ``samples``, from the same pass (:func:`~lightning_hbm.probe_batch.first_and_joined`).
        The measures choose on the first batch as before; the check reads what held-out data reads (a probe of 4 images
        read 0.986 where 64 held-out images read 0.975, and was quiet: ``benchmarks/conv_probe_samples.py``)."""
        self.check_draw = None
        if not samples or self.config.probe_batch is not None or self.correction is not None:
            drawn = self.probe_once(module, trainer)
            return drawn, drawn
        # lists the shapes read as per-sample images: batched tensors where the model runs on them joined (session 38)
        batched = functools.partial(lists_batched, module)
        both = functools.cache(lambda: first_and_joined(trainer, "QuantizedPrecision", 0, samples, most=samples, batched=batched))
        self.check_draw = (both, samples)
        first = functools.cache(lambda: Probe(module, both()[0]))
        return first, functools.cache(lambda: first() if both()[1] is both()[0] else Probe(module, both()[1]))

    def stepping(self, probe: Probe, names: list[str]) -> Probe:
        """``probe``, once the submodule of a LightningModule without forward holding every layer ``names`` is found
        (:func:`~lightning_hbm.probe.stepped_inputs`; kept for :func:`~lightning_hbm.probe.forwarding`, then handed to
        the reference): at the draw, before any measuring forward (the checks' only); whether it takes the batch is seen
        at the first of them (:class:`~lightning_hbm.probe.Stepped`)."""
        self.stepped = stepped_inputs(probe.module, probe.batch, names)
        return probe

    def record_reference(self, module: nn.Module, probe: Callable[[], Probe], first: Optional[Callable[[], Probe]], said: bool) -> None:
        """The model as built on the probe, for :func:`~lightning_hbm.precision.accuracy.check_accuracy`, where the convolutions' mode choice did not record it:
        one forward (none without a quantized convolution; without a probe batch or a forward: logged, not measured).
        ``first``: the first training batch, measured instead where ``probe`` (a conv net's first batches joined up to
        :data:`~lightning_hbm.precision.accuracy.CHECK_SAMPLES` samples) runs out of memory (a batch size chosen for memory) or
        fails otherwise (a forward written for the loader's batch size: session 36). ``said``: the 4-bit mode choice
        said already that the model went unmeasured (no probe batch, a probe it cannot run): not said twice."""
        reference = self.reference
        if reference is None:
            return
        if reference.output is not None:
            self._asked(reference)
            return
        try:
            try:
                _recorded_forward(module, reference, probe().batch)
            except Exception as error:  # noqa: BLE001 - the joined batch is ours, the first one the user's: it may still run
                if first is None:
                    raise
                why = f"ran out of memory ({error})" if isinstance(error, torch.OutOfMemoryError) else f"did not run ({type(error).__name__}: {error})"
                log.info("lightning_hbm: the accuracy check measures the first training batch: the first %d samples %s", CHECK_SAMPLES, why)
                _recorded_forward(module, reference, first().batch)
                reference.short = f"the first batches joined {why}"
        except Exception as error:  # noqa: BLE001 - a measurement never stops a healthy model: said, with the fix
            self.reference = None
            if not reference.convs:  # no convolution: a LightningModule without forward (the usual one) is no warning
                log.info("lightning_hbm: the output accuracy of the quantized model is not measured at fit start (%s: %s)", type(error).__name__, error)
            elif not said:
                rank_zero_warn(unmeasured_reference_warning(module, reference.convs, error))
            return
        self._asked(reference)

    def _asked(self, reference: Reference) -> None:
        """What the accuracy check's own draw asked and found, handed to ``reference`` (drawn by now: the reference was
        recorded on it): the samples it asked, how its lists were read, why it stopped short."""
        if self.check_draw is None:
            return
        both, asked = self.check_draw
        drawn = both()
        reference.asked, reference.batched = asked, drawn.batched
        reference.short = reference.short or drawn.short


def _recorded_forward(module: nn.Module, reference: Reference, batch: Any) -> None:
    """One forward of the model as built on ``batch``, recorded as the accuracy check's reference."""
    with eval_no_grad(module), reference.recording(module), torch_compat.preserved_rngs():  # the user's RNG draws as they were
        forward_on(module, batch)  # any output: every floating tensor of it is the reference


def lists_batched(module: nn.Module, batch: Any) -> bool:
    """Whether the lists of ``batch`` that read as per-sample images by their shapes
    (:func:`~lightning_hbm.probe_batch.per_sample_images`: a Conv1d net's ``(x [4, 16, 32], y)``, a ``[B, L, D]`` list)
    are batched tensors, decided by running, not by shape (session 38): ``batch`` joined with itself as batched tensors
    is given to the model's forward as the step's batch is (:func:`~lightning_hbm.probe.forward_on`), and kept where the
    forward takes it as it takes ``batch``: every floating output of the same shape or twice as many along its first
    dimension, one at least twice. Per-sample images so joined are images of twice the channels, which a model's first
    convolution refuses (torchvision's detectors, a ``collate_fn=tuple``): read as images, as before. Two forwards of the
    model as built on the first batch, without gradients, the RNGs as they were; only where such a list is there."""
    try:
        twice_as_many = doubled(batch)  # (values it cannot compare, a NumPy array's: not joined either way)
        if twice_as_many is None:
            return False
        with eval_no_grad(module), torch_compat.preserved_rngs():
            once, twice = forward_on(module, batch), forward_on(module, twice_as_many)
    except Exception:  # noqa: BLE001 - refused as batched tensors: per-sample images (their forward's own error is the check's)
        return False
    once_out, twice_out = _floating(once), _floating(twice)
    if not once_out or len(once_out) != len(twice_out):
        return False
    same = [a.shape == b.shape for a, b in zip(once_out, twice_out)]
    doubled_out = [a.dim() > 0 and b.shape == (2 * a.shape[0], *a.shape[1:]) for a, b in zip(once_out, twice_out)]
    return all(s or d for s, d in zip(same, doubled_out)) and any(d and not s for s, d in zip(same, doubled_out))


def _floating(output: Any) -> list[torch.Tensor]:
    """The floating tensors of a forward's output (a ``ModelOutput``'s, a dict's, a tuple's)."""
    return [t for t in torch_compat.tensor_leaves(output) if t.is_floating_point()]


def one_batch(drawn: Callable[[], Probe], checked: Callable[[], Probe]) -> bool:
    """Whether the accuracy check measures the batch the measures choose on (:meth:`Measures.probes_once`): then
    the mode choice's first forward records the reference; else one forward more on the check's batch. No batch to
    draw: ``True`` (nothing is recorded either way; the mode choice says why)."""
    if checked is drawn:
        return True
    try:
        return checked() is drawn()
    except ValueError:
        return True


__all__ = ["CORRECTION_PROBE_TOKENS", "Measures", "lists_batched", "on_fake_tensors", "one_batch"]
