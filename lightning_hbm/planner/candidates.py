"""Candidates and their costs: the configurations the planner compares, and what each costs in step time.

A :class:`Candidate` is one value per axis (precision mode, or a fixed mixed-precision plan, x LoRA rank x
activation checkpointing x optimizer kind x offload), each set through a plugin or callback a user could write
by hand (:meth:`Candidate.precision_plugin`, :meth:`Candidate.callbacks`, :meth:`Candidate.yaml`).

Step-time costs (:meth:`Candidate.relative_cost`) are stated assumptions, relative to the user's
configuration, from published figures: full recompute ~ +1 forward (+33 % of a step whose backward computes weight
gradients; +45 % where the base is frozen, LoRA or quantized: a backward without weight gradients costs about one
forward, so the recompute is nearly half of the step, measured +40-45 % on SmolLM2 QLoRA on CPU), selective ~ +5 % (+15 %
over a frozen base: measured +16 % on SmolLM2 QLoRA on CPU, where the norms, activations and LoRA products it recomputes
weigh more against a backward without weight gradients), 4-bit
dequantization ~ +25 % (torchtune: QLoRA 2,413 vs LoRA 3,083 tok/s), LLM.int8 ~ +50 %, 8-bit optimizer
~ free, CPU offload +20 % (torchao CPUOffloadOptimizer, 1.1B ViT); a mixed-precision plan costs what its
slowest mode costs (every step runs through all of its layers). LoRA is costed like full fine-tuning
so that AutoFit never trades what is trained for speed alone.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union, cast

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_hbm.activations import ActivationCheckpointing, FusedLoss
from lightning_hbm.adapters import LoRA
from lightning_hbm.optim import MemoryEfficientOptimizer, OptimizerKind
from lightning_hbm.precision import QuantizedPrecision, available_precisions, get_format
from lightning_hbm.precision.config import DEFAULT_EMBEDDINGS_MODE, EMBEDDINGS_AUTO
from lightning_hbm.surgery import SurgeryCallback

Checkpointing = Literal["none", "selective", "full"]
LayerModes = tuple[tuple[str, str], ...]

#: A plan's entry that keeps a layer unquantized in the compute dtype, frozen (``QuantizedPrecision``'s "none").
UNQUANTIZED = "none"

#: The Trainer precisions the planner can trace (a subset of what ``Trainer(precision=...)`` accepts,
#: which is ``lightning_hbm.cli.PLANNED_LIGHTNING_PRECISIONS``); lightning_hbm's quantized modes come on top.
PLANNED_LIGHTNING_PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed")

#: The 4-bit base measured closest to 16-bit (``QuantizedPrecision("nf4-dq-b32", rounding="gptq", correction_rank=16)``):
#: what AutoFit tries beside each plain ``nf4-dq`` candidate and prefers when it fits (:func:`~lightning_hbm.planner.autofit.choose`),
#: its rank lowered where the model's layers are too narrow for 16 within 0.65 bytes per weight
#: (:func:`~lightning_hbm.planner.accurate.accurate_4bit`).
ACCURATE_4BIT: dict[str, Any] = {"precision": "nf4-dq-b32", "rounding": "gptq", "correction_rank": 16}
ACCURATE_4BIT_MEASURED = (
    "measured on the real SmolLM2-135M as trained (150 LoRA steps, two seeds, 2048-token probe, fp32), the accurate 4-bit "
    "base at 0.65 bytes per weight (rank 8) ends +0.81 / +0.70 % held-out loss above 16-bit LoRA, plain nf4-dq "
    "+4.94 / +3.05 % (benchmarks/README.md)"
)

# Relative step time added by each choice (see the module docstring for the sources).
_COST_CHECKPOINTING = {"none": 0.0, "selective": 0.05, "full": 0.33}
_COST_FULL_FROZEN_BASE = 0.45  # full recompute when no base weight gets a gradient (LoRA, a quantized base)
_COST_SELECTIVE_FROZEN_BASE = 0.15  # selective recompute then (benchmarks/README.md, peer table: 0.74x against 0.64x HF)
_COST_OFFLOAD = 0.2
_COST_ACTIVATION_OFFLOAD = 0.05  # ActivationCheckpointing(offload=True): stated, unmeasured (copies overlap on a side stream)
_COST_MLP_CHUNK = 0.01  # per token chunk of ActivationCheckpointing(mlp_chunks=k): each re-dequantizes the base

# Decimal (SI) units are powers of 1000, binary ones powers of 1024, as the standards have them: "80GB" is
# 80 * 10**9 bytes (74.5 GiB), "24GiB" is 24 * 2**30. A bare "G" is refused: it reads either way.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_AMBIGUOUS = {"k": "K", "m": "M", "g": "G", "t": "T"}
UNITS_HELP = "units: B, KiB/MiB/GiB/TiB (powers of 1024), KB/MB/GB/TB (powers of 1000: 1 GB = 10**9 bytes = 0.93 GiB)"


def parse_bytes(value: Union[str, int, float]) -> int:
    """``"24GiB"``, ``"80 GB"``, ``"512MiB"``, ``2**30`` -> bytes. ``GB`` is decimal (``10**9``), ``GiB`` binary (``2**30``).

    A bare ``G``/``M``/``K``/``T`` is a ``ValueError``: it means ``GiB`` to some tools and ``GB`` to others.
    """
    if isinstance(value, bool):
        raise TypeError(f"A memory size must be a number of bytes or a string such as '24GiB', got {value!r}.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"A memory size must be a positive number of bytes, got {value!r}.")
        return _whole_bytes(value, value)
    if not isinstance(value, str):
        raise TypeError(f"A memory size must be an int or a string such as '24GiB', got {type(value).__name__}.")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is not None and unit in _AMBIGUOUS:
        letter, number = _AMBIGUOUS[unit], match.group(1)
        raise ValueError(
            f"The memory size {value!r} is ambiguous: a bare {letter!r} means {letter}iB to some tools and {letter}B to "
            f"others. Write {number + letter + 'iB'!r} (powers of 1024, as torch.cuda and nvidia-smi count) or "
            f"{number + letter + 'B'!r} (powers of 1000)."
        )
    if match is None or unit not in _UNITS:
        raise ValueError(f"Cannot read the memory size {value!r}. Write a number and a unit, e.g. '24GiB', '80GB'; {UNITS_HELP}.")
    number = float(match.group(1))  # "1e400" reads as inf: refused below, not an OverflowError from int()
    if number <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}.")
    return _whole_bytes(number * _UNITS[unit], value)


def describe_size(value: Union[str, int, float], nbytes: int) -> str:
    """``nbytes`` in binary units, and the decimal size it was given as (``"953.67 MiB (1 GB = 1,000,000,000 bytes, decimal)"``)."""
    decimal = isinstance(value, str) and value.strip()[-2:].lower() in ("kb", "mb", "gb", "tb")
    return f"{format_bytes(nbytes)} ({cast(str, value).strip()} = {nbytes:,} bytes, decimal)" if decimal else format_bytes(nbytes)


#: Largest memory size accepted (1 EiB): far above any machine, small enough that a typo's 1e400 is refused.
MAX_BYTES = 2**60


def _whole_bytes(nbytes: float, given: Union[str, int, float]) -> int:
    """``nbytes`` as an int, refusing sizes that are not a real amount of memory (infinite, huge, under 1 byte)."""
    if not math.isfinite(nbytes) or nbytes > MAX_BYTES:
        raise ValueError(
            f"The memory size {given!r} is larger than any machine (over {MAX_BYTES:.3g} bytes = 1 EiB); "
            "write the device's memory, e.g. '24GiB' or '80GB'."
        )
    if nbytes < 1:
        raise ValueError(f"The memory size {given!r} is less than one byte; write the device's memory, e.g. '24GiB'.")
    return int(nbytes)


def format_bytes(nbytes: float) -> str:
    """Bytes as a short human string (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


@dataclass(frozen=True)
class Candidate:
    """One training configuration: each field is one axis, set through a plugin or callback a user could write.

    Args:
        precision: Lightning's ``"32-true"``, ``"bf16-true"``, ``"16-true"``, ``"bf16-mixed"`` or a
            lightning_hbm quantized mode (``"nf4-dq"``, ``"nf4"``, ``"fp4"``, ``"int8"``, ...).
        dtype: compute dtype of a quantized mode (ignored for Lightning's names).
        lora_r: LoRA rank (``lightning_hbm.LoRA(r=...)``); 0 trains the whole model.
        checkpointing: ``lightning_hbm.ActivationCheckpointing(policy=...)``, or ``"none"``.
        optimizer: ``"user"`` keeps what ``configure_optimizers`` returns; any other value is a
            ``lightning_hbm.MemoryEfficientOptimizer(kind=...)`` (e.g. ``"adamw8bit"``).
        offload: optimizer states in CPU memory (``Trainer(strategy="cpu_offload")``, CUDA only). A
            strategy cannot be swapped once a Trainer exists, so AutoFit does not try this axis.
        blocks: what ``ActivationCheckpointing(blocks=...)`` checkpoints (class names or module paths),
            for models whose repeated blocks are not found by themselves (e.g. blocks in an
            ``nn.Sequential``); None finds them (children of an ``nn.ModuleList`` of one class).
        mlp_chunks: ``ActivationCheckpointing(mlp_chunks=...)`` with ``checkpointing="full"``: each block's MLP
            recomputed in that many token chunks (1: whole). Planned as it runs: on the fake trace, which layers
            qualify is decided by following their ops (:mod:`lightning_hbm.activations.token_rows`; a layer refused
            there but chunked by the real run, such as a MoE that gathers its tokens, is planned whole: an upper
            bound). Costed at 1 % of
            the step per chunk (measured +2-4 % at 2 chunks and +4-9 % at 4 at the 100M shape on CPU,
            benchmarks/README.md; not yet run on GPU).
        fused_loss: ``lightning_hbm.FusedLoss()``: the output head and cross-entropy chunk by chunk, never
            the full ``[tokens, vocab]`` logits. Assumed to cost no step time (measured 0.50x to 0.93x of the
            unfused step on CPU, benchmarks/README.md; not yet run on GPU).
        offload_activations: ``ActivationCheckpointing(offload=True)`` with ``checkpointing`` not ``"none"``: the
            checkpointed blocks' inputs go to pinned host memory (a number ``k``: the first ``k`` blocks' only). Planned on ``device="cuda"`` as leaving the device
            (the ``host_activations`` term; one block input in flight in the forward, two restored in the backward:
            :class:`~lightning_hbm.activations.offload.OffloadSavedTensors`); on ``"cpu"`` the copies
            are in the same memory and counted there. Costed at +5 % (a stated assumption, not yet run on GPU).
        layer_modes: a fixed mixed-precision plan of a quantized ``precision``, ``{layer name: mode name}``
            (``QuantizedPrecision(layer_modes=...)``; e.g. ``plugin.layer_modes`` of an earlier run with
            ``max_bytes_per_param=``): the named layers are stored in their mode (``"none"``: kept in
            ``dtype``), the others in ``precision``. A dict is accepted and kept as sorted pairs (hashable).
            Layer names are checked against the model when the candidate is planned.
        correction_rank: ``QuantizedPrecision(correction_rank=...)`` of a quantized ``precision``: each quantized
            Linear-like layer carries a frozen rank-``r`` correction in ``dtype`` (``r x (in + out)`` elements,
            :mod:`lightning_hbm.precision.correction`), planned at its exact bytes (zero factors on the fake trace:
            the fit needs the probe batch, not the bytes). 0: none. Costed as no step time (one rank-``r`` matmul
            pair per layer; not measured).
        rounding: ``QuantizedPrecision(rounding=...)`` of a quantized ``precision``: ``"nearest"`` or ``"gptq"``
            (each 4-bit weight rounded against its input statistics on the probe batch: the same bytes, a one-off
            cost at the surgery, none per step).
        quantize_embeddings: ``QuantizedPrecision(quantize_embeddings=...)`` of a quantized ``precision``: ``"auto"``
            (the plugin's default: the input embeddings, and a head tied to one, in int8), ``False`` (kept in
            ``dtype``), ``True`` (in ``precision``) or a mode name. Held as ``"auto"`` when it stores them as the
            default does (``"int8"``; ``True`` of ``"int8"``), ``False``, or the mode; the name shows any other than
            the default's: ``nf4-dq[emb:none]`` (kept in ``dtype``), ``nf4-dq[emb:nf4-dq]``.

    A new axis is a new field with a default meaning "unchanged", plus its lines in :meth:`callbacks`,
    :meth:`relative_cost` and :meth:`yaml`.
    """

    precision: str = "bf16-true"
    dtype: str = "bfloat16"
    lora_r: int = 0
    checkpointing: Checkpointing = "none"
    optimizer: str = "user"
    offload: bool = False
    blocks: Optional[tuple[str, ...]] = None
    fused_loss: bool = False
    layer_modes: Optional[LayerModes] = None
    mlp_chunks: int = 1
    offload_activations: Union[bool, int] = False
    correction_rank: int = 0
    rounding: str = "nearest"
    quantize_embeddings: Union[bool, str] = "auto"
    configured: Optional[tuple[Precision, tuple[Any, ...]]] = None

    @classmethod
    def from_trainer(cls, plugin: Optional[Precision] = None, callbacks: Sequence[Any] = (), strategy: Any = None) -> "Candidate":
        """The very plugin and callbacks a user gives the Trainer, every option kept (LoRA ``exclude_modules``,
        ``QuantizedPrecision(ignore_modules=...)``, ``FusedLoss(heads=...)``, ...): traced with copies of them.

        The axes (precision, rank, policy, ...) are read from the objects, for the name, the cost and the table;
        callbacks that change no tensor (profilers, loggers) are left out of the trace as they change nothing.
        ``strategy``: ``"cpu_offload"`` (or a ``CPUOffloadStrategy``) plans offloaded optimizer states.
        """
        plugin = plugin if plugin is not None else Precision()
        if not isinstance(plugin, Precision):
            raise TypeError(f"Candidate.from_trainer(plugin=...): a Lightning precision plugin, got {type(plugin).__name__}.")
        if isinstance(plugin, QuantizedPrecision):
            precision, dtype = plugin.mode.name, str(plugin.dtype).removeprefix("torch.")
        else:
            precision, dtype = {Precision: "32-true"}.get(type(plugin), getattr(plugin, "precision", "32-true")), "bfloat16"
            if precision not in PLANNED_LIGHTNING_PRECISIONS:
                raise ValueError(
                    f"Candidate.from_trainer: precision {precision!r} ({type(plugin).__name__}) is not one the planner "
                    f"traces; use one of {list(PLANNED_LIGHTNING_PRECISIONS)} or a QuantizedPrecision."
                )
        surgery = tuple(c for c in callbacks if isinstance(c, SurgeryCallback))
        axes: dict[str, Any] = {}
        for callback in surgery:
            kind = type(callback).__name__
            if kind == "LoRA":
                axes["lora_r"] = int(cast(LoRA, callback).r)
            elif kind == "ActivationCheckpointing":
                axes["checkpointing"] = cast(ActivationCheckpointing, callback).policy
                axes["mlp_chunks"] = cast(ActivationCheckpointing, callback).mlp_chunks
                checkpointing = cast(ActivationCheckpointing, callback)
                # partial offload (offload=k: the first k blocks) keeps its count: the name, the YAML and the plan say it
                axes["offload_activations"] = checkpointing.offload is not None if checkpointing.offload_blocks is None else checkpointing.offload_blocks
            elif kind == "MemoryEfficientOptimizer":
                axes["optimizer"] = cast(MemoryEfficientOptimizer, callback).kind
            elif kind == "FusedLoss":
                axes["fused_loss"] = True
        offload = strategy == "cpu_offload" or type(strategy).__name__ == "CPUOffloadStrategy"
        if isinstance(plugin, QuantizedPrecision):
            # a fixed per-layer plan (pinned, or measured by an earlier fit); not the embeddings' mode, which
            # plugin.layer_modes lists after a surgery (quantize_embeddings' own axis: was read as a plan, session 31)
            axes["layer_modes"] = plugin.quantization.layer_modes
            axes["correction_rank"] = plugin.correction_rank
            axes["rounding"] = plugin.rounding
            axes["quantize_embeddings"] = EMBEDDINGS_AUTO if plugin.config.embeddings_by_default else plugin.quantize_embeddings
        return cls(precision, dtype, offload=offload, configured=(plugin, surgery), **axes)

    def __post_init__(self) -> None:
        if self.precision not in PLANNED_LIGHTNING_PRECISIONS and self.precision not in available_precisions():
            raise ValueError(
                f"Candidate precision {self.precision!r} is unknown. Use one of Lightning's "
                f"{list(PLANNED_LIGHTNING_PRECISIONS)} or a lightning_hbm mode {available_precisions()}."
            )
        # object.__setattr__ on self: how a frozen dataclass normalises its own fields (the dataclasses docs' idiom);
        # the only one left in the package (tests/test_record.py), never a mark on someone else's object
        object.__setattr__(self, "layer_modes", _normalised_plan(self.precision, self.layer_modes))
        object.__setattr__(self, "quantize_embeddings", _normalised_embeddings(self.precision, self.quantize_embeddings))
        if self.blocks is not None:
            if isinstance(self.blocks, str) or not self.blocks or not all(isinstance(b, str) for b in self.blocks):
                raise ValueError(
                    f"Candidate blocks must be a non-empty list of class names or module paths, got {self.blocks!r}; "
                    "e.g. blocks=['Block'] or blocks=['model.layers.0', 'model.layers.1']."
                )
            object.__setattr__(self, "blocks", tuple(self.blocks))  # hashable: candidates are dict keys
        if isinstance(self.correction_rank, bool) or not isinstance(self.correction_rank, int) or self.correction_rank < 0:
            raise ValueError(f"Candidate correction_rank must be an int >= 0 (0 = none), got {self.correction_rank!r}.")
        if self.correction_rank and not self.quantized:
            raise ValueError(
                f"Candidate correction_rank={self.correction_rank} corrects quantized layers, but precision "
                f"{self.precision!r} quantizes nothing. Use a lightning_hbm mode, e.g. Candidate('nf4-dq', correction_rank=16)."
            )
        if self.rounding not in ("nearest", "gptq") or (self.rounding != "nearest" and not self.quantized):
            raise ValueError(
                f"Candidate rounding={self.rounding!r}: use 'nearest', or 'gptq' with a lightning_hbm 4-bit mode, e.g. "
                "Candidate('nf4-dq', rounding='gptq')."
            )
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"Candidate lora_r must be an int >= 0 (0 = no LoRA), got {self.lora_r!r}.")
        if self.checkpointing not in _COST_CHECKPOINTING:
            raise ValueError(
                f"Candidate checkpointing must be one of {list(_COST_CHECKPOINTING)}, got {self.checkpointing!r}."
            )
        if isinstance(self.mlp_chunks, bool) or not isinstance(self.mlp_chunks, int) or self.mlp_chunks < 1:
            raise ValueError(f"Candidate mlp_chunks must be an int >= 1 (1 = whole recompute), got {self.mlp_chunks!r}.")
        if self.mlp_chunks > 1 and self.checkpointing != "full":
            raise ValueError(
                f"Candidate mlp_chunks={self.mlp_chunks} chunks the recompute of full checkpointing, but checkpointing="
                f"{self.checkpointing!r}. Use checkpointing='full', or mlp_chunks=1."
            )
        if self.offload_activations and self.checkpointing == "none":
            raise ValueError(
                "Candidate offload_activations=True moves the inputs checkpointed blocks keep, but checkpointing='none'. "
                "Use checkpointing='full' (or 'selective'), or offload_activations=False."
            )
        if not isinstance(self.optimizer, str) or not self.optimizer:
            raise ValueError(f"Candidate optimizer must be 'user' or an 8-bit optimizer kind, got {self.optimizer!r}.")

    @property
    def quantized(self) -> bool:
        return self.precision not in PLANNED_LIGHTNING_PRECISIONS

    @property
    def name(self) -> str:
        parts = [self.precision + self._plan_tag()]
        if self.rounding != "nearest":
            parts.append(self.rounding)
        if self.correction_rank:
            parts.append(f"corr{self.correction_rank}")
        if self.lora_r:
            parts.append(f"lora{self.lora_r}")
        if self.checkpointing != "none":
            parts.append(f"ac-{self.checkpointing}" + (f"-mlp{self.mlp_chunks}" if self.mlp_chunks > 1 else "")
                         + ("-offload" if self.offload_activations is True else f"-offload{self.offload_activations}" if self.offload_activations else ""))
        if self.optimizer != "user":
            parts.append(self.optimizer)
        if self.offload:
            parts.append("offload")
        if self.fused_loss:
            parts.append("fused-loss")
        return "+".join(parts) + (" (as configured)" if self.configured is not None else "")

    def precision_plugin(self, device: str = "cpu") -> Precision:
        """The precision plugin a Trainer would use for this candidate (a copy of the configured one)."""
        if self.configured is not None:
            return copy.deepcopy(self.configured[0])
        if self.quantized:
            layer_modes = dict(self.layer_modes) if self.layer_modes else None
            return QuantizedPrecision(self.precision, dtype=self.dtype, layer_modes=layer_modes,
                                      correction_rank=self.correction_rank or None, rounding=self.rounding,
                                      quantize_embeddings=self.quantize_embeddings)
        if self.precision == "32-true":
            return Precision()
        if self.precision == "bf16-mixed":
            return MixedPrecision("bf16-mixed", device=device)
        return HalfPrecision(self.precision)  # type: ignore[arg-type]

    def callbacks(self) -> list[SurgeryCallback]:
        """The lightning_hbm callbacks that apply this candidate (fresh instances, or copies of the configured ones)."""
        if self.configured is not None:
            return [copy.deepcopy(c) for c in self.configured[1]]
        callbacks: list[SurgeryCallback] = []
        if self.lora_r:
            callbacks.append(LoRA(r=self.lora_r, alpha=2.0 * self.lora_r))
        if self.checkpointing != "none":
            blocks = list(self.blocks) if self.blocks is not None else None
            callbacks.append(ActivationCheckpointing(policy=self.checkpointing, blocks=blocks, mlp_chunks=self.mlp_chunks,
                                                     offload=self.offload_activations))
        if self.optimizer != "user":
            callbacks.append(MemoryEfficientOptimizer(kind=cast(OptimizerKind, self.optimizer)))
        if self.fused_loss:
            callbacks.append(FusedLoss())
        return callbacks

    def relative_cost(self) -> float:
        """Step time relative to the user's configuration (1.0), from the stated assumptions."""
        recompute = _COST_CHECKPOINTING[self.checkpointing]
        if self.lora_r > 0 or self.quantized:  # a frozen base: the backward computes no base weight gradient
            recompute = {"full": _COST_FULL_FROZEN_BASE, "selective": _COST_SELECTIVE_FROZEN_BASE}.get(self.checkpointing, recompute)
        cost = 1.0 + recompute + (_COST_OFFLOAD if self.offload else 0.0)
        cost += _COST_ACTIVATION_OFFLOAD if self.offload_activations else 0.0
        cost += _COST_MLP_CHUNK * self.mlp_chunks if self.mlp_chunks > 1 else 0.0
        if self.quantized:
            modes = {self.precision, *(mode for _, mode in self.layer_modes or ())} - {UNQUANTIZED}
            cost += max(get_format(mode).cost for mode in modes)  # each format states its own
        return round(cost, 3)

    def fidelity(self) -> int:
        """Tie-break between equally fast candidates: higher keeps the user's training closer to as written."""
        score = 0 if self.quantized else 2
        score += 0 if self.lora_r else 1
        score += 1 if self.optimizer == "user" else 0
        score += 0 if self.offload else 1
        score += 0 if self.offload_activations else 1
        score += 0 if self.fused_loss else 1  # exact, but a user who reads the logits pays for them once
        return score

    def _plan_tag(self) -> str:
        """``[mixed:3 int8,1 none]``: how many layers the plan stores in each mode other than ``precision``; then
        ``[emb:none]`` (``[emb:<mode>]``) where the input embeddings are stored otherwise than the default's int8."""
        embeddings = "" if self.quantize_embeddings == EMBEDDINGS_AUTO else f"[emb:{self.quantize_embeddings or UNQUANTIZED}]"
        if not self.layer_modes:
            return embeddings
        counts: dict[str, int] = {}
        for _, mode in self.layer_modes:
            if mode != self.precision:
                counts[mode] = counts.get(mode, 0) + 1
        changed = ",".join(f"{n} {mode}" for mode, n in sorted(counts.items()))
        return f"[mixed:{changed or 'all ' + self.precision}]" + embeddings  # a plan naming only base-mode layers is still a plan

    def _plugin_yaml(self) -> list[str]:
        lines = ["  plugins:", "    - class_path: lightning_hbm.QuantizedPrecision"]
        correction = f", rounding: {self.rounding}" if self.rounding != "nearest" else ""
        correction += f", correction_rank: {self.correction_rank}" if self.correction_rank else ""
        correction += "" if self.quantize_embeddings == EMBEDDINGS_AUTO else f", quantize_embeddings: {json.dumps(self.quantize_embeddings)}"
        if not self.layer_modes:
            return [*lines, f"      init_args: {{mode: {self.precision}, dtype: {self.dtype}{correction}}}"]
        # names and modes quoted (JSON strings are YAML strings): a layer named "0" or "1.2" must stay a string
        plan = [f"          {json.dumps(name)}: {json.dumps(mode)}" for name, mode in self.layer_modes]
        init_args = ["      init_args:", f"        mode: {self.precision}", f"        dtype: {self.dtype}"]
        init_args += [f"        rounding: {self.rounding}"] if self.rounding != "nearest" else []
        init_args += [f"        correction_rank: {self.correction_rank}"] if self.correction_rank else []
        init_args += [] if self.quantize_embeddings == EMBEDDINGS_AUTO else [f"        quantize_embeddings: {json.dumps(self.quantize_embeddings)}"]
        return [*lines, *init_args, "        layer_modes:", *plan]

    def _blocks_yaml(self) -> str:
        chunks = f", mlp_chunks: {self.mlp_chunks}" if self.mlp_chunks > 1 else ""
        chunks += f", offload: {str(self.offload_activations).lower()}" if self.offload_activations else ""
        return chunks + ("" if self.blocks is None else f", blocks: [{', '.join(self.blocks)}]")

    def yaml(self) -> str:
        """The LightningCLI YAML snippet that configures this candidate by hand."""
        lines = ["trainer:"]
        if self.offload:
            lines.append("  strategy: cpu_offload")
        if self.quantized:
            lines += self._plugin_yaml()
        else:
            lines.append(f"  precision: {self.precision}")
        callback_lines = []
        if self.lora_r:
            callback_lines += [
                "    - class_path: lightning_hbm.LoRA",
                f"      init_args: {{r: {self.lora_r}, alpha: {2.0 * self.lora_r}}}",
            ]
        if self.checkpointing != "none":
            callback_lines += [
                "    - class_path: lightning_hbm.ActivationCheckpointing",
                f"      init_args: {{policy: {self.checkpointing}{self._blocks_yaml()}}}",
            ]
        if self.optimizer != "user":
            callback_lines += [
                "    - class_path: lightning_hbm.MemoryEfficientOptimizer",
                f"      init_args: {{kind: {self.optimizer}}}",
            ]
        if self.fused_loss:
            callback_lines.append("    - class_path: lightning_hbm.FusedLoss")
        if callback_lines:
            lines += ["  callbacks:", *callback_lines]
        return "\n".join(lines) + "\n"


