"""HBM planner: predict every configuration's peak memory before training, and pick one that fits.

What it shrinks: nothing by itself. It predicts the five terms of the memory sum
(:data:`lightning_hbm.memory.categories.CATEGORIES`) for each candidate configuration (precision mode x
LoRA rank x activation checkpointing x optimizer kind), so that a user (or :class:`~lightning_hbm.AutoFit`)
can choose before the first step instead of trying until OOM.

How: the model is built under torch's ``FakeTensorMode`` (no weight is allocated: a fake tensor has
shape, dtype and device but no data), the candidate's transforms are applied through the same code a
Trainer runs (the precision plugin, the ``SurgeryCallback`` transforms in stage order, the user's
unchanged ``configure_optimizers``, then each transform's ``transform_optimizers``), the gradients and
optimizer states of a first step are created (zero gradients, one optimizer step), and one steady-state
training step is traced (forward, zero_grad, backward, optimizer step, as Lightning runs them). A dispatch
mode counts every storage that is alive after every op; the highest point of each phase is classified with
the profiler's own ownership rules (parameters, ``.grad``, ``optimizer.state``, buffers; what the forward
created is activations, the rest is other), and the highest phase is the predicted peak. Deep models are
traced with their repeated blocks cut to 3 and 4 and extended linearly (:func:`predict`); Hugging Face
models are kept on their eager code paths, which they leave for fake tensors (:func:`_eager_transformers`).

bitsandbytes cannot quantize a fake tensor (its ``Params4bit`` subclass cannot wrap one), so quantized
layers are built by :func:`planned_linear`: a real ``bnb.nn.Linear4bit``/``Linear8bitLt`` whose weight
is the fake output of bitsandbytes' own ``quantize_4bit``/``int8_vectorwise_quant`` (their registered
fake kernels give the exact packed shapes, absmax, nested constants and row scales). Its forward and
backward are bitsandbytes' own autograd functions, run on fake tensors. ``tests/test_planner.py``
checks that the planned storage equals the real quantized storage byte for byte.

Assumptions (stated, not measured here):

* ``CUDA_CONTEXT_BYTES``: the CUDA context and allocator reserve beyond the live tensors; added on
  ``device="cuda"`` only (the category sum is what ``torch.cuda.max_memory_allocated`` sees).
* Step-time costs (:meth:`Candidate.relative_cost`) are relative to the user's configuration and come
  from published figures: full recompute ~ +1 forward (+33 %), selective ~ +5 %, 4-bit dequantization
  ~ +25 % (torchtune: QLoRA 2,413 vs LoRA 3,083 tok/s), LLM.int8 ~ +50 %, 8-bit optimizer ~ free.
  LoRA is costed like full fine-tuning so that AutoFit never trades what is trained for speed alone.
* The trace runs CPU kernels on fake tensors. For ``device="cuda"`` torch optimizers are traced with
  their CUDA default (foreach), but attention kernels keep the CPU choice (CUDA flash/efficient SDPA
  save a logsumexp instead), and cuBLAS workspaces are in the overhead constant.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import re
import sys
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hbm.memory.categories import (
    CATEGORIES,
    buffer_tensors,
    gradient_tensors,
    optimizer_state_tensors,
    parameter_tensors,
    plain_tensors,
)
from lightning_hbm.precision import QuantizedPrecision, available_precisions, get_mode, quantize_model
from lightning_hbm.memory.storage import quantization_tensors
from lightning_hbm.precision.registry import QuantMode
from lightning_hbm.surgery import Stage, SurgeryCallback, apply_transforms, applied_transforms, mark_applied
from lightning_hbm.surgery import prune_frozen_parameters

ModelLike = Union[pl.LightningModule, Callable[[], pl.LightningModule]]
BatchLike = Union[Any, pl.LightningDataModule]
Checkpointing = Literal["none", "selective", "full"]

#: CUDA context + caching-allocator reserve beyond the live tensors, added to every prediction on CUDA.
#: ~500 MiB is what a CUDA 12 context takes on an A100/H100 with torch loaded; the rest is a margin for
#: allocator rounding/fragmentation. A stated constant, to be replaced by the GPU benchmark's figure.
CUDA_CONTEXT_BYTES = 768 * 2**20

LIGHTNING_PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed")

# Relative step time added by each choice (see the module docstring for the sources).
_COST_CHECKPOINTING = {"none": 0.0, "selective": 0.05, "full": 0.33}
_COST_4BIT = 0.25
_COST_INT8 = 0.5
_COST_OFFLOAD = 0.2  # torchao CPUOffloadOptimizer, 1.1B ViT: +20 % step time

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}  # fmt: skip


def parse_bytes(value: Union[str, int, float]) -> int:
    """``"24GiB"``, ``"24 GB"``, ``"512MiB"``, ``2**30`` -> bytes. Bare ``G``/``M`` mean GiB/MiB (as ``nvidia-smi``)."""
    if isinstance(value, bool):
        raise TypeError(f"A memory size must be a number of bytes or a string such as '24GiB', got {value!r}.")
    if isinstance(value, (int, float)):
        if value <= 0 or not math.isfinite(value):
            raise ValueError(f"A memory size must be a positive number of bytes, got {value!r}.")
        return int(value)
    if not isinstance(value, str):
        raise TypeError(f"A memory size must be an int or a string such as '24GiB', got {type(value).__name__}.")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"Cannot read the memory size {value!r}. Write a number and a unit, e.g. '24GiB', '80GB', '512MiB'."
        )
    number = float(match.group(1))
    if number <= 0:
        raise ValueError(f"A memory size must be positive, got {value!r}.")
    return int(number * _UNITS[unit])


def format_bytes(nbytes: float) -> str:
    """Bytes as a short human string (binary units)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


