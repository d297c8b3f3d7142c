"""lightning_hbm: make any LightningModule fit in the GPU memory (HBM) you have.

Memory is a sum: parameters + gradients + optimizer states + activations + overhead. Each part
of this package names the term it shrinks; ``HBMProfiler`` measures all of them.
"""

import lightning_hbm.quiet  # noqa: F401  (first: filters library noise before peft/torchao are imported)
from lightning_hbm.precision import QuantizedPrecision, available_precisions, precision_plugin, quantize_model
from lightning_hbm.resume import CheckedCheckpointIO
from lightning_hbm.surgery import Stage, SurgeryCallback, applied_transforms, run_surgery
from lightning_hbm.strategies import QuantizedFSDPStrategy
from lightning_hbm.callbacks.activation_checkpointing import ActivationCheckpointing
from lightning_hbm.callbacks.attention_kernel import AttentionKernel
from lightning_hbm.callbacks.lora import LoRA
from lightning_hbm.callbacks.optimizer import MemoryEfficientOptimizer
from lightning_hbm.strategies.cpu_offload import CPUOffloadStrategy
from lightning_hbm.callbacks.profiler import HBMProfiler
from lightning_hbm.callbacks.quality import QuantizationQuality
from lightning_hbm.precision.int8_dynamic import Int8DynamicLinear
from lightning_hbm.planner import plan
from lightning_hbm.planner.autofit import AutoFit
from lightning_hbm.callbacks.fused_loss import FusedLoss

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
    "plan",
    "precision_plugin",
    "quantize_model",
    "run_surgery",
]
__version__ = "0.1.0"