def _normalised_embeddings(precision: str, value: Any) -> Union[bool, str]:
    """``quantize_embeddings`` as a candidate holds it: ``"auto"`` where it stores them as the default does (and for a
    precision that quantizes nothing), else ``False`` or the mode name.

    Raises:
        ValueError: neither a bool, ``"auto"`` nor a mode name.
    """
    if value != EMBEDDINGS_AUTO and not isinstance(value, bool) and value not in available_precisions():
        raise ValueError(
            f"Candidate quantize_embeddings={value!r}: use 'auto' (int8, the default), False (kept in the compute "
            f"dtype), True (in the candidate's precision) or a mode, one of {available_precisions()}."
        )
    if precision in PLANNED_LIGHTNING_PRECISIONS:
        return EMBEDDINGS_AUTO  # nothing quantized: no embedding either
    mode = precision if value is True else value
    return EMBEDDINGS_AUTO if mode in (EMBEDDINGS_AUTO, DEFAULT_EMBEDDINGS_MODE) else mode


def _normalised_plan(precision: str, layer_modes: Any) -> Optional[LayerModes]:
    """``layer_modes`` as sorted (name, mode) pairs, checked; ``None`` (or an empty plan): every layer in ``precision``."""
    if layer_modes is None or (isinstance(layer_modes, (Mapping, tuple, list)) and not layer_modes):
        return None
    if precision in PLANNED_LIGHTNING_PRECISIONS:
        raise ValueError(
            f"Candidate layer_modes is a per-layer plan of a quantized base, but precision {precision!r} quantizes "
            f"nothing. Use a lightning_hbm mode as the base, e.g. Candidate('nf4-dq', layer_modes=...)."
        )
    try:
        pairs = sorted(dict(layer_modes).items())
    except (TypeError, ValueError):
        raise TypeError(
            f"Candidate layer_modes must be a dict {{layer name: mode name}}, got {type(layer_modes).__name__}: "
            f"{layer_modes!r}. E.g. layer_modes={{'model.layers.0.mlp.down_proj': 'int8'}}."
        ) from None
    valid = [*available_precisions(), UNQUANTIZED]
    for name, mode in pairs:
        if not isinstance(name, str) or not name:
            raise TypeError(f"Candidate layer_modes keys must be layer names (non-empty strings), got {name!r}.")
        if mode not in valid:
            raise ValueError(
                f"Candidate layer_modes[{name!r}] = {mode!r} is not a mode. Use one of {valid} "
                f"({UNQUANTIZED!r} keeps the layer in the compute dtype)."
            )
    return tuple(pairs)