# --------------------------------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------------------------------


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

    A new axis is a new field with a default meaning "unchanged", plus its lines in :meth:`callbacks`,
    :meth:`relative_cost` and :meth:`yaml`.
    """

    precision: str = "bf16-true"
    dtype: str = "bfloat16"
    lora_r: int = 0
    checkpointing: Checkpointing = "none"
    optimizer: str = "user"
    offload: bool = False

    def __post_init__(self) -> None:
        if self.precision not in LIGHTNING_PRECISIONS and self.precision not in available_precisions():
            raise ValueError(
                f"Candidate precision {self.precision!r} is unknown. Use one of Lightning's "
                f"{list(LIGHTNING_PRECISIONS)} or a lightning_hbm mode {available_precisions()}."
            )
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"Candidate lora_r must be an int >= 0 (0 = no LoRA), got {self.lora_r!r}.")
        if self.checkpointing not in _COST_CHECKPOINTING:
            raise ValueError(
                f"Candidate checkpointing must be one of {list(_COST_CHECKPOINTING)}, got {self.checkpointing!r}."
            )
        if not isinstance(self.optimizer, str) or not self.optimizer:
            raise ValueError(f"Candidate optimizer must be 'user' or an 8-bit optimizer kind, got {self.optimizer!r}.")

    @property
    def quantized(self) -> bool:
        return self.precision not in LIGHTNING_PRECISIONS

    @property
    def name(self) -> str:
        parts = [self.precision]
        if self.lora_r:
            parts.append(f"lora{self.lora_r}")
        if self.checkpointing != "none":
            parts.append(f"ac-{self.checkpointing}")
        if self.optimizer != "user":
            parts.append(self.optimizer)
        if self.offload:
            parts.append("offload")
        return "+".join(parts)

    def precision_plugin(self, device: str = "cpu") -> Precision:
        """The precision plugin a Trainer would use for this candidate."""
        if self.quantized:
            return QuantizedPrecision(self.precision, dtype=self.dtype)
        if self.precision == "32-true":
            return Precision()
        if self.precision == "bf16-mixed":
            return MixedPrecision("bf16-mixed", device=device)
        return HalfPrecision(self.precision)  # type: ignore[arg-type]

    def callbacks(self) -> list[SurgeryCallback]:
        """The lightning_hbm callbacks that apply this candidate (fresh instances)."""
        callbacks: list[SurgeryCallback] = []
        if self.lora_r:
            from lightning_hbm.callbacks.lora import LoRA

            callbacks.append(LoRA(r=self.lora_r, alpha=2.0 * self.lora_r))
        if self.checkpointing != "none":
            from lightning_hbm.callbacks.activation_checkpointing import ActivationCheckpointing

            callbacks.append(ActivationCheckpointing(policy=self.checkpointing))
        if self.optimizer != "user":
            _memory_efficient_optimizer = _optimizer_callback_class()
            callbacks.append(_memory_efficient_optimizer(kind=self.optimizer))
        return callbacks

    def relative_cost(self) -> float:
        """Step time relative to the user's configuration (1.0), from the stated assumptions."""
        cost = 1.0 + _COST_CHECKPOINTING[self.checkpointing] + (_COST_OFFLOAD if self.offload else 0.0)
        if self.quantized:
            cost += _COST_INT8 if self.precision.startswith("int8") else _COST_4BIT
        return round(cost, 3)

    def fidelity(self) -> int:
        """Tie-break between equally fast candidates: higher keeps the user's training closer to as written."""
        score = 0 if self.quantized else 2
        score += 0 if self.lora_r else 1
        score += 1 if self.optimizer == "user" else 0
        score += 0 if self.offload else 1
        return score

    def yaml(self) -> str:
        """The LightningCLI YAML snippet that configures this candidate by hand."""
        lines = ["trainer:"]
        if self.offload:
            lines.append("  strategy: cpu_offload")
        if self.quantized:
            lines += [
                "  plugins:",
                "    - class_path: lightning_hbm.QuantizedPrecision",
                f"      init_args: {{mode: {self.precision}, dtype: {self.dtype}}}",
            ]
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
                f"      init_args: {{policy: {self.checkpointing}}}",
            ]
        if self.optimizer != "user":
            callback_lines += [
                "    - class_path: lightning_hbm.MemoryEfficientOptimizer",
                f"      init_args: {{kind: {self.optimizer}}}",
            ]
        if callback_lines:
            lines += ["  callbacks:", *callback_lines]
        return "\n".join(lines) + "\n"


def _optimizer_callback_class() -> type:
    try:
        from lightning_hbm.callbacks.optimizer import MemoryEfficientOptimizer
    except ImportError as err:
        raise ValueError(
            "An 8-bit optimizer candidate needs lightning_hbm.MemoryEfficientOptimizer, which this install "
            f"does not have ({err}). Use optimizer='user'."
        ) from err
    return MemoryEfficientOptimizer


