"""``QuantizedPrecision``: a Lightning precision plugin that stores frozen Linear weights quantized.

What it shrinks: the **parameters** term. Every Linear-like weight (the layer kinds of
:mod:`lightning_hbm.layers`: ``nn.Linear``, transformers ``Conv1D``, ``nn.MultiheadAttention``
projections, transformers-5 experts; unless ignored, tied, the output head, declared fp32 or a LoRA
``modules_to_save``) becomes quantized storage that never receives gradients; embeddings, norms and
biases stay trainable in the compute ``dtype``. Built on bitsandbytes directly rather than on
Lightning's ``BitsandbytesPrecision``, which refuses CPU, freezes biases and can only load fp32
weights on CUDA (checked with Lightning 2.6: an isinstance check on the accelerator, a CUDA-only load path).
"""

from __future__ import annotations

import logging
import re
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generator, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from typing_extensions import override

from lightning_hbm import resume
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.layers import report_coverage
from lightning_hbm.precision.bnb import import_bnb
from lightning_hbm.precision.gptq import ROUNDINGS, digest, grid_of, input_hessians
from lightning_hbm.precision.quantize import _layer_modes, _quantizable_linears, _validate, quantize_model
from lightning_hbm.precision.registry import format_of, get_mode, to_dtype
from lightning_hbm.precision.sensitivity import SensitivityPlan, check_plan_args, choose_plan
from lightning_hbm.precision.smoothing import Smoothing, SmoothingReport
from lightning_hbm.probe import first_batch
from lightning_hbm.surgery import (
    SAVED_MODULES_ATTR,
    applied_transforms,
    mark_applied,
    pack_checkpoint,
    pending_checkpoint,
    plugin_trainer,
    trainer_optimizers,
    trainer_surgery,
)

log = logging.getLogger(__name__)

_LIGHTNING_NAMES = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float32: "32-true"}


_DIGEST_KEY = "gptq_digest"  # the CRC of the GPTQ-rounded base, in the checkpoint's lightning_hbm part


