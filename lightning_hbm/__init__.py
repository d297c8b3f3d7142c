"""lightning_hbm: make any LightningModule fit in the GPU memory (HBM) you have.

Memory is a sum: parameters + gradients + optimizer states + activations + overhead. Each part
of this package names the term it shrinks; ``HBMProfiler`` measures all of them.
"""

from lightning_hbm.precision import QuantizedPrecision, available_precisions, precision_plugin, quantize_model
from lightning_hbm.surgery import ModelSurgery, Stage, SurgeryCallback, applied_transforms

__all__ = [
    "ModelSurgery",
    "QuantizedPrecision",
    "Stage",
    "SurgeryCallback",
    "applied_transforms",
    "available_precisions",
    "precision_plugin",
    "quantize_model",
]
__version__ = "0.1.0"
