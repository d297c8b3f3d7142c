"""``QuantizedPrecision``: a Lightning precision plugin that stores frozen Linear weights quantized.

What it shrinks: the **parameters** term. Every ``nn.Linear`` weight (unless ignored or tied to
another module) becomes quantized storage that never receives gradients; embeddings, norms and
biases stay trainable in the compute ``dtype``. Built on bitsandbytes directly rather than on
Lightning's ``BitsandbytesPrecision``, which refuses CPU, freezes biases and can only load fp32
weights on CUDA (shared/notes/verified-facts.md).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Generator, Optional, Sequence, Union

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hbm.precision.registry import QuantMode, get_mode, to_dtype
from lightning_hbm.surgery import (
    _STATE_ATTR,
    applied_transforms,
    mark_applied,
    pack_checkpoint,
    trainer_optimizers,
    trainer_surgery,
)

log = logging.getLogger(__name__)

_LIGHTNING_NAMES = {torch.bfloat16: "bf16-true", torch.float16: "16-true", torch.float32: "32-true"}


def _quantizable_linears(
    module: nn.Module, ignore_modules: Sequence[str]
) -> tuple[list[tuple[str, nn.Linear]], list[str]]:
    """(name, Linear) pairs to quantize, and the names of Linears skipped because their weight is tied."""
    owners: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    chosen, tied = [], []
    for name, child in module.named_modules():
        if type(child) is not nn.Linear:  # exact class: already-quantized or LoRA layers are not Linears to redo
            continue
        if any(name == ign or name.startswith(ign + ".") for ign in ignore_modules):
            continue
        if owners.get(id(child.weight), 0) > 1:
            tied.append(name)  # e.g. lm_head tied to the embedding: quantizing would untie them
            continue
        chosen.append((name, child))
    return chosen, tied


def _validate(
    module: nn.Module, quant_mode: QuantMode, compute_dtype: torch.dtype, ignore_modules: Sequence[str]
) -> tuple[list[tuple[str, nn.Linear]], list[str]]:
    """Every check of :func:`quantize_model`, changing nothing; returns (targets, tied names)."""
    if compute_dtype not in quant_mode.dtypes:
        raise ValueError(
            f"Precision mode {quant_mode.name!r} does not support dtype {compute_dtype}. "
            f"Supported: {[str(d) for d in quant_mode.dtypes]}."
        )
    names = {n for n, _ in module.named_modules()}
    unknown = [ign for ign in ignore_modules if not any(n == ign or n.startswith(ign + ".") for n in names)]
    if unknown:
        sample = sorted(n for n in names if n)[:12]
        raise ValueError(
            f"ignore_modules={list(ignore_modules)!r}: {unknown} match no submodule of {type(module).__name__}. "
            f"Use module names (prefix match) such as {sample}."
        )
    targets, tied = _quantizable_linears(module, ignore_modules)
    if not targets and not tied and not any(isinstance(m, nn.Linear) for m in module.modules()):
        raise ValueError(
            f"{type(module).__name__} has no torch.nn.Linear layers, so precision mode {quant_mode.name!r} has "
            "nothing to quantize. Use Lightning's precision='bf16-true' (or '32-true') for this model instead."
        )
    return targets, tied


def quantize_model(
    module: nn.Module,
    mode: Union[str, QuantMode],
    dtype: Union[str, torch.dtype] = "bfloat16",
    ignore_modules: Sequence[str] = (),
    device: Optional[Union[str, torch.device]] = None,
) -> list[str]:
    """Replace the ``nn.Linear`` layers of ``module`` in place by quantized frozen layers.

    Works on a model that already holds its loaded weights. Validates everything before changing
    anything. Returns the names of the quantized layers.
    """
    quant_mode = get_mode(mode) if isinstance(mode, str) else mode
    compute_dtype = to_dtype(dtype)
    targets, tied = _validate(module, quant_mode, compute_dtype, ignore_modules)
    if not targets:
        return []  # already quantized (or everything ignored / tied): nothing left to do
    if tied:
        log.info("lightning_hbm: not quantizing %s (weight tied to another module)", tied)
    target = torch.device(device) if device is not None else None
    for name, linear in targets:
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child_name, quant_mode.replace(linear, compute_dtype, target))
    # Everything that is not quantized storage computes in the compute dtype and stays trainable.
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != compute_dtype:
            param.data = param.data.to(compute_dtype)
    # peft picks its quantization-aware LoRA layers (mergeable) only when the model says so.
    if quant_mode.peft_kind == "4bit":
        object.__setattr__(module, "is_loaded_in_4bit", True)
    elif quant_mode.peft_kind == "8bit":
        object.__setattr__(module, "is_loaded_in_8bit", True)
    return [name for name, _ in targets]


class QuantizedPrecision(Precision):
    """Frozen base weights stored quantized (bitsandbytes or ``int8-dynamic``), selected by name.

    Args:
        mode: one of :func:`lightning_hbm.available_precisions` (``nf4``, ``nf4-dq``, ``fp4``,
            ``fp4-dq``, ``int8``, ...).
        dtype: compute dtype of the quantized matmuls and storage dtype of every other parameter:
            ``"bfloat16"``/``"bf16"``, ``"float16"``, ``"float32"`` or a ``torch.dtype``.
        ignore_modules: submodule names (prefix match) whose Linears stay unquantized, e.g.
            ``["lm_head"]``. A name that matches nothing is an error.

    Applied at lightning_hbm's surgery point (:mod:`lightning_hbm.surgery`): after
    ``configure_model``, before ``configure_optimizers``, first of all model changes.

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")])
    """

    def __init__(
        self,
        mode: str = "nf4-dq",
        dtype: Union[str, torch.dtype] = "bfloat16",
        ignore_modules: Sequence[str] = (),
    ) -> None:
        self.mode = get_mode(mode)
        self.dtype = to_dtype(dtype)
        if self.dtype not in self.mode.dtypes:
            raise ValueError(
                f"Precision mode {mode!r} does not support dtype {self.dtype}. "
                f"Supported: {[str(d) for d in self.mode.dtypes]}; pass dtype='bfloat16' for example."
            )
        if isinstance(ignore_modules, str):
            raise TypeError(f"ignore_modules must be a list of module names, got the string {ignore_modules!r}.")
        self.ignore_modules = tuple(ignore_modules)
        if self.mode.peft_kind is not None:  # bitsandbytes modes: fail now, not at fit time
            from lightning_hbm.precision.bnb import import_bnb

            import_bnb()
        self.precision = _LIGHTNING_NAMES[self.dtype]  # what trainer.precision reports
        # Set by the surgery spine to the strategy's root device, so weights are quantized there.
        self.target_device: Optional[torch.device] = None

    runs_surgery = True  # the surgery spine needs no wrapper around this plugin: it calls the engine itself

    @property
    def _name(self) -> str:
        return f"QuantizedPrecision({self.mode.name})"

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """lightning_hbm's surgery point: checks, quantization, then the Trainer's transforms."""
        return trainer_surgery(module, self, self.convert_base)

    def convert_base(self, module: nn.Module) -> nn.Module:
        """Quantize ``module``'s Linear layers in place (once per model), and nothing else."""
        if self._name in applied_transforms(module):
            return module
        quantized = quantize_model(module, self.mode, self.dtype, self.ignore_modules, self.target_device)
        log.info("lightning_hbm: %d Linear layers stored as %s", len(quantized), self.mode.name)
        mark_applied(module, self._name)
        return module

    def check_model(self, module: nn.Module) -> None:
        """Raise before any change if ``module`` cannot be quantized with these settings."""
        if self._name not in applied_transforms(module):
            _validate(module, self.mode, self.dtype, self.ignore_modules)

    def resume_config(self) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint."""
        return {"mode": self.mode.name, "dtype": str(self.dtype), "ignore_modules": list(self.ignore_modules)}

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        optimizers = trainer_optimizers(self, optimizers, lr_schedulers)
        return super().connect(model, optimizers, lr_schedulers)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = getattr(self, _STATE_ATTR, None)
        if state is not None:
            pack_checkpoint(state.trainer, checkpoint)

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
        return f"QuantizedPrecision(mode={self.mode.name!r}, dtype={self.dtype}, ignore_modules={list(self.ignore_modules)})"


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