class QuantizedPrecision(Precision):
    """Frozen base weights stored quantized (bitsandbytes or ``int8-dynamic``), selected by name.

    Args:
        mode: one of :func:`lightning_hbm.available_precisions` (``nf4``, ``nf4-dq``, ``fp4``,
            ``fp4-dq``, ``int8``, ...).
        dtype: compute dtype of the quantized matmuls and storage dtype of every other parameter:
            ``"bfloat16"``/``"bf16"``, ``"float16"``, ``"float32"`` or a ``torch.dtype``.
        ignore_modules: submodules whose Linears stay unquantized, matched as LoRA's ``target_modules``: a
            list of names (``["lm_head"]``; a name also matches as a suffix, and everything under it) and
            glob patterns (``["*.mixer.dt_proj"]``), or a regex string (full match). An entry that matches
            nothing is an error.
        quantize_head: also quantize the output head (:func:`~lightning_hbm.layers.output_heads`, in any
            model: transformers' ``get_output_embeddings()``, a tied head, the last vocabulary-wide Linear). Off by default, as transformers' own quantizers do: the head sees every token's
            logits and is the layer most hurt by 4-bit error.
        max_bytes_per_param, min_cosine: sensitivity-aware mixed precision
            (:mod:`lightning_hbm.precision.sensitivity`). Before quantizing, the most sensitive Linears
            (measured on ``probe_batch``) are kept in ``sensitive_mode`` and the rest stored in ``mode``,
            so that the quantizable weights take at most ``max_bytes_per_param`` bytes per parameter
            (quantization constants included) and/or the probe output cosine (the metric
            ``QuantizationQuality`` logs) reaches ``min_cosine``. A target that cannot be met is a
            ``ValueError`` naming the best reachable figure, before anything changes.
        sensitive_mode: the wider mode(s) a sensitive layer may take instead of ``mode``: one name, a
            list (e.g. ``["nf4-dq-b32", "int8"]``: chosen per layer) or ``"auto"`` (default): for
            ``nf4-dq`` (``nf4``) its 32-weight blocks ``nf4-dq-b32`` (``nf4-b32``) and ``int8``; for
            ``int8`` and ``int8-dynamic``, ``"none"``; otherwise ``int8``. ``"none"`` keeps a layer
            in ``dtype``, frozen.
        probe_batch: the batch the plan is measured on (as for ``QuantizationQuality``); ``None``: the
            first batch of the datamodule's ``train_dataloader``.
        layer_modes: an explicit plan ``{layer name: mode name}`` (e.g. ``plan`` of an earlier run);
            layers not named use ``mode``.
        rounding: ``"nearest"`` (the format's own) or ``"gptq"``: 4-bit layers are rounded by GPTQ
            (:mod:`lightning_hbm.precision.gptq`) with their inputs on ``probe_batch`` (one forward),
            stored in their own format at the same bytes, less output error. Layers whose format has no
            code grid (``QuantFormat.rounding_grid``: int8 modes) and the projections of an
            ``nn.MultiheadAttention`` keep nearest rounding (logged, with their modes).
            A resume rebuilds the rounding from the probe and checks it against the checkpoint's CRC.
        smoothing: for layers stored in ``"int8-dynamic-smooth"`` (``mode``, ``sensitive_mode`` or in
            ``layer_modes``): the SmoothQuant migration strength ``alpha`` in [0, 1], or ``"auto"`` (the
            default there: chosen per layer on ``probe_batch``); see :mod:`lightning_hbm.precision.smoothing`.
            The factors are measured before quantizing (logged: layers smoothed, alphas, probe output cosine
            before/after), saved in every checkpoint and taken back from it on resume. Other modes: must be None.

    Always left in full precision: Linears tied to another module, the modules a model declares in
    ``_keep_in_fp32_modules`` (kept in fp32) and the ``modules_to_save`` of the Trainer's ``LoRA``.
    At fit start (rank 0) the layer-kind coverage table is logged (:mod:`lightning_hbm.layers`):
    per kind, parameters quantized / adapted / checkpointed / left alone and why; a kind holding
    more than 5 % of the parameters that nothing handles is a warning naming it.

    The mixed-precision plan (:attr:`plan`) is logged and saved with the plugin's settings (targets included)
    in every checkpoint; a resume with the same settings takes the saved plan (nothing measured, so a fresh
    model with another init resumes exactly), and other settings or another pinned plan are a resume error.

    Applied at lightning_hbm's surgery point (:mod:`lightning_hbm.surgery`): after
    ``configure_model``, before ``configure_optimizers``, first of all model changes.

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")])
    """

    def __init__(
        self,
        mode: str = "nf4-dq",
        dtype: Union[str, torch.dtype] = "bfloat16",
        ignore_modules: Union[str, Sequence[str]] = (),
        quantize_head: bool = False,
        max_bytes_per_param: Optional[float] = None,
        min_cosine: Optional[float] = None,
        sensitive_mode: Union[str, list[str]] = "auto",
        probe_batch: Optional[Any] = None,
        layer_modes: Optional[Mapping[str, str]] = None,
        rounding: str = "nearest",
        smoothing: Optional[Union[float, str]] = None,
    ) -> None:
        check_args(QuantizedPrecision.__init__, locals())
        self.mode = get_mode(mode)
        self.dtype = to_dtype(dtype)
        if self.dtype not in self.mode.dtypes:
            raise ValueError(
                f"Precision mode {mode!r} does not support dtype {self.dtype}. "
                f"Supported: {[str(d) for d in self.mode.dtypes]}; pass dtype='bfloat16' for example."
            )
        if isinstance(ignore_modules, str):
            try:
                re.compile(ignore_modules)
            except re.error as err:
                raise ValueError(
                    f"ignore_modules={ignore_modules!r} is a string, read as a regex (full match, as LoRA's target_modules), "
                    f"but it is not a valid one: {err}. Pass a list of module names or glob patterns instead."
                ) from err
        self.ignore_modules = ignore_modules if isinstance(ignore_modules, str) else tuple(ignore_modules)
        self.quantize_head = bool(quantize_head)
        check_plan_args(self.mode.name, max_bytes_per_param, min_cosine, sensitive_mode, probe_batch, layer_modes)
        if rounding not in ROUNDINGS:
            raise ValueError(f"QuantizedPrecision(rounding={rounding!r}): use one of {list(ROUNDINGS)}.")
        self.rounding = rounding
        #: ``{layer name: 2 X^T X}`` on the probe, for GPTQ rounding (measured in the checks, freed after)
        self._hessians: Optional[dict[str, Tensor]] = None
        #: CRC32 of the GPTQ-rounded 4-bit weights (saved with checkpoints, compared on resume)
        self.rounding_digest: Optional[str] = None
        self.max_bytes_per_param, self.min_cosine = max_bytes_per_param, min_cosine
        # a list in the resume settings: the checkpoint stores lists (a tuple would compare unequal after a load)
        self.sensitive_mode = sensitive_mode if isinstance(sensitive_mode, str) else list(sensitive_mode)
        self.probe_batch = probe_batch
        #: the per-layer plan ``{layer name: mode name}`` (``None``: every layer in ``mode``)
        self.plan: Optional[dict[str, str]] = dict(layer_modes) if layer_modes else None
        self._pinned_plan = self.plan is not None
        #: what the sensitivity-aware choice measured (``None`` without a target)
        self.plan_report: Optional[SensitivityPlan] = None
        sensitive = [sensitive_mode] if isinstance(sensitive_mode, str) else list(sensitive_mode)
        #: the smoothing of layers stored in ``int8-dynamic-smooth`` (``None`` when no layer may be)
        self._smoothing = Smoothing.configure(smoothing, [self.mode.name, *sensitive, *(layer_modes or {}).values()], self.mode.name)
        if self.mode.peft_kind is not None:  # bitsandbytes modes: fail now, not at fit time
            import_bnb()
        self.precision = _LIGHTNING_NAMES[self.dtype]  # what trainer.precision reports
        # Set by the surgery spine to the strategy's root device, so weights are quantized there.
        self.target_device: Optional[torch.device] = None

    runs_surgery = True  # the surgery spine needs no wrapper around this plugin: it calls the engine itself

    @property
    def smoothing(self) -> Optional[Union[float, str]]:
        """The smoothing setting (``None`` when no layer is stored in ``int8-dynamic-smooth``)."""
        return None if self._smoothing is None else self._smoothing.setting

    @property
    def input_shifts(self) -> Optional[dict[str, Tensor]]:
        """``{layer name: int8 exponents}`` measured (or resumed) at fit start."""
        return None if self._smoothing is None else self._smoothing.shifts

    @property
    def smoothing_report(self) -> Optional[SmoothingReport]:
        """What the smoothing measured (``None`` when resumed or not smoothed)."""
        return None if self._smoothing is None else self._smoothing.report

    @property
    def _name(self) -> str:
        return f"QuantizedPrecision({self.mode.name})"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """lightning_hbm's surgery point: checks, quantization, then the Trainer's transforms."""
        return trainer_surgery(module, self, self.convert_base)

    def convert_base(self, module: nn.Module) -> nn.Module:
        """Quantize ``module``'s layers in place (once per model), and nothing else."""
        if self._name in applied_transforms(module):
            return module
        if self._smoothing is not None and self._smoothing.shifts is None:  # not checked first (a plain call)
            self._smooth(module, self._linear_targets(module))
        with self._attached_shifts(module):
            quantized = quantize_model(
                module,
                self.mode,
                self.dtype,
                self.ignore_modules,
                self.target_device,
                self.quantize_head,
                _lora_saved(module),
                layer_modes=self.plan,
                hessians=self._hessians,
            )
        log.info("lightning_hbm: %d layers stored as %s", len(quantized), self.mode.name)
        if self._smoothing is not None:
            self._smoothing.report_unsmoothed(module, quantized)
        if self._hessians is not None:
            self._check_rounding(module, quantized)
        mark_applied(module, self._name)
        return module

    def _check_rounding(self, module: nn.Module, quantized: list[str]) -> None:
        rounded = [n for n in quantized if n in self._hessians and grid_of(module.get_submodule(n)) is not None]
        nearest = [n for n in quantized if n not in rounded and (self.plan or {}).get(n) != "none"]
        self._hessians = None  # in_features**2 floats per layer input: not kept for training
        self.rounding_digest = digest(module, rounded)
        # by name and mode: a mode whose format has no code grid for GPTQ (QuantFormat.rounding_grid) says so here
        modes = {n: getattr(format_of(module.get_submodule(n)), "name", "none") for n in nearest[:12]}
        log.info(
            "lightning_hbm: GPTQ rounding of %d 4-bit layers on the probe batch (CRC %s); nearest rounding kept for %d "
            "layers whose mode has no GPTQ code grid or that the probe did not reach (layer: mode): %s",
            len(rounded), self.rounding_digest, len(nearest), modes,
        )
        saved = self._saved_meta(self._trainer(module)).get(_DIGEST_KEY)
        if saved is not None and saved != self.rounding_digest:
            raise ValueError(
                f"The GPTQ rounding rebuilt for this resume (CRC {self.rounding_digest}) differs from the one the "
                f"checkpoint was trained with (CRC {saved}): the probe batch differs (or the weights on another device). "
                "Resume with the same probe_batch (or datamodule) as the run that saved it; nothing has been trained yet."
            )

    def check_model(self, module: nn.Module) -> None:
        """Raise before any change if ``module`` cannot be quantized with these settings."""
        if self._name in applied_transforms(module):
            return
        _validate(module, self.mode, self.dtype, self.ignore_modules)
        targets, _ = _quantizable_linears(module, self.ignore_modules, self.quantize_head, _lora_saved(module))
        if self._pinned_plan:
            _layer_modes(targets, self.mode, self.plan or {})
        if self.rounding == "gptq":  # one forward on the model as built: every layer's input statistics
            self._hessians = input_hessians(module, [name for name, _ in targets], self._probe(module))
        if self._smoothing is not None:  # before the plan: the plan measures the smoothed layers
            self._smooth(module, [name for name, layer in targets if isinstance(layer, nn.Linear)])
        if not self._pinned_plan and (self.max_bytes_per_param is not None or self.min_cosine is not None):
            # measured per nn.Linear (other kinds, e.g. Conv1D or the projections a MultiheadAttention becomes, use mode)
            with self._attached_shifts(module):
                self._choose_plan(module, [name for name, layer in targets if isinstance(layer, nn.Linear)])

    def quantization_targets(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, layer)`` of every layer this plugin quantizes in ``module`` (``LoRA`` reads it before any change)."""
        return _quantizable_linears(module, self.ignore_modules, self.quantize_head, _lora_saved(module))[0]

    def _linear_targets(self, module: nn.Module) -> list[str]:
        targets, _ = _quantizable_linears(module, self.ignore_modules, self.quantize_head, _lora_saved(module))
        return [name for name, layer in targets if isinstance(layer, nn.Linear)]

    def _smooth(self, module: nn.Module, names: list[str]) -> None:
        """The smoothing exponents of the Linears ``names``: the checkpoint's when resuming with these settings."""
        assert self._smoothing is not None

        def saved() -> dict[str, Any]:
            meta = self._saved_meta(self._trainer(module))
            config = meta.get("configs", {}).get(type(self).__qualname__) or {}
            same = all(config.get(k) == v for k, v in self.resume_config().items() if k != "layer_modes")
            return meta if same else {}

        path = getattr(self._trainer(module), "ckpt_path", None)  # named in a refusal of the saved exponents
        self._smoothing.measure(module, names, self.dtype, lambda: self._probe(module), saved, path)

    def _attached_shifts(self, module: nn.Module) -> AbstractContextManager:
        return self._smoothing.attached(module) if self._smoothing is not None else nullcontext()

    def _trainer(self, module: nn.Module) -> Any:
        return lightning_compat.attached_trainer(module) or plugin_trainer(self)

    def _probe(self, module: nn.Module) -> Any:
        if self.probe_batch is not None:
            return self.probe_batch
        return first_batch(self._trainer(module), "QuantizedPrecision")

    def _choose_plan(self, module: nn.Module, names: list[str]) -> None:
        # Measured here, in the checks: an unreachable target fails before the first change, and on resume
        # the plan exists before the saved settings (the plan included) are compared with this run's.
        trainer = self._trainer(module)
        self.plan = self.plan_report = None  # a plugin reused by another Trainer measures again
        saved = self._saved_plan(trainer)
        if saved is not None:  # resuming: rebuild the plan the checkpoint was trained with (a fresh model may differ)
            self.plan = saved
            log.info("lightning_hbm: mixed precision plan taken from the checkpoint being resumed")
            return
        report = choose_plan(
            module, names, self.mode.name, self.sensitive_mode, self.dtype, self._probe(module),
            max_bytes_per_param=self.max_bytes_per_param, min_cosine=self.min_cosine, hessians=self._hessians,
        )
        self.plan, self.plan_report = report.modes, report
        log.info("lightning_hbm: mixed precision plan: %s", report.summary(self.mode.name))

    @staticmethod
    def _saved_meta(trainer: Any) -> dict[str, Any]:
        """The lightning_hbm part of the checkpoint being resumed (empty when none)."""
        checkpoint = pending_checkpoint(trainer) or {}
        if checkpoint:
            resume.verify(checkpoint, trainer.ckpt_path)  # structure, version, CRCs: before this part is read
        return checkpoint.get(resume.META_KEY) or {}

    def _saved_plan(self, trainer: Any) -> Optional[dict[str, str]]:
        """The plan in the checkpoint being resumed, if it was saved with this plugin's settings."""
        if trainer is None:
            return None
        saved = self._saved_meta(trainer).get("configs", {}).get(type(self).__qualname__) or {}
        config = self._settings()
        if any(saved.get(key) != value for key, value in config.items()):
            return None  # other settings: measure, and the resume check lists every difference
        return saved.get("layer_modes")

    def _ignore_list(self) -> Union[str, list[str]]:
        return self.ignore_modules if isinstance(self.ignore_modules, str) else list(self.ignore_modules)

    def resume_config(self) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint."""
        config = self._settings()
        plan = self.plan
        if plan is None and "max_bytes_per_param" in config:
            # compared before the surgery measures a plan (the load hook, before Lightning's restore): with the same
            # settings the plan will be the checkpoint's own (_choose_plan), so that one is this run's
            plan = self._saved_plan(plugin_trainer(self))
        if plan is not None:
            config["layer_modes"] = dict(plan)
        return config

    def _settings(self) -> dict[str, Any]:
        config = {
            "mode": self.mode.name,
            "dtype": str(self.dtype),
            "ignore_modules": self._ignore_list(),
            "quantize_head": self.quantize_head,
        }
        targets = {"max_bytes_per_param": self.max_bytes_per_param, "min_cosine": self.min_cosine}
        if any(value is not None for value in targets.values()):
            config.update(targets, sensitive_mode=self.sensitive_mode)
        if self._pinned_plan and self.plan is not None:  # a plan the user gave: a setting like the others
            config["layer_modes"] = dict(self.plan)
        if self.rounding != "nearest":  # absent before this option existed: older checkpoints keep matching
            config["rounding"] = self.rounding
        if self.smoothing is not None:
            config["smoothing"] = self.smoothing
        return config

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainer = plugin_trainer(self)
        if trainer is not None:
            pack_checkpoint(trainer, checkpoint)
        if self.rounding_digest is not None and resume.META_KEY in checkpoint:
            checkpoint[resume.META_KEY][_DIGEST_KEY] = self.rounding_digest
        if self._smoothing is not None and resume.META_KEY in checkpoint:
            self._smoothing.save(checkpoint[resume.META_KEY])

    @override
    def connect(self, model: Any, optimizers: Any, lr_schedulers: Any) -> Any:
        # Runs after the whole surgery (quantize -> adapters -> checkpointing) and configure_optimizers:
        # the one moment the final model is known before training, on every strategy.
        optimizers = trainer_optimizers(self, optimizers, lr_schedulers)
        result = super().connect(model, optimizers, lr_schedulers)
        trainer = lightning_compat.attached_trainer(model)
        if trainer is not None and trainer.state.fn == "fit":
            report_coverage(model, quantizing=True)
        return result

    def _dtype_context(self) -> AbstractContextManager:
        if self.dtype == torch.float32:
            return nullcontext()
        return _default_dtype(self.dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._dtype_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._dtype_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return self._dtype_context()

    @override
    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_cast_floating(self.dtype), dtype=Tensor)

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_cast_floating(torch.get_default_dtype()), dtype=Tensor)

    def __repr__(self) -> str:
        return (
            f"QuantizedPrecision(mode={self.mode.name!r}, dtype={self.dtype}, ignore_modules={self._ignore_list()!r}, "
            f"quantize_head={self.quantize_head}"
            + (f", smoothing={self.smoothing!r}" if self.smoothing is not None else "")
            + (f", rounding={self.rounding!r}" if self.rounding != "nearest" else "")
            + ")"
        )


def _lora_saved(module: nn.Module) -> list[str]:
    """``modules_to_save`` of the callbacks of the Trainer ``module`` is attached to (they stay unquantized).

    Read by duck typing (``LoRA`` has the attribute): the precision level sits below the callbacks
    (``tests/test_layering.py``).
    """
    trainer = lightning_compat.attached_trainer(module)
    names = [name for cb in getattr(trainer, "callbacks", []) for name in getattr(cb, "modules_to_save", None) or ()]
    # without a Trainer (the planner's surgery), the ones run_surgery was given
    return names + [n for n in getattr(module, SAVED_MODULES_ATTR, ()) if n not in names]


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floating(dtype: torch.dtype) -> Any:
    def cast(tensor: Tensor) -> Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return cast


def precision_plugin(name: str, **kwargs: Any) -> QuantizedPrecision:
    """The precision plugin registered as ``name``: ``precision_plugin("nf4-dq", dtype="bf16")``."""
    return QuantizedPrecision(mode=name, **kwargs)