def available_axes() -> dict[str, bool]:
    """Which optional axes this install can plan (the callbacks that apply them exist)."""
    axes = {}
    for axis, module in (
        ("lora", "lightning_hbm.callbacks.lora"),
        ("checkpointing", "lightning_hbm.callbacks.activation_checkpointing"),
        ("optimizer", "lightning_hbm.callbacks.optimizer"),
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
) -> list[Candidate]:
    """The grid of candidates over the axes this install supports (axes whose callback is missing are left out).

    A quantized base is only offered with LoRA (a frozen quantized base with nothing trainable but
    norms and embeddings is not a fine-tuning configuration anyone asks for).
    """
    axes = available_axes()
    lora_ranks = lora_ranks if axes["lora"] else [0]
    checkpointing = checkpointing if axes["checkpointing"] else ["none"]
    optimizers = optimizers if axes["optimizer"] else ["user"]
    grid = []
    for precision, r, policy, optimizer in itertools.product(precisions, lora_ranks, checkpointing, optimizers):
        if precision not in LIGHTNING_PRECISIONS and r == 0 and axes["lora"]:
            continue
        grid.append(Candidate(precision=precision, lora_r=r, checkpointing=policy, optimizer=optimizer))
    return grid


# --------------------------------------------------------------------------------------------------
# Quantized layers on fake tensors
# --------------------------------------------------------------------------------------------------

# How each lightning_hbm bitsandbytes mode stores a weight. The planner cannot call the mode's own
# ``replace`` (bitsandbytes' Params4bit cannot wrap a fake tensor), so it needs to know the format.
_PLANNED_FORMATS: dict[str, tuple[str, Optional[str], bool]] = {
    "nf4": ("4bit", "nf4", False),
    "nf4-dq": ("4bit", "nf4", True),
    "fp4": ("4bit", "fp4", False),
    "fp4-dq": ("4bit", "fp4", True),
    "int8": ("int8", None, False),
}


def planned_linear(linear: nn.Linear, mode: str, dtype: torch.dtype) -> nn.Module:
    """A bitsandbytes layer holding ``linear`` quantized as ``mode`` would, built from (fake) tensors.

    The storage comes from bitsandbytes' own quantization functions, so shapes and constants are
    exact; called on fake tensors it allocates nothing. Raises ``ValueError`` for modes the planner
    does not know.
    """
    from lightning_hbm.precision.bnb import import_bnb

    if mode not in _PLANNED_FORMATS:
        raise ValueError(
            f"The planner does not know how precision mode {mode!r} stores weights; it can plan "
            f"{sorted(_PLANNED_FORMATS)} and Lightning's {list(LIGHTNING_PRECISIONS)}."
        )
    bnb = import_bnb()
    kind, quant_type, double_quant = _PLANNED_FORMATS[mode]
    bias = linear.bias
    with unset_fake_temporarily():  # the layer shell is built on the meta device, outside the fake mode
        if kind == "4bit":
            layer = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=False, compute_dtype=dtype,
                compress_statistics=double_quant, quant_type=quant_type, device="meta",
            )  # fmt: skip
        else:
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, bias=False, has_fp16_weights=False,
                threshold=6.0, device="meta",
            )  # fmt: skip
    source = linear.weight.detach()
    if double_quant and "dynamic" not in bnb.functional.name2qmap:
        # bitsandbytes builds (and caches, module-wide) the code book of the nested quantization from
        # Python floats: build it for real, outside the fake mode, exactly as its first real call would.
        with unset_fake_temporarily():
            bnb.functional.name2qmap["dynamic"] = bnb.functional.create_dynamic_map()
    if kind == "4bit":
        blocksize = layer.weight.blocksize
        packed, quant_state = bnb.functional.quantize_4bit(
            source.contiguous(), blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
        )
        weight = nn.Parameter(packed, requires_grad=False)
        # the attributes of bitsandbytes' Params4bit that Linear4bit, peft and our storage count read
        weight.quant_state = quant_state
        weight.quant_type = quant_type
        weight.compress_statistics = double_quant
        weight.blocksize = blocksize
        weight.quant_storage = packed.dtype
        weight.bnb_quantized = True
        layer.weight = weight
        layer.quant_state = quant_state
        layer.support_avx512bf16_for_cpu = False  # as the real plugin does (verified-facts trap)
    else:
        cb, scb, _ = bnb.functional.int8_vectorwise_quant(source.to(dtype).contiguous().to(torch.float16))
        weight = nn.Parameter(cb, requires_grad=False)
        weight.CB, weight.SCB = cb, scb
        weight.has_fp16_weights = False
        layer.weight = weight
    layer.bias = bias
    return layer


