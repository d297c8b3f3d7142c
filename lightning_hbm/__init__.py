"""lightning_hbm: make any LightningModule fit in the GPU memory (HBM) you have.

Memory is a sum: parameters + gradients + optimizer states + activations + overhead. Each part
of this package names the term it shrinks; ``HBMProfiler`` measures all of them.

The public names below are imported on first use (PEP 562 ``__getattr__``): ``import lightning_hbm``
and ``lightning-hbm --help`` do not import torch and Lightning (seconds of CPU on an idle machine,
about a minute on a loaded one: benchmarks/README.md, "Time to first output");
``from lightning_hbm import LoRA`` imports what ``LoRA`` needs, as before.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any

from lightning_hbm.quiet import quieted  # no filter at import: only around the imports below (issue 55)

#: public name -> the module defining it (imported by :func:`__getattr__` when the name is first read)
_EXPORTS = {
    "QuantizedPrecision": "lightning_hbm.precision",
    "available_precisions": "lightning_hbm.precision",
    "precision_plugin": "lightning_hbm.precision",
    "quantize_model": "lightning_hbm.precision",
    "CheckedCheckpointIO": "lightning_hbm.resume",
    "Stage": "lightning_hbm.surgery",
    "SurgeryCallback": "lightning_hbm.surgery",
    "applied_transforms": "lightning_hbm.surgery",
    "run_surgery": "lightning_hbm.surgery",
    "QuantizedFSDPStrategy": "lightning_hbm.strategies",
    "ActivationCheckpointing": "lightning_hbm.activations",
    "AttentionKernel": "lightning_hbm.activations",
    "LoRA": "lightning_hbm.adapters",
    "MemoryEfficientOptimizer": "lightning_hbm.optim",
    "CPUOffloadStrategy": "lightning_hbm.strategies.cpu_offload",
    "HBMProfiler": "lightning_hbm.profiling",
    "QuantizationQuality": "lightning_hbm.quality",
    "Int8DynamicLinear": "lightning_hbm.precision.int8_dynamic",
    "plan": "lightning_hbm.planner",
    "AutoFit": "lightning_hbm.planner.autofit",
    "FusedLoss": "lightning_hbm.activations",
    "coverage_of": "lightning_hbm.record",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports them
    from lightning_hbm.activations import ActivationCheckpointing, AttentionKernel, FusedLoss
    from lightning_hbm.adapters import LoRA
    from lightning_hbm.optim import MemoryEfficientOptimizer
    from lightning_hbm.profiling import HBMProfiler
    from lightning_hbm.quality import QuantizationQuality
    from lightning_hbm.record import coverage_of
    from lightning_hbm.planner import plan
    from lightning_hbm.planner.autofit import AutoFit
    from lightning_hbm.precision import QuantizedPrecision, available_precisions, precision_plugin, quantize_model
    from lightning_hbm.precision.int8_dynamic import Int8DynamicLinear
    from lightning_hbm.resume import CheckedCheckpointIO
    from lightning_hbm.strategies import QuantizedFSDPStrategy
    from lightning_hbm.strategies.cpu_offload import CPUOffloadStrategy
    from lightning_hbm.surgery import Stage, SurgeryCallback, applied_transforms, run_surgery


def __getattr__(name: str) -> Any:
    """A public name imported from its module on first use; a subpackage (``lightning_hbm.precision``) likewise."""
    if name in _EXPORTS:
        # the first public name read also registers the strategy names ("fsdp_qlora", "cpu_offload", ...) in
        # Lightning's StrategyRegistry, as importing this package did: Trainer(strategy="fsdp_qlora") keeps working
        with quieted():  # peft, torchao and bitsandbytes print at their import: nothing the user can act on
            importlib.import_module("lightning_hbm.strategies")
            value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    if name in {info.name for info in pkgutil.iter_modules(__path__)}:
        # `import lightning_hbm; lightning_hbm.surgery.run_surgery` worked when this file imported every subpackage
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "CheckedCheckpointIO",
    "ActivationCheckpointing",
    "AttentionKernel",
    "AutoFit",
    "CPUOffloadStrategy",
    "FusedLoss",
    "HBMProfiler",
    "Int8DynamicLinear",
    "LoRA",
    "MemoryEfficientOptimizer",
    "QuantizationQuality",
    "QuantizedPrecision",
    "QuantizedFSDPStrategy",
    "Stage",
    "SurgeryCallback",
    "applied_transforms",
    "available_precisions",
    "coverage_of",
    "plan",
    "precision_plugin",
    "quantize_model",
    "run_surgery",
]
__version__ = "0.1.0"