def available_axes() -> dict[str, bool]:
    """Which optional axes this install can plan (the callbacks that apply them exist)."""
    axes = {}
    for axis, module in (
        ("lora", "lightning_hbm.adapters.lora"),
        ("checkpointing", "lightning_hbm.activations.checkpointing"),
        ("optimizer", "lightning_hbm.optim.optimizer"),
        ("fused_loss", "lightning_hbm.activations.loss"),
    ):
        try:
            __import__(module)
            axes[axis] = True
        except ImportError:
            axes[axis] = False
    return axes


def default_candidates(
    precisions: Sequence[str] = ("bf16-true", "nf4-dq"),
    lora_ranks: Sequence[int] = (0, 16),
    checkpointing: Sequence[Checkpointing] = ("none", "selective", "full"),
    optimizers: Sequence[str] = ("user", "adamw8bit"),
    fused_loss: Sequence[bool] = (False,),
    layer_modes: Optional[dict[str, str]] = None,
    mlp_chunks: Sequence[int] = (1,),
) -> list[Candidate]:
    """The grid of candidates over the axes this install supports (axes whose callback is missing are left out).

    A quantized base is only offered with LoRA (a frozen quantized base with nothing trainable but
    norms and embeddings is not a fine-tuning configuration anyone asks for). ``layer_modes``: a fixed
    mixed-precision plan ``{layer name: mode name}`` that every quantized candidate uses (on the
    command line, as JSON: ``lightning-hbm plan --candidates.layer_modes "$(cat plan.json)"``). ``mlp_chunks``: the
    token chunks each ``"full"`` candidate is also tried with (1: whole; other policies take no chunks).
    """
    if layer_modes and all(p in PLANNED_LIGHTNING_PRECISIONS for p in precisions):
        raise ValueError(
            f"default_candidates(layer_modes=...) plans a quantized base, but precisions={list(precisions)} holds no "
            f"quantized mode. Add one, e.g. precisions=['bf16-true', 'nf4-dq']."
        )
    axes = available_axes()
    lora_ranks = lora_ranks if axes["lora"] else [0]
    checkpointing = checkpointing if axes["checkpointing"] else ["none"]
    optimizers = optimizers if axes["optimizer"] else ["user"]
    fused_loss = fused_loss if axes["fused_loss"] else [False]
    grid = []
    for precision, r, policy, optimizer, fused in itertools.product(
        precisions, lora_ranks, checkpointing, optimizers, fused_loss
    ):
        if precision not in PLANNED_LIGHTNING_PRECISIONS and r == 0 and axes["lora"]:
            continue
        plan = layer_modes if precision not in PLANNED_LIGHTNING_PRECISIONS else None
        for chunks in mlp_chunks if policy == "full" else (1,):
            grid.append(
                Candidate(precision, lora_r=r, checkpointing=policy, optimizer=optimizer, fused_loss=fused, layer_modes=plan, mlp_chunks=chunks)  # type: ignore[arg-type]  # __post_init__ normalises a dict plan to pairs
            )
    return grid


__all__ = [
    "ACCURATE_4BIT",
    "ACCURATE_4BIT_MEASURED",
    "PLANNED_LIGHTNING_PRECISIONS",
    "Candidate",
    "available_axes",
    "default_candidates",
    "describe_size",
    "format_bytes",
    "parse_bytes",
]