def _planned_mode(mode: QuantMode) -> QuantMode:
    """``mode`` with its ``replace`` swapped for :func:`planned_linear` (all of quantize_model's logic kept)."""

    if mode.name not in _PLANNED_FORMATS:
        # Modes written in plain torch ops (int8-dynamic) run on fake tensors as they are.
        return mode

    def replace(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
        return planned_linear(linear, mode.name, dtype)

    return dataclasses.replace(mode, replace=replace)


def quantized_parameter_bytes(
    model: ModelLike, mode: str, dtype: str = "bfloat16", ignore_modules: Sequence[str] = ()
) -> int:
    """Bytes of the **parameters** category after ``quantize_model(model, mode, dtype)``, without allocating.

    Computed on a fake copy (or a fake build, for a factory) with :func:`planned_linear`: packed
    weights, absmax, nested constants and row scales at their exact sizes. The model is not changed.
    """
    return _count_quantized(model, mode, dtype, ignore_modules, parameter_tensors)


def quantization_constant_bytes(
    model: ModelLike, mode: str, dtype: str = "bfloat16", ignore_modules: Sequence[str] = ()
) -> int:
    """Bytes of the quantization constants alone (absmax, code books, row scales) after ``quantize_model``.

    Sharding keeps these whole on every rank (FSDP2 shards only the packed weights): pass them as
    ``shard_categories(..., replicated_parameter_bytes=...)``.
    """

    def constants(module: nn.Module) -> list[torch.Tensor]:
        return [t for p in module.parameters() for t in quantization_tensors(p)]

    return _count_quantized(model, mode, dtype, ignore_modules, constants)


def _count_quantized(
    model: ModelLike,
    mode: str,
    dtype: str,
    ignore_modules: Sequence[str],
    tensors: Callable[[nn.Module], list[torch.Tensor]],
) -> int:
    fake_mode = _fake_mode()
    with warnings.catch_warnings(), _quiet_logs():
        warnings.simplefilter("ignore")
        module = _build(model, fake_mode)
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        with fake_mode:
            module.configure_model()
            quantize_model(module, _planned_mode(get_mode(mode)), dtype, ignore_modules)
            return _storage_bytes(tensors(module))


# --------------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------------


class _LiveStorages(TorchDispatchMode):
    """Every storage alive during a (fake) trace: running byte count and, per phase, what was alive at its peak.

    Identity is the storage object (fake tensors have no data pointer); a ``weakref.finalize`` on it
    takes its bytes off when autograd or Python frees it. Storages created before the trace are
    registered with :meth:`track`. While :attr:`measuring`, each phase (forward, backward, step) keeps
    a copy of the live set at its highest byte count.
    """

    def __init__(self) -> None:
        super().__init__()
        self._uids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live: dict[int, int] = {}
        self.born_in_forward: set[int] = set()
        self.phase = "setup"
        self.measuring = False
        self.current = 0
        self.phase_peaks: dict[str, dict[int, int]] = {}
        self._phase_peak = 0
        self._next_uid = 0

    def track(self, tensor: torch.Tensor) -> Optional[int]:
        """The uid of the storage behind ``tensor`` (registered on first sight)."""
        if not isinstance(tensor, torch.Tensor):
            return None
        uid = None
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            uid = self._uids.get(storage)
            if uid is None:
                uid = self._next_uid
                self._next_uid += 1
                self._uids[storage] = uid
                nbytes = storage.nbytes()
                self.live[uid] = nbytes
                self.current += nbytes
                if self.measuring and self.phase == "forward":
                    self.born_in_forward.add(uid)
                weakref.finalize(storage, self._free, uid)
        return uid

    def _free(self, uid: int) -> None:
        self.current -= self.live.pop(uid, 0)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self.measuring and phase not in self.phase_peaks:
            self.phase_peaks[phase] = dict(self.live)
            self._phase_peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        if self.measuring and self.current > self._phase_peak and self.phase in self.phase_peaks:
            self._phase_peak = self.current
            self.phase_peaks[self.phase] = dict(self.live)
        return out


@dataclass(frozen=True)
class Prediction:
    """The predicted memory of one candidate.

    Attributes:
        candidate: the configuration.
        categories: bytes per category (:data:`CATEGORIES`) at the predicted peak of a steady-state step.
        overhead: stated constant added on CUDA (:data:`CUDA_CONTEXT_BYTES`), 0 on CPU.
        trainable_params / total_params: parameter counts after the transforms (4-bit counted unpacked).
        cost: relative step time (:meth:`Candidate.relative_cost`).
        budget: the budget it was checked against, or None.
        host_bytes: bytes moved to CPU memory by ``offload`` (not part of ``peak``).
        block_bytes: parameter bytes of the largest repeated block (transformer layer), after the transforms.
    """

    candidate: Candidate
    categories: dict[str, int]
    overhead: int = 0
    trainable_params: int = 0
    total_params: int = 0
    cost: float = 1.0
    budget: Optional[int] = None
    host_bytes: int = 0
    block_bytes: int = 0

    def per_rank(self, world_size: int) -> dict[str, int]:
        """Bytes per category on each of ``world_size`` ranks under FSDP/ZeRO-3 (see :func:`shard_categories`).

        Predict with the per-rank batch; the largest repeated block's parameters (:attr:`block_bytes`) are
        what each rank all-gathers at once.
        """
        return shard_categories(self.categories, world_size, gathered_bytes=self.block_bytes)

    @property
    def peak(self) -> int:
        """Live tensor bytes at the peak (what ``torch.cuda.max_memory_allocated`` would report)."""
        return sum(self.categories.values())

    @property
    def total(self) -> int:
        """``peak + overhead``: what must fit in the device."""
        return self.peak + self.overhead

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget is None else self.total <= self.budget


def shard_categories(
    categories: dict[str, int], world_size: int, gathered_bytes: int = 0, replicated_parameter_bytes: int = 0
) -> dict[str, int]:
    """Per-rank bytes when parameters, gradients and optimizer states are sharded over ``world_size`` ranks.

    FSDP/ZeRO-3 semantics: the three model-state categories are split evenly (rounded up), each rank
    keeps the activations of its own micro-batch (``categories`` must come from a per-rank batch), and
    ``gathered_bytes`` (the unsharded parameters of the largest wrapped unit, all-gathered during its
    forward/backward) is added to ``other``. ``replicated_parameter_bytes`` are parameter bytes every
    rank keeps whole: FSDP2 shards a 4-bit weight's packed data but not its quantization constants
    (absmax, code books), see :func:`quantization_constant_bytes`.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"Unknown categories {sorted(unknown)}; expected {list(CATEGORIES)}.")
    per_rank = dict(categories)
    for name in ("parameters", "gradients", "optimizer_states"):
        per_rank[name] = -(-categories.get(name, 0) // world_size)
    if replicated_parameter_bytes:
        sharded = categories.get("parameters", 0) - replicated_parameter_bytes
        per_rank["parameters"] = -(-sharded // world_size) + replicated_parameter_bytes
    per_rank["other"] = categories.get("other", 0) + (gathered_bytes if world_size > 1 else 0)
    return per_rank


def _fake_mode() -> FakeTensorMode:
    """A FakeTensorMode in which ``nn.Module.to`` works on fake parameters.

    FakeTensorMode memoizes every op output in a ``WeakValueDictionary`` (meta tensor -> fake tensor),
    and ``Module._apply`` moves fake parameters with ``torch.utils.swap_tensors``, which refuses tensors
    that have a weak reference. The memo only maps a meta tensor to its fake twin, which fresh op outputs
    never need again, so it is skipped for them; real -> fake conversions keep theirs.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_mode.fake_tensor_converter.set_tensor_memo = lambda tensor, fake: None
    return fake_mode


@contextmanager
def _quiet_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("lightning_hbm", "lightning.pytorch.utilities.rank_zero")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _eager_transformers() -> Iterator[None]:
    """Make Hugging Face models take their eager code paths on fake tensors.

    transformers treats a fake tensor as "tracing" (``is_tracing``) and then materializes the causal mask
    and repeats the key/value heads instead of letting SDPA handle causality and GQA: B*H*T*T bytes per
    layer that the real eager run never allocates. During the planner's trace, fake tensors say nothing
    about tracing, so the model runs as it will in training. A check that must read data (a padding mask)
    then fails with ``DataDependentOutputException``, and :func:`predict` retries without this.
    """
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing") or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    originals = masking.is_tracing, masking.find_packed_sequence_indices
    masking.is_tracing = lambda tensor=None: originals[0](None)
    # Packed-sequence detection reads position ids; the planner assumes one sequence per row (which is
    # what the model's own position ids say when the batch holds none).
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_tracing, masking.find_packed_sequence_indices = originals


def _fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor of the same shape, strides and dtype (the trace runs CPU kernels, see the module doc).

    Not ``fake_mode.from_tensor``: that keeps the device (a model already on CUDA would trace CUDA kernel
    choices that need a GPU) and reads nothing we need.
    """
    with fake_mode:
        return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")


def _fake_copy(module: pl.LightningModule, fake_mode: FakeTensorMode) -> pl.LightningModule:
    """A copy of ``module`` whose parameters and buffers are fake (nothing of the real weights is copied)."""
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        fake = _fake_like(tensor, fake_mode)
        memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    # The copy must not drag the Trainer along (nor log into it): detach it for the duration of the copy.
    saved = {attr: module.__dict__.get(attr) for attr in ("_trainer", "_fabric")}
    for attr in saved:
        module.__dict__[attr] = None
    try:
        return copy.deepcopy(module, memo)
    finally:
        module.__dict__.update(saved)


def _build(model: ModelLike, fake_mode: FakeTensorMode) -> pl.LightningModule:
    if isinstance(model, pl.LightningModule):
        return _fake_copy(model, fake_mode)
    if isinstance(model, nn.Module) or not callable(model):
        raise TypeError(
            f"plan() needs a LightningModule or a factory returning one, got {type(model).__name__}. "
            "Wrap a plain nn.Module in a LightningModule (training_step + configure_optimizers)."
        )
    with fake_mode:
        built = model()
    if not isinstance(built, pl.LightningModule):
        raise TypeError(f"The model factory returned {type(built).__name__}, not a LightningModule.")
    return built


def example_batch(batch: BatchLike) -> Any:
    """The example batch: ``batch`` itself, or one training batch of a datamodule."""
    if batch is None:
        raise ValueError("plan() needs an example batch (or a LightningDataModule) to trace a training step.")
    if isinstance(batch, pl.LightningDataModule):
        if hasattr(batch, "example_batch"):
            return batch.example_batch()
        batch.prepare_data()
        batch.setup("fit")
        return next(iter(batch.train_dataloader()))
    if not any(isinstance(t, torch.Tensor) for t in tree_leaves(batch)):
        raise ValueError(f"The example batch holds no tensor (got {type(batch).__name__}); pass one training batch.")
    return batch


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ValueError(
        f"training_step returned {type(output).__name__}; the planner traces automatic optimization and needs "
        "the loss tensor (or a dict with 'loss')."
    )


def _apply_candidate(
    module: pl.LightningModule, candidate: Candidate, plugin: Precision
) -> tuple[list[torch.optim.Optimizer], list[SurgeryCallback]]:
    """Run the surgery the Trainer would run after ``configure_model`` (same order as :func:`lightning_hbm.surgery.install`)."""
    transforms = candidate.callbacks()
    apply_transforms(module, [t for t in transforms if t.stage < Stage.QUANTIZE])
    if isinstance(plugin, QuantizedPrecision):
        quantize_model(module, _planned_mode(plugin.mode), plugin.dtype, plugin.ignore_modules)
        mark_applied(module, f"QuantizedPrecision({plugin.mode.name})")
    elif isinstance(plugin, HalfPrecision):
        # What HalfPrecision.convert_module does (module.to(dtype)), in place: Module.to swaps fake
        # parameters for new ones, which fails on tensors FakeTensorMode holds weak references to.
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(plugin._desired_input_dtype)
    apply_transforms(module, [t for t in transforms if t.stage > Stage.QUANTIZE])
    module.train()
    optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    if applied_transforms(module):
        prune_frozen_parameters(optimizers)
    for transform in sorted(transforms, key=lambda t: int(t.stage)):
        # Outside the fake mode: bitsandbytes' 8-bit optimizers build their quantization maps from
        # Python floats when constructed (``.tolist()`` cannot run on fake tensors). The maps are real
        # (2 KiB, shared) and mix with fake states as they would with real ones.
        with unset_fake_temporarily():
            optimizers = transform.transform_optimizers(optimizers, configs)
    return optimizers, transforms


def _uids(tracker: _LiveStorages, tensors: Iterable[torch.Tensor]) -> set[int]:
    return {uid for t in tensors if (uid := tracker.track(t)) is not None}


def predict(
    model: ModelLike,
    batch: BatchLike,
    candidate: Candidate,
    device: str = "cpu",
    budget: Optional[int] = None,
    extrapolate: Union[bool, Literal["auto"]] = "auto",
) -> Prediction:
    """Predict the steady-state training peak of ``model`` on ``batch`` under ``candidate``, allocating no weights.

    ``extrapolate``: trace the model with its repeated blocks (the largest ``nn.ModuleList`` of one
    block class, as ``ActivationCheckpointing`` finds them) cut to 3 and to 4, and extend each phase's
    categories linearly to the real depth. ``"auto"`` does so from 8 blocks on (a 32-layer 8B model then
    traces 7 blocks instead of 32); ``False`` always traces the whole model. Cut to 2 and 3 instead, the
    line overshot by up to 34 % (the first and last blocks differ from the middle ones); from 3 and 4 it
    equals the full trace byte for byte on the 6- and 12-block test models (``tests/test_planner.py``).
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (the target of the prediction), got {device!r}.")
    if extrapolate not in (True, False, "auto"):
        raise ValueError(f"extrapolate must be True, False or 'auto', got {extrapolate!r}.")
    if candidate.offload and device != "cuda":
        raise ValueError(
            f"{candidate.name}: offloading optimizer states to CPU memory only saves device memory on CUDA; "
            "plan it with device='cuda' (on a CPU machine the states stay in the same memory)."
        )
    batch = example_batch(batch)
    if extrapolate is False:
        trace = _trace_with_fallback(model, batch, candidate, device, keep_blocks=None)
    else:
        trace = _trace_with_fallback(model, batch, candidate, device, keep_blocks=3)
        depth = trace.depth
        if depth > 4 and (extrapolate is True or depth >= 8):
            deeper = _trace_with_fallback(model, batch, candidate, device, keep_blocks=4)
            trace = trace.extrapolate(deeper, depth)
        elif depth > 3:
            trace = _trace_with_fallback(model, batch, candidate, device, keep_blocks=None)
    host = 0
    if candidate.offload:  # stated model: states leave the device, transfer buffers are not counted
        host = max(phase["optimizer_states"] for phase in trace.phases.values())
        for phase in trace.phases.values():
            phase["optimizer_states"] = 0
    return Prediction(
        candidate=candidate,
        categories=trace.peak_categories(),
        host_bytes=host,
        overhead=CUDA_CONTEXT_BYTES if device == "cuda" else 0,
        trainable_params=trace.trainable,
        total_params=trace.total,
        block_bytes=trace.block_bytes,
        cost=candidate.relative_cost(),
        budget=budget,
    )


@dataclass
class _Trace:
    """What one traced step held: per phase (forward, backward, step), the categories at that phase's peak."""

    phases: dict[str, dict[str, int]]
    trainable: int
    total: int
    depth: int  # number of repeated blocks of the full model (0: none found)
    kept: int  # blocks traced
    block_bytes: int = 0  # parameter bytes of the largest repeated block (what FSDP gathers at once)

    def peak_categories(self) -> dict[str, int]:
        return max(self.phases.values(), key=lambda c: sum(c.values()))

    def extrapolate(self, deeper: _Trace, depth: int) -> _Trace:
        """Extend linearly from ``self`` (k blocks) and ``deeper`` (k+1 blocks) to ``depth`` blocks."""
        extra = depth - self.kept

        def line(a: int, b: int) -> int:
            return max(0, a + extra * (b - a))

        phases = {
            phase: {c: line(cats[c], deeper.phases[phase][c]) for c in CATEGORIES}
            for phase, cats in self.phases.items()
            if phase in deeper.phases
        }
        return _Trace(
            phases, line(self.trainable, deeper.trainable), line(self.total, deeper.total), depth, depth,
            self.block_bytes,
        )


def _trace_with_fallback(
    model: ModelLike, batch: Any, candidate: Candidate, device: str, keep_blocks: Optional[int]
) -> _Trace:
    try:
        return _trace(model, batch, candidate, device, keep_blocks, eager_transformers=True)
    except DataDependentOutputException:
        return _trace(model, batch, candidate, device, keep_blocks, eager_transformers=False)


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks as ``ActivationCheckpointing`` finds them (children of a ModuleList of one class)."""
    from lightning_hbm.callbacks.activation_checkpointing import find_blocks

    return find_blocks(module)


def _storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    storages = {}
    for tensor in tensors:
        for plain in plain_tensors(tensor):
            storage = plain.untyped_storage()
            storages[id(storage)] = (storage, storage.nbytes())  # the storage is kept alive: ids stay unique
    return sum(nbytes for _, nbytes in storages.values())


def _cut_blocks(module: nn.Module, keep: Optional[int]) -> int:
    """Cut the largest list of repeated blocks to ``keep`` (in place); returns its full length (0: none)."""
    lists: dict[str, int] = {}
    for name, _ in _blocks(module):
        parent = name.rpartition(".")[0]
        lists[parent] = lists.get(parent, 0) + 1
    if not lists:
        return 0
    parent, depth = max(lists.items(), key=lambda item: item[1])
    if keep is not None and depth > keep:
        blocks = module.get_submodule(parent) if parent else module
        del blocks[keep:]
    return depth


def _trace(
    model: ModelLike, batch: Any, candidate: Candidate, device: str, keep_blocks: Optional[int], eager_transformers: bool
) -> _Trace:
    plugin = candidate.precision_plugin("cpu")
    fake_mode = _fake_mode()
    tracker = _LiveStorages()
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # self.log without a Trainer, peft/bnb notices: noise during a dry run
        stack.enter_context(_quiet_logs())  # the callbacks' "applied to N blocks" lines, once per trace
        module = _build(model, fake_mode)
        if eager_transformers:  # after the build: the model's import brings transformers in
            stack.enter_context(_eager_transformers())
        fake_batch = tree_map_only(torch.Tensor, lambda t: _fake_like(t, fake_mode), batch)
        # The memo of real -> fake conversions holds weak references to the fakes it made, and
        # Module.to (peft moves adapters with it) refuses to swap a tensor that has one.
        fake_mode.fake_tensor_converter.meta_converter.tensor_memo.clear()
        stack.enter_context(fake_mode)
        with plugin.tensor_init_context():
            module.configure_model()
        depth = _cut_blocks(module, keep_blocks)
        optimizers, _ = _apply_candidate(module, candidate, plugin)
        if device == "cuda":
            # torch's optimizers default to their foreach implementation on CUDA (single-tensor on CPU,
            # where the trace runs): its temporaries (AdamW: one copy of the trained parameters) count.
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                        group["foreach"] = True
        fake_batch = plugin.convert_input(fake_batch)
        stack.enter_context(tracker)
        _uids(tracker, itertools.chain(parameter_tensors(module), buffer_tensors(module), tree_leaves(fake_batch)))
        # The state a first step leaves behind, without tracing its forward and backward (half the
        # trace time): a gradient for every trained parameter, and the optimizer states that a step
        # with those gradients creates.
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
            optimizer.step()
        previous_grads = _uids(tracker, gradient_tensors(module))
        # states created outside the dispatch (e.g. bitsandbytes' real quantization maps)
        _uids(tracker, optimizer_state_tensors(optimizers))
        # The steady-state step, as Lightning runs it: forward, zero_grad, backward, optimizer step.
        tracker.measuring = True
        tracker.set_phase("forward")
        with plugin.forward_context():
            loss = _loss_of(module.training_step(fake_batch, 1))
        tracker.set_phase("backward")
        for optimizer in optimizers:  # Lightning zeroes gradients after the forward, before backward
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        del loss
        tracker.set_phase("step")
        for optimizer in optimizers:
            optimizer.step()
        tracker.set_phase("done")
        owners = {
            "parameters": _uids(tracker, parameter_tensors(module)),
            "gradients": previous_grads | _uids(tracker, gradient_tensors(module)),
            "optimizer_states": _uids(tracker, optimizer_state_tensors(optimizers)),
            "other": _uids(tracker, buffer_tensors(module)),
        }
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        total = _logical_params(module)
        block_bytes = max((_storage_bytes(parameter_tensors(block)) for _, block in _blocks(module)), default=0)
    phases = {}
    for phase, live in tracker.phase_peaks.items():
        categories = dict.fromkeys(CATEGORIES, 0)
        for uid, nbytes in live.items():
            category = next((c for c, uids in owners.items() if uid in uids), None)
            if category is None:
                category = "activations" if uid in tracker.born_in_forward else "other"
            categories[category] += nbytes
        phases[phase] = categories
    kept = min(depth, keep_blocks) if keep_blocks is not None else depth
    return _Trace(phases, trainable, total, depth, kept, block_bytes)


def _logical_params(module: nn.Module) -> int:
    total = 0
    for param in module.parameters():
        shape = getattr(getattr(param, "quant_state", None), "shape", None)
        total += int(torch.Size(shape).numel()) if shape is not None else param.numel()
    return total


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Predictions for every candidate, fastest first, and the choice for the budget.

    Attributes:
        predictions: sorted by relative step time, then fidelity (closest to the user's training first).
        budget: bytes the configuration must fit in (peak + overhead), or None.
        device: ``"cpu"`` or ``"cuda"``.
        failures: candidates that could not be traced, with the reason.
    """

    predictions: list[Prediction]
    budget: Optional[int] = None
    device: str = "cpu"
    failures: list[tuple[Candidate, str]] = field(default_factory=list)

    @property
    def chosen(self) -> Optional[Prediction]:
        """The fastest prediction that fits the budget (the first one when there is no budget)."""
        if self.budget is None:
            return self.predictions[0] if self.predictions else None
        return next((p for p in self.predictions if p.fits), None)

    def closest(self, n: int = 3) -> list[Prediction]:
        """The ``n`` predictions with the smallest total memory."""
        return sorted(self.predictions, key=lambda p: p.total)[:n]

    def find(self, candidate: Candidate) -> Prediction:
        """The prediction of ``candidate``."""
        for prediction in self.predictions:
            if prediction.candidate == candidate:
                return prediction
        raise KeyError(f"{candidate.name} is not in this plan.")

    def rows(self) -> list[list[str]]:
        """One row per prediction: name, each category, peak, total, fits, cost."""
        rows = []
        for p in self.predictions:
            fits = "-" if p.fits is None else ("yes" if p.fits else "no")
            rows.append(
                [p.candidate.name]
                + [format_bytes(p.categories[c]) for c in CATEGORIES]
                + [format_bytes(p.peak), format_bytes(p.total), fits, f"{p.cost:.2f}x"]
            )
        return rows

    def table(self) -> Any:
        """A ``rich.table.Table`` of :meth:`rows` (the chosen row in bold)."""
        from rich.table import Table

        budget = "" if self.budget is None else f", budget {format_bytes(self.budget)}"
        table = Table(title=f"lightning_hbm plan ({self.device}{budget})")
        for column in ["candidate", *CATEGORIES, "peak", "peak+overhead", "fits", "step time"]:
            table.add_column(column, justify="left" if column == "candidate" else "right")
        chosen = self.chosen
        for prediction, row in zip(self.predictions, self.rows()):
            table.add_row(*row, style="bold green" if prediction is chosen else None)
        return table

    def __str__(self) -> str:
        header = ["candidate", *CATEGORIES, "peak", "peak+overhead", "fits", "step time"]
        rows = [header, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def plan(
    model: ModelLike,
    batch: BatchLike,
    budget: Union[str, int, None] = None,
    candidates: Optional[Sequence[Candidate]] = None,
    device: Literal["cpu", "cuda"] = "cpu",
) -> Plan:
    """Predict each candidate's training memory for ``model`` on ``batch`` without allocating the model.

    Args:
        model: the user's LightningModule, or a factory (e.g. the class) that builds it; a factory is
            called under ``FakeTensorMode``, so even an 8B model allocates nothing.
        batch: one training batch, or a LightningDataModule (its first training batch is used).
        budget: device memory the run must fit in (``"24GiB"``, bytes), or None.
        candidates: configurations to predict (default: :func:`default_candidates`).
        device: where training will run; ``"cuda"`` adds :data:`CUDA_CONTEXT_BYTES` to each total.

    Returns a :class:`Plan`; ``plan(...).chosen`` is the fastest candidate that fits.
    """
    budget_bytes = None if budget is None else parse_bytes(budget)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")
    candidates = list(default_candidates() if candidates is None else candidates)
    if not candidates or not all(isinstance(c, Candidate) for c in candidates):
        raise TypeError(f"candidates must be a non-empty list of lightning_hbm.planner.Candidate, got {candidates!r}.")
    batch = example_batch(batch)
    predictions, failures = [], []
    for candidate in candidates:
        try:
            predictions.append(predict(model, batch, candidate, device=device, budget=budget_bytes))
        except Exception as err:  # one candidate that cannot be traced must not hide the others
            if isinstance(err, TypeError) and "LightningModule" in str(err):
                raise  # the model itself is wrong, not this candidate
            failures.append((candidate, f"{type(err).__name__}: {err}"))
    if not predictions:
        reasons = "; ".join(f"{c.name}: {r}" for c, r in failures[:5])
        raise ValueError(f"No candidate could be planned for {type(model).__name__}: {reasons}")
    predictions.sort(key=lambda p: (p.cost, -p.candidate.fidelity(), p.total))
    return Plan(predictions=predictions, budget=budget_bytes, device=device, failures=failures)


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "Candidate",
    "Plan",
    "Prediction",
    "available_axes",
    "default_candidates",
    "example_batch",
    "format_bytes",
    "parse_bytes",
    "plan",
    "planned_linear",
    "predict",
    "quantized_parameter_bytes",
    "shard_categories",
]
