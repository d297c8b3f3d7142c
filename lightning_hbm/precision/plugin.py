"""``QuantizedPrecision``: a Lightning precision plugin that stores frozen Linear weights quantized.

What it shrinks: the **parameters** term. Every Linear-like weight (the layer kinds of
:mod:`lightning_hbm.layers`: ``nn.Linear``, transformers ``Conv1D``, ``nn.MultiheadAttention``
projections, transformers-5 experts; unless ignored, tied, the output head, declared fp32 or a LoRA
``modules_to_save``) becomes quantized storage that never receives gradients; embeddings, norms and
biases stay trainable in the compute ``dtype``. Built on bitsandbytes directly rather than on
Lightning's ``BitsandbytesPrecision``, which refuses CPU, freezes biases and can only load fp32
weights on CUDA (checked with Lightning 2.6: an isinstance check on the accelerator, a CUDA-only load path).

Always left in full precision: Linears tied to another module and the ``modules_to_save`` of the Trainer's ``LoRA``.
The Linears a model declares in ``_keep_in_fp32_modules`` (T5's ``wo``) are stored in the mode and compute in fp32
(:class:`~lightning_hbm.layers.linear.Fp32ComputeLinear`).
At fit start (rank 0) the layer-kind coverage table is logged (:mod:`lightning_hbm.layers`):
per kind, parameters quantized / adapted / checkpointed / left alone and why; a kind holding
more than 5 % of the parameters that nothing handles is a warning naming it.

The per-layer modes (``layer_modes``, formerly ``plan``) are logged and saved with the plugin's settings (targets included)
in every checkpoint; a resume with the same settings takes the saved plan (nothing measured, so a fresh
model with another init resumes exactly), and other settings or another pinned plan are a resume error.

The plugin is the Lightning side only (dtype hooks, the surgery entry, checkpoint hooks); what it quantizes and
how (targets, sensitivity plan, GPTQ rounding, smoothing, resume settings) is its
:class:`~lightning_hbm.precision.quantization.Quantization`, ``plugin.quantization``; its settings are a frozen
:class:`~lightning_hbm.precision.config.QuantizationConfig`, ``plugin.config``, built by the constructor.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generator, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor  # as layers/readers.py: no public home
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.layers import report_coverage
from lightning_hbm.precision.compute_dtype import DtypeChoice, auto_dtype
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.correction import CorrectionReport
from lightning_hbm.precision.quantization import Quantization
from lightning_hbm.precision.registry import QuantFormat
from lightning_hbm.precision.sensitivity import SensitivityReport
from lightning_hbm.precision.smoothing import SmoothingReport
from lightning_hbm.quiet import quieted
from lightning_hbm.surgery import applied_transforms, mark_applied, pack_checkpoint, plugin_trainer, trainer_optimizers, trainer_surgery
from lightning_hbm.surgery.protocol import SurgeryPlugin

#: the settings read on the plugin as its own (``plugin.rounding``): the fields of its config, and two it derives
#: (and their former names, which warn: "plan" names the planner's, issue 54)
_SETTINGS = frozenset({f.name for f in dataclasses.fields(QuantizationConfig)} | {"pinned_layer_modes", "measures_layer_modes", "pinned_plan", "measures_plan"})
#: the former names among them -> the current ones
_FORMER = {"pinned_plan": "pinned_layer_modes", "measures_plan": "measures_layer_modes"}

#: what ``trainer.precision`` reports for each compute dtype (values of Lightning's precision Literal)
_LIGHTNING_NAMES: dict[torch.dtype, Any] = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float32: "32-true"}


class _TrueDtype(Precision):
    """Lightning's precision hooks for a model computing in one ``dtype`` (what Lightning's ``bf16-true`` does).

    Not Lightning's ``HalfPrecision``: strategies treat that class as theirs (and it takes no fp32).
    """

    dtype: torch.dtype

    def _dtype_context(self) -> AbstractContextManager:
        return nullcontext() if self.dtype == torch.float32 else _default_dtype(self.dtype)

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return self._dtype_context()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self._dtype_context()

    @override
    def forward_context(self) -> AbstractContextManager:
        return nullcontext() if self.dtype == torch.float32 else _computing_in(self.dtype, type(self).__name__)

    @override
    def convert_input(self, data: Any) -> Any:
        """Every floating tensor of the batch in the compute dtype, but for integer-valued ones the cast would
        change (box coordinates, prompts in pixels, diffusion timesteps: ``1001.`` is ``1000.`` in bf16): those stay
        as they are, said once (issue 53: a detector's targets were moved by the cast).

        The check costs a pass over each tensor (+1.5 ms a step on a 16x3x224x224 image batch, benchmarks/README.md):
        a position of the batch seen once holding other than whole numbers (features, images) is cast without it from
        then on; whole-numbered ones (boxes, timesteps) are checked at every batch."""
        kept: list[str] = []
        continuous = self.__dict__.setdefault("_continuous_inputs", set())
        data = apply_to_collection(data, function=_cast_floating(self.dtype, kept, continuous), dtype=Tensor)
        if kept and not getattr(self, "_said_kept", False):
            self._said_kept = True
            warnings.warn(
                f"lightning_hbm: {len(kept)} floating tensor(s) of the batch hold whole numbers that {self.dtype} does "
                f"not represent exactly (e.g. {kept[0]}): left in their dtype instead of cast (box coordinates or "
                "timesteps would move). If a model input needs the compute dtype, cast it in training_step; give "
                "integer data as an integer tensor to avoid this check.",
                UserWarning,
                stacklevel=2,
            )
        return data

    @override
    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_cast_floating(torch.get_default_dtype()), dtype=Tensor)


class QuantizedPrecision(_TrueDtype, SurgeryPlugin):
    """Frozen base weights stored quantized (bitsandbytes or ``int8-dynamic``), selected by name.

    Args:
        mode: one of :func:`lightning_hbm.available_precisions` (``nf4``, ``nf4-dq``, ``fp4``,
            ``fp4-dq``, ``int8``, ...).
        dtype: compute dtype of the quantized matmuls and storage dtype of every other parameter:
            ``"bfloat16"``/``"bf16"``, ``"float16"``, ``"float32"``, a ``torch.dtype``, or ``"auto"``: chosen by
            running (:mod:`lightning_hbm.precision.compute_dtype`) when the plugin is built: on a GPU bf16 where it
            is supported (not yet run on GPU); on a CPU bf16 only if a timed decoder block runs in under 0.9x float32's time there. The
            choice and its figures are in ``dtype_choice`` and in one line at fit start.
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
            Convolutions under a 4-bit mode are planned by default (issue 53: with BatchNorm statistics like a
            trained network's, uniform ``nf4-dq`` gave ResNet18 an output cosine of 0.91, a YOLO-style detector 0.10):
            at fit start each one's error is measured on the probe batch and the most sensitive are widened until the
            probe output cosine reaches ``min_cosine`` (default 0.985, ``CONV_TARGET_COSINE``: the probe reads 0.002-0.02
            above held out; ResNet18 then measured 0.982 held out at 0.567 bytes per conv weight), within
            ``max_bytes_per_param`` where set (the correction's factors counted; session 42: was not bounded); a plan
            under it is a warning naming the figure (and the budget that stopped it; a budget under the convolutions'
            uniform bytes stores them uniform, said, not an error). Not with ``layer_modes``, nor without a probe batch (a warning: for a BatchNorm
            conv net with the figure and the fix, else that the accuracy went unmeasured, with the fix). A BatchNorm conv net's plan is measured on the probe only:
            held out such plans measured 0.96-0.982 (issue 53), said at fit start with the fix (``mode="int8"``),
            unless the accuracy check below measured at least 32 samples and was quiet (session 36: noise there).
            In any mode, a model with quantized convolutions is run on the probe batch once more after the quantization,
            as this plugin computes it: a centred output cosine against the model as built under ``min_cosine`` (default
            0.98) is a warning naming the figure and the fix (:mod:`lightning_hbm.precision.accuracy`; ``int8`` in bf16
            gave the MobileNetV3-FPN backbone 0.975, ``dtype="float32"`` 0.993). An output selected by its values
            (a detector's post-processing: another number of boxes, or the same number picked or ordered otherwise by
            a sort, top-k, threshold or NMS) is measured at the last module calls returned before the first selection
            that differs (the heads).
        accuracy_at: the name of the module (as ``named_modules()`` of the module the plugin quantizes names it, e.g.
            ``"model.heads"``) whose output the fit-start accuracy check above, and the convolutions' plan, measure
            instead of the model's output (its lowest call). ``None`` (default): the output, or the heads where it is
            post-processed. A name that is no submodule, or one the probe forward never calls, is a ``ValueError``
            before anything changes; on a model without quantized convolutions (nothing measured), a warning.
        sensitive_mode: the wider mode(s) a sensitive layer may take instead of ``mode``: one name, a
            list (e.g. ``["nf4-dq-b32", "int8"]``: chosen per layer) or ``"auto"`` (default): for
            ``nf4-dq`` (``nf4``) its 32-weight blocks ``nf4-dq-b32`` (``nf4-b32``) and ``int8``; for
            ``int8`` and ``int8-dynamic``, ``"none"``; otherwise ``int8``. ``"none"`` keeps a layer
            in ``dtype``, frozen.
        probe_batch: the batch the plan is measured on (as for ``QuantizationQuality``); ``None``: the
            first batch of the datamodule's ``train_dataloader`` (with ``correction_rank``: its first batches
            joined until they hold 2048 tokens, ``CORRECTION_PROBE_TOKENS``).
        layer_modes: explicit per-layer modes ``{layer name: mode name}`` (e.g. ``layer_modes`` of an earlier run);
            layers not named use ``mode``.
        rounding: ``"nearest"`` (the format's own) or ``"gptq"``: 4-bit layers are rounded by GPTQ
            (:mod:`lightning_hbm.precision.gptq`) with their inputs on ``probe_batch`` (one forward),
            stored in their own format at the same bytes, less output error. Layers whose format has no
            code grid (``QuantFormat.rounding_grid``: int8 modes), transposed convolutions, input embeddings and
            layers the probe never reached keep nearest rounding: named at fit start in a warning, by reason, with
            the fix (:func:`~lightning_hbm.precision.gptq.nearest_warning`).
            A resume rebuilds the rounding from the probe and checks it against the checkpoint's CRC.
        smoothing: for layers stored in ``"int8-dynamic-smooth"`` (``mode``, ``sensitive_mode`` or in
            ``layer_modes``): the SmoothQuant migration strength ``alpha`` in [0, 1], or ``"auto"`` (the
            default there: chosen per layer on ``probe_batch``); see :mod:`lightning_hbm.precision.smoothing`.
            The factors are measured before quantizing (logged: layers smoothed, alphas, probe output cosine
            before/after), saved in every checkpoint and taken back from it on resume. Other modes: must be None.
        quantize_embeddings: how the input embeddings (each plain ``nn.Embedding``) are stored
            (:mod:`lightning_hbm.layers.embedding`): a lookup unpacks only the rows it reads; a head tied to one
            computes with the same quantized copy. ``"auto"`` (the default): in int8, whatever ``mode`` (the issue-51
            rule, a default where it costs under 0.3 %: on SmolLM2-135M -0.01 % held-out loss before training and no
            worse than the bf16 table after 150 steps, two seeds; on all-MiniLM-L6-v2 at most -0.017 % sentence cosine,
            two seeds; the 4-bit table costs +3.5 % after training: benchmarks/README.md); ``plugin.quantize_embeddings``
            reads what it chose. ``False``: kept in ``dtype`` (trainable, as before session 30). ``True``: in ``mode``.
            A mode name: in that mode, whatever the model's wrapping names them. An embedding shared with anything
            else, a subclass with its own forward, or one with ``max_norm`` stays in ``dtype`` (a warning names it and
            why; the coverage table too). With ``quantize_head=True`` and ``FusedLoss`` a 4-bit head is dequantized a
            vocabulary slice at a time, never whole. ``layer_modes`` naming an embedding in another mode than a named
            one is an error. Listed in :attr:`layer_modes` when stored in another mode than ``mode``. Under an FSDP
            strategy the tables are sharded as the 4-bit weights are (packed rows sharded, row scales whole on every
            rank, gathered for the lookup with the unit): the same model as one process. The default keeps them in
            ``dtype`` there only when a head tied to one sits in another top-level submodule (another FSDP unit, where
            it would read a shard; warned, naming them; an explicit setting is refused), and so does a resume under the
            default of a checkpoint saved with them wide (the default before session 30, or kept under FSDP; warned).
        correction_rank: ``r >= 1``: each quantized Linear-like layer gets the frozen rank-``r`` term that minimises
            its output error on ``probe_batch`` (:mod:`lightning_hbm.precision.correction`), fitted after any GPTQ
            rounding, stored in ``dtype`` beside the layer and added to its output (``2 r (in + out)`` bytes per layer:
            +0.09 bytes per weight at 16 on SmolLM2-135M); LoRA trains on top of it. ``0``/``None`` (default): none,
            the Hugging Face QLoRA recipe bit for bit. Capped at ``min(in, out)`` per layer (said); a probe with fewer
            tokens than ``r`` is an error. The default probe is then 2048 tokens (on SmolLM2 a 512-token one left
            +1.49 % to 16-bit LoRA after training, a 2048-token one +0.74 %). Saved in every checkpoint and taken back from it on resume. Counted in
            ``max_bytes_per_param`` with the weights. The best measured configuration: ``QuantizedPrecision("nf4-dq-b32",
            rounding="gptq", correction_rank=16)`` (benchmarks/README.md). Convolutions are corrected too, over their
            input patches (not grouped, depthwise or transposed ones: said), the term added to the weight they
            dequantize (:mod:`lightning_hbm.precision.conv_correction`); not part of the conv default (measured:
            benchmarks/README.md, "The calibrated correction on convolutions"). An input embedding stored in under 8
            bits (``quantize_embeddings=True`` with a 4-bit mode) gets one too, fitted on the probe's token counts, and
            a head tied to it computes with the corrected table (:mod:`lightning_hbm.precision.embedding_correction`;
            int8 tables, the default's, get none: no gain measured, said).

    Raises:
        ValueError: an unknown mode, a dtype the mode cannot compute in, an invalid ``ignore_modules`` regex, a
            target out of range, an unknown ``rounding``, ``smoothing`` for modes that do not smooth.
        TypeError: an argument of the wrong type.

    Applied at lightning_hbm's surgery point (:mod:`lightning_hbm.surgery`): after ``configure_model``, before
    ``configure_optimizers``, first of all model changes. Example::

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
        quantize_embeddings: Union[bool, str] = "auto",
        correction_rank: Optional[int] = None,
        accuracy_at: Optional[str] = None,
    ) -> None:
        check_args(QuantizedPrecision.__init__, locals())
        #: what ``dtype="auto"`` chose and why (None for a named dtype)
        self.dtype_choice: Optional[DtypeChoice] = None
        if isinstance(dtype, str) and dtype.lower() == "auto":
            self.dtype_choice = auto_dtype()
            dtype = self.dtype_choice.dtype
        with quieted():  # the mode's check loads bitsandbytes' CPU ops, which log an optional kernel's absence
            config = QuantizationConfig(
                mode, dtype, ignore_modules, quantize_head, max_bytes_per_param, min_cosine, sensitive_mode, probe_batch,
                layer_modes, rounding, smoothing, quantize_embeddings, correction_rank, accuracy_at,
            )  # fmt: skip
        #: the settings (``plugin.config``) and what each surgery decides: targets, layer modes, GPTQ rounding, smoothing
        self.quantization = Quantization(config, owner=type(self).__qualname__)
        self.precision = _LIGHTNING_NAMES[self.dtype]  # what trainer.precision reports

    @property
    def config(self) -> QuantizationConfig:
        """The settings, checked and frozen (the constructor's arguments; read ``plugin.config.rounding``)."""
        return self.quantization.config

    def __getattr__(self, name: str) -> Any:
        # a setting read as the plugin's own (plugin.rounding, plugin.quantize_head, plugin.pinned_layer_modes): its config's.
        # Only reached when normal lookup fails; __dict__ read directly, as unpickling runs this before __init__'s state
        quantization = self.__dict__.get("quantization")
        if quantization is not None and name in _FORMER:
            # warned here, at the caller's line: the config's own warning named this line, which Python's default
            # filters hide (a DeprecationWarning is shown only where it is the running script's; session 30)
            warnings.warn(f"QuantizedPrecision.{name} is deprecated: read {_FORMER[name]} (plugin.{_FORMER[name]}, the same value).", DeprecationWarning, stacklevel=2)
            return getattr(quantization.config, _FORMER[name])
        if quantization is not None and name in _SETTINGS:
            return getattr(quantization.config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # the settings are checked once and frozen: a write would otherwise be a plain attribute nothing reads (silent)
        if name in _SETTINGS and not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(
                f"QuantizedPrecision.{name} is a setting, checked when the plugin is built and read from plugin.config: "
                f"build the plugin with {name}={value!r} instead of setting it afterwards."
            )
        super().__setattr__(name, value)

    @property
    def mode(self) -> QuantFormat:
        """The precision mode of the layers not planned otherwise (set by the planner to its fake-tensor twin)."""
        return self.config.format

    @mode.setter
    def mode(self, mode: QuantFormat) -> None:
        self.quantization.config = dataclasses.replace(self.config, mode=mode)

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]  # _TrueDtype declares the attribute; here it is the config's
        """The compute dtype."""
        return self.config.torch_dtype

    @property
    def layer_modes(self) -> Optional[dict[str, str]]:
        """The per-layer modes ``{layer name: mode name}`` of the last surgery: pinned (``layer_modes=``), measured on
        the probe or taken from the checkpoint being resumed, and the input embeddings ``quantize_embeddings`` stores
        in another mode than ``mode`` (``"int8"``, the default's choice: ``{"model.embed_tokens": "int8"}``); ``None``:
        every layer in ``mode``. Logged and saved (the embeddings' mode as the ``quantize_embeddings`` setting)."""
        listed = {**self.quantization.embedding_modes, **(self.quantization.layer_modes or {})}
        return listed if listed or self.quantization.layer_modes is not None else None

    @property
    def plan(self) -> Optional[dict[str, str]]:
        """Deprecated: the old name of :attr:`layer_modes` (read-only; warns)."""
        warnings.warn("QuantizedPrecision.plan is deprecated: read plugin.layer_modes (the same dict).", DeprecationWarning, stacklevel=2)
        return self.layer_modes

    @property
    def sensitivity_report(self) -> Optional[SensitivityReport]:
        """What the sensitivity-aware choice of the layer modes measured (``None`` without a target)."""
        return self.quantization.report

    @property
    def plan_report(self) -> Optional[SensitivityReport]:
        """Deprecated: the old name of :attr:`sensitivity_report` (read-only; warns)."""
        warnings.warn("QuantizedPrecision.plan_report is deprecated: read plugin.sensitivity_report (the same report).", DeprecationWarning, stacklevel=2)
        return self.sensitivity_report

    @property
    def rounding_digest(self) -> Optional[str]:
        """CRC32 of the GPTQ-rounded 4-bit weights (``None``: not rounded)."""
        return self.quantization.rounding_digest

    @property
    def input_shifts(self) -> Optional[dict[str, Tensor]]:
        """``{layer name: int8 exponents}`` of the smoothing, measured (or resumed) at fit start."""
        return self.quantization.input_shifts

    @property
    def smoothing_report(self) -> Optional[SmoothingReport]:
        """What the smoothing measured (``None`` when resumed or not smoothed)."""
        return self.quantization.smoothing_report

    @property
    def correction_report(self) -> Optional[CorrectionReport]:
        """What the last surgery's calibrated correction did (``None``: off, or not run yet)."""
        return self.quantization.correction_report

    @property
    def name(self) -> str:
        """The name this plugin's change is recorded under (``applied_transforms``): ``QuantizedPrecision(nf4-dq)``."""
        return f"QuantizedPrecision({self.mode.name})"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """lightning_hbm's surgery point: checks, quantization, then the Trainer's transforms."""
        return trainer_surgery(module, self, self.convert_base)

    def check_model(self, module: nn.Module) -> None:
        """Raise before any change if ``module`` cannot be quantized with these settings (:meth:`Quantization.check`)."""
        if self.name not in applied_transforms(module):
            trainer = self._trainer(module)
            self._check_dtype_choice(trainer)
            self.quantization.check(module, trainer)

    def _check_dtype_choice(self, trainer: Any) -> None:
        """``dtype="auto"`` chose for the device it saw when the plugin was built: refuse a run on the other kind."""
        choice = self.dtype_choice
        if choice is None:
            return
        device = getattr(getattr(trainer, "strategy", None), "root_device", None)
        if device is None:  # no Trainer (the planner's trace): nothing runs on a device here
            return
        if device.type != choice.device:
            raise ValueError(
                f"QuantizedPrecision(dtype='auto') chose {choice.dtype} for {choice.device} when it was built, but this "
                f"Trainer computes on {device.type}: pass the dtype by name (dtype='bfloat16' or dtype='float32')."
            )
        rank_zero_info(choice.describe())

    def place_on(self, device: torch.device) -> None:
        """Quantize on ``device`` (the surgery gives the strategy's root device)."""
        self.quantization.device = device

    def convert_base(self, module: nn.Module) -> nn.Module:
        """Quantize ``module``'s layers in place (once per model), and nothing else."""
        if self.name not in applied_transforms(module):
            trainer = self._trainer(module)  # looked up once, handed on (the modules trained in full, the probe)
            self.quantization.convert(module, trainer)
            mark_applied(module, self.name)
        return module

    def quantization_targets(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, layer)`` of every layer this plugin quantizes in ``module`` (``LoRA`` reads it before any change)."""
        return self.quantization.targets(module)

    def resume_config(self) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint."""
        return self.quantization.resume_config(plugin_trainer(self))

    def add_checkpoint_metadata(self, meta: dict[str, Any]) -> None:
        """The GPTQ CRC and the smoothing exponents, into the lightning_hbm part of each checkpoint."""
        self.quantization.save(meta)

    def _trainer(self, module: nn.Module) -> Any:
        return lightning_compat.attached_trainer(module) or plugin_trainer(self)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning's first save hook: packs the checkpoint, with this plugin's part (add_checkpoint_metadata)
        trainer = plugin_trainer(self)
        if trainer is not None:
            pack_checkpoint(trainer, checkpoint)

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

    def __repr__(self) -> str:
        return (
            f"QuantizedPrecision(mode={self.mode.name!r}, dtype={self.dtype}, ignore_modules={self.config.ignore_list()!r}, "
            f"quantize_head={self.quantize_head}"
            + f", quantize_embeddings={self.quantize_embeddings!r}"
            + (f", smoothing={self.smoothing!r}" if self.smoothing is not None else "")
            + (f", rounding={self.rounding!r}" if self.rounding != "nearest" else "")
            + (f", correction_rank={self.correction_rank}" if self.correction_rank else "")
            + ")"
        )


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


#: torch's dispatch error for an op with no kernel in a dtype: ``"nms_kernel" not implemented for 'BFloat16'``
_NO_KERNEL = re.compile(r"\"([^\"]+)\" not implemented for '(BFloat16|Half)'")
#: torch's errors for an op given float32 and 16-bit tensors together (a matmul, a convolution, a norm, a fill)
_MIXED = re.compile(
    r"to have the same dtype|mixed dtype|should be the same|expected scalar type|found dtype|cannot be converted to type c10::(BFloat16|Half)"
)


@contextmanager
def _computing_in(dtype: torch.dtype, plugin: str) -> Generator[None, None, None]:
    """The forward in ``dtype``; an op with no kernel in it (torchvision's ``nms`` on CPU in bf16: Faster R-CNN under
    ``QuantizedPrecision``'s default bf16) is an error naming the op and the fix, not torch's bare dispatch error."""
    try:
        with _default_dtype(dtype):
            yield
    except RuntimeError as err:  # NotImplementedError too, which torch raises for it
        missing, name = _NO_KERNEL.search(str(err)), str(dtype).removeprefix("torch.")
        if missing is None and _MIXED.search(str(err)) and re.search(r"BFloat16|Half|bfloat16|float16|mixed dtype", str(err)):
            raise RuntimeError(_mixed_message(name, plugin, err)) from err
        if missing is None:
            raise
        op = missing.group(1)
        raise RuntimeError(
            f"lightning_hbm: the op {op!r} has no {missing.group(2)} kernel here, and {plugin} computes the model in "
            f"{name}. Pass {plugin}(..., dtype=\"float32\") (quantized weights stay quantized; the other weights and "
            f"the activations take float32), or cast that op's inputs to float32 in your code. torch said: {err}"
        ) from err


def _mixed_message(name: str, plugin: str, err: BaseException) -> str:
    """An op met float32 and ``name`` tensors under ``plugin``: what it means and the ways out (issue 53: four models
    stopped so under bf16, each on a float32 buffer the cast left as built; now cast, this names what is left)."""
    return (
        f"lightning_hbm: an op of the model got a float32 tensor beside {name} ones, and {plugin} computes the model in "
        f"{name} (its weights, buffers and the batch's floating inputs are cast to it). The float32 one was made by the "
        "model's own code (an explicit dtype=torch.float32, a .float(), a module it casts itself), or is an input of the "
        f"batch kept as given. Pass {plugin}(..., dtype=\"float32\") (quantized weights stay quantized; the rest "
        f"computes in float32), or cast that tensor to the model's dtype in your code. If the model fails the same way "
        f"after model.to(torch.{name}) without lightning_hbm, the mixing is the model's own. torch said: {err}"
    )


def _cast_floating(dtype: torch.dtype, kept: Optional[list[str]] = None, continuous: Optional[set[tuple]] = None) -> Any:
    """The cast of each floating tensor of a collection to ``dtype``; with ``kept``, whole numbers the cast would move
    are left as they are (described in ``kept``). ``continuous``: the positions in the collection (with dtype and
    rank) seen holding other than whole numbers, cast without the check (filled here)."""
    position = itertools.count()  # every tensor's place in apply_to_collection's (deterministic) order

    def cast(tensor: Tensor) -> Tensor:
        key = (next(position), tensor.dtype, tensor.dim())
        if not torch.is_floating_point(tensor) or tensor.dtype == dtype:
            return tensor
        cast_ = tensor.to(dtype)
        if kept is None or tensor.is_meta or isinstance(tensor, FakeTensor) or torch.finfo(dtype).bits >= torch.finfo(tensor.dtype).bits:
            return cast_  # nothing to compare (fake/meta: the planner), or a widening cast: exact
        if continuous is not None and key in continuous:
            return cast_  # features, images: seen holding fractions at this place of the batch before
        if not torch.equal(tensor, tensor.round()):
            if continuous is not None:
                continuous.add(key)
            return cast_  # not whole numbers (features, images): cast as Lightning's true precisions do
        if torch.equal(cast_.to(tensor.dtype), tensor):
            return cast_  # whole numbers the cast keeps exactly
        kept.append(f"a {tuple(tensor.shape)} tensor with {tensor.flatten()[(cast_.to(tensor.dtype) != tensor).flatten()][0].item():g}")
        return tensor

    return cast
