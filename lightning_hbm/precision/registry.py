"""Name -> quantized format registry (the torchao ``quantize_`` pattern: one small config per format).

The vocabulary: a *format* is the object (a :class:`QuantFormat`); a *mode* is only its name, the string users
pass (``QuantizedPrecision(mode="nf4-dq")``, ``trainer.precision: nf4-dq``). A format says everything the
rest of lightning_hbm asks about one way of storing a frozen ``nn.Linear``: how to build it
(``replace(linear, compute_dtype, device)`` returns the new module, holding the *same* input/output features and
the linear's bias), which modules are its own (:meth:`QuantFormat.owns`), how to read the weight back (:meth:`~QuantFormat.dequantize`: quality, LoRA merge, ``FusedLoss``), which tensors
hold its quantization constants (:meth:`~QuantFormat.constants`: storage counting, profiler and planner), the
shape its packed weight unpacks to (:meth:`~QuantFormat.weight_shape`: parameter counts), the code grid GPTQ may
round on (:meth:`~QuantFormat.rounding_grid`), the state_dict keys of its constants (``state_marks``: resume's
older-layout check), how peft wraps it (``peft_kind``), which wider modes the sensitivity plan may give its sensitive layers
(``ladder``), its step-time cost for the planner (``cost``) and its fake-tensor twin (``fake``). Consumers
ask :func:`format_of` (a module) or :func:`get_format` (a name) instead of testing classes or attribute names.

Formats register themselves with :func:`register_format`, the one registration function; :func:`get_format`
turns an unknown name into a ``ValueError`` that lists the valid ones. Every module of
:mod:`lightning_hbm.precision` is imported by the package, so a new format is one new file there
(docs/extending.md walks through one).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Optional, Union, cast

import torch
from torch import nn

from lightning_hbm.memory.storage import parameter_bytes, register_format_lookup
from lightning_hbm.naming import did_you_mean
from lightning_hbm.resume import register_changed_marks

ReplaceFn = Callable[[nn.Linear, torch.dtype, Optional[torch.device]], nn.Module]

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


class RoundingGrid(NamedTuple):
    """What GPTQ-style rounding needs of a 4-bit layer: weight ``j`` (row-major over ``[out, in]``) stored as code
    index ``i`` reads back as ``code[i] * block_scales[j // block_size]``; ``packed`` holds the indices, two per
    byte, the first in the high nibble (bitsandbytes' and torchao's layout), and is written in place."""

    code: torch.Tensor
    block_scales: torch.Tensor
    block_size: int
    packed: torch.Tensor


@dataclass(frozen=True)
class QuantFormat:
    """One quantized storage format: how a frozen Linear is stored and computed, and what consumers ask of it.

    The defaults describe a format whose layer is unknown to the consumers (a plain
    ``QuantFormat(name, replace, dtypes, description)``): it owns no module, has no constants outside its parameters and cannot be dequantized.
    Subclasses override the methods for the modules they build.
    """

    name: str
    replace: ReplaceFn
    dtypes: tuple[torch.dtype, ...]
    description: str
    # what peft needs to know to pick its quantization-aware LoRA layer ("4bit", "8bit" or None)
    peft_kind: Optional[str] = None
    # the same layer built from a FakeTensor weight (the planner predicts memory without allocating):
    # storage of the exact shapes and dtypes, nothing computed. None: ``replace`` runs on fake tensors as is.
    fake: Optional[ReplaceFn] = None
    # the wider modes a sensitive layer may take instead of this one (sensitivity ``"auto"``), narrowest first
    ladder: tuple[str, ...] = ("int8",)
    # step time added over an unquantized run, as a fraction (the planner's assumption: 4-bit 0.25, int8 0.5)
    cost: float = 0.25
    # True when the layer's forward is ``F.linear(x, dequantize(layer), bias)``: ``FusedLoss`` may then
    # dequantize a frozen head once for all its chunks instead of once per chunk and pass
    dense_forward: bool = False
    # parts of the state_dict keys its layer writes besides ``weight`` and ``bias`` (its constants): a checkpoint
    # holding them in its plain state_dict was written in lightning_hbm's older layout (``resume.check_layout``)
    state_marks: tuple[str, ...] = ()
    # the operators (``"namespace::name"``) whose output is its layer's matmul result, for ops that are not aten's
    # matmuls (``aten.mm`` and kin are known): ``ActivationCheckpointing("selective")`` keeps their outputs instead of
    # recomputing them. Their first argument is the layer's input, whose last dimension the matmul contracts.
    matmul_ops: tuple[str, ...] = ()

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise a ``ValueError`` (the dtype, the supported ones, a fix) if layers of this format cannot compute in ``dtype``.

        Raises:
            ValueError: ``dtype`` is not one of :attr:`dtypes`.
        """
        if dtype not in self.dtypes:
            raise ValueError(
                f"Precision mode {self.name!r} does not support dtype {dtype}. "
                f"Supported: {[str(d) for d in self.dtypes]}; pass dtype='bfloat16' for example."
            )

    def check(self, name: str, layer: nn.Module) -> None:
        """Raise a ``ValueError`` (what, the value, the fix) if layer ``name`` cannot be stored in this format.

        Called for every target before the first layer is quantized, so a refusal changes nothing.
        """

    def owns(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this format (as ``replace`` builds it)."""
        return False

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The ``[out, in]`` weight ``module`` multiplies with, in ``dtype`` (default: the format's own)."""
        raise TypeError(f"Precision mode {self.name!r} cannot dequantize {type(module).__name__}.")

    def compute_dtype(self, module: nn.Module) -> Optional[torch.dtype]:
        """The dtype ``module``'s forward multiplies in (``None``: the dtype of its input)."""
        return None

    def gather_rows(self, module: nn.Module, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` (1-d, int64) of the ``[out, in]`` weight, ``[len(index), in]`` in ``dtype``: a quantized
        embedding's lookup and a head's vocabulary slices (``FusedLoss``). A format that can unpack single rows
        overrides this; the default dequantizes the whole weight first (a transient as large as the weight)."""
        return torch.nn.functional.embedding(index, self.dequantize(module, dtype))

    def gather_range(self, module: nn.Module, start: int, stop: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Rows ``start:stop`` of the ``[out, in]`` weight, as :meth:`gather_rows` gives them (a head's vocabulary
        slices, :class:`~lightning_hbm.layers.embedding.SlicedLinear`). A format whose rows are stored in order
        overrides this to read them as views of its storage (no index gather: 0.03 s of SmolLM2's tied int8 head's
        0.09 s forward on a CPU); the default gathers them by index (an ``arange`` on ``device``)."""
        return self.gather_rows(module, torch.arange(start, stop, device=device), dtype)

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        """Tensors of ``module``'s quantization constants (scales, code books) that are not its parameters."""
        return []

    def weight_shape(self, module: nn.Module) -> torch.Size:
        """The ``[out, in]`` shape ``module``'s weight multiplies as (a packed weight counts its unpacked elements)."""
        return cast(torch.Tensor, module.weight).shape

    def rounding_grid(self, module: nn.Module) -> Optional[RoundingGrid]:
        """The code grid GPTQ rounding may choose indices on (:mod:`lightning_hbm.precision.gptq`); ``None``: this
        format keeps its own rounding (``QuantizedPrecision(rounding="gptq")`` names such layers)."""
        return None

    def for_fake_tensors(self) -> QuantFormat:
        """This format with ``replace`` swapped for its fake-tensor construction (used by the planner)."""
        return self if self.fake is None else replace(self, replace=self.fake, fake=None)


_MODES: dict[str, QuantFormat] = {}


def register_format(fmt: QuantFormat) -> QuantFormat:
    """Register ``fmt`` under ``fmt.name`` (the mode name users pass) and return it.

    Raises:
        ValueError: a format of the same name is already registered.
    """
    if fmt.name in _MODES:
        raise ValueError(f"Precision mode {fmt.name!r} is already registered.")
    _MODES[fmt.name] = fmt
    register_changed_marks(fmt.state_marks)
    return fmt


def format_of(module: nn.Module) -> Optional[QuantFormat]:
    """The registered format that owns ``module`` (first registered first), ``None`` for any other module."""
    return next((fmt for fmt in _MODES.values() if fmt.owns(module)), None)


# memory (level 0) and the layer kinds (level 1) ask for formats without importing precision, which sits above them
register_format_lookup(format_of)


def available_precisions() -> list[str]:
    """Names accepted by ``QuantizedPrecision(mode=...)``, :func:`quantize_model` and :func:`get_format`."""
    return sorted(_MODES)


def mode_table(in_features: int = 768, out_features: int = 3072, dtype: torch.dtype = torch.bfloat16) -> str:
    """The modes table of docs/parameters.md (markdown), one row per registered format (tests/precision check the page).

    Bytes per weight: a zero ``Linear(in_features, out_features)`` weight (a GPT-2 MLP shape) stored in the mode on
    CPU, quantization constants included (storage sizes depend on the shape only, so it is exact). GPTQ: whether
    the format has a code grid (:meth:`QuantFormat.rounding_grid`). Builds one layer per mode: needs the libraries.
    """
    lines = [
        "| mode | storage of a frozen Linear weight | bytes / weight | GPTQ rounding | sensitive layers may take |",
        "|---|---|---:|---|---|",
    ]
    for name, fmt in _MODES.items():
        linear = nn.Linear(in_features, out_features, bias=False, device="meta")
        linear.weight = nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)
        layer = fmt.replace(linear, dtype, torch.device("cpu"))
        per_weight = parameter_bytes(layer) / (in_features * out_features)
        gptq = "yes" if fmt.rounding_grid(layer) is not None else "no"
        ladder = ", ".join(f"`{mode}`" for mode in fmt.ladder)
        lines.append(f"| `{name}` | {fmt.description} | {per_weight:.3f} | {gptq} | {ladder} |")
    return "\n".join(lines)


def get_format(name: str, fake: bool = False) -> QuantFormat:
    """The format registered under the mode name ``name`` (``fake``: its fake-tensor twin, the planner's:
    :meth:`QuantFormat.for_fake_tensors`).

    Names are exact (lower case, as the CLI's ``trainer.precision`` and YAML files spell them): ``"NF4-DQ"`` is
    refused, with the lower-case name suggested, rather than accepted under a second spelling.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names and the closest one).
    """
    if isinstance(name, str) and name in _MODES:
        return _MODES[name].for_fake_tensors() if fake else _MODES[name]
    # difflib compares case-sensitively: "NF4-DQ" is close to no name, so the lower-case spelling comes first
    unknown, valid = f"Unknown lightning_hbm precision mode {name!r}.", f" Valid modes: {', '.join(available_precisions())}."
    same = [m for m in _MODES if m.lower() == str(name).lower()]
    hint = f" Did you mean {same[0]!r}? Mode names are lower case." if same else did_you_mean(str(name).lower(), _MODES)
    raise ValueError(unknown + hint + valid)


def to_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """Accept ``torch.bfloat16`` or a string such as ``"bfloat16"``, ``"bf16"``, ``"torch.float16"``."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise ValueError(
        f"Unsupported dtype {dtype!r}. Use one of {sorted(_DTYPE_NAMES)} or a torch.dtype such as torch.bfloat16."
    )
