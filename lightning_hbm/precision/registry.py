"""Name -> quantization mode registry (the torchao ``quantize_`` pattern: one small config per mode).

A mode says how one frozen ``nn.Linear`` is replaced: ``replace(linear, compute_dtype, device)``
returns the new module, holding the *same* input/output features and the linear's bias. Modes
register themselves with :func:`register_mode`; :func:`get_mode` turns an unknown name into a
``ValueError`` that lists the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
from torch import nn

from lightning_hbm.naming import did_you_mean

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


@dataclass(frozen=True)
class QuantMode:
    """One precision mode: how a frozen Linear is stored and computed."""

    name: str
    replace: ReplaceFn
    dtypes: tuple[torch.dtype, ...]
    description: str
    # what peft needs to know to pick its quantization-aware LoRA layer ("4bit", "8bit" or None)
    peft_kind: Optional[str] = None
    # the same layer built from a FakeTensor weight (the planner predicts memory without allocating):
    # storage of the exact shapes and dtypes, nothing computed. None: ``replace`` runs on fake tensors as is.
    fake: Optional[ReplaceFn] = None

    def for_fake_tensors(self) -> QuantMode:
        """This mode with ``replace`` swapped for its fake-tensor construction (used by the planner)."""
        return self if self.fake is None else replace(self, replace=self.fake, fake=None)


_MODES: dict[str, QuantMode] = {}


def register_mode(
    name: str,
    *,
    dtypes: tuple[torch.dtype, ...],
    description: str,
    peft_kind: Optional[str] = None,
    fake: Optional[ReplaceFn] = None,
) -> Callable[[ReplaceFn], ReplaceFn]:
    """Decorator: register ``fn(linear, compute_dtype, device) -> nn.Module`` as mode ``name``.

    ``fake``: how to build the same layer when ``linear.weight`` is a FakeTensor, if ``fn`` cannot
    (bitsandbytes' parameter classes cannot wrap one); the planner uses it.
    """

    def decorator(fn: ReplaceFn) -> ReplaceFn:
        if name in _MODES:
            raise ValueError(f"Precision mode {name!r} is already registered.")
        _MODES[name] = QuantMode(name, fn, dtypes, description, peft_kind, fake)
        return fn

    return decorator


def available_precisions() -> list[str]:
    """Names accepted by :func:`lightning_hbm.precision_plugin` and ``QuantizedPrecision(mode=...)``."""
    return sorted(_MODES)


def get_mode(name: str) -> QuantMode:
    """The registered mode ``name``; unknown names raise a ``ValueError`` listing the valid ones."""
    if not isinstance(name, str) or name not in _MODES:
        raise ValueError(
            f"Unknown lightning_hbm precision mode {name!r}.{did_you_mean(str(name), _MODES)} Valid modes: {', '.join(available_precisions())}."
        )
    return _MODES[name]


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
