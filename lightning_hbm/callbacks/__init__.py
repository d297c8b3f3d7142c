"""The callbacks' former module paths, kept importable: the code of each callback lives in the package of its job.

``lightning_hbm.callbacks.lora`` *is* :mod:`lightning_hbm.adapters.lora` (the same module object, so classes and
``isinstance`` agree), and so on for each callback's former module below. A ``config.yaml`` that LightningCLI saved
before the move names its callbacks by those paths (``class_path: lightning_hbm.callbacks.lora.LoRA``): such files
keep loading. New code imports from the package root (``from lightning_hbm import LoRA``) or from the job's package:
``adapters`` (``LoRA``), ``activations`` (``ActivationCheckpointing``, ``AttentionKernel``, ``FusedLoss``), ``optim``
(``MemoryEfficientOptimizer``), ``profiling`` (``HBMProfiler``), ``quality`` (``QuantizationQuality``). This package
defines nothing, and nothing in lightning_hbm imports it (``tests/test_layering.py``).
"""

import sys

from lightning_hbm import quality
from lightning_hbm.activations import checkpointing, loss
from lightning_hbm.activations.attention import kernel
from lightning_hbm.adapters import lora
from lightning_hbm.optim import optimizer
from lightning_hbm.profiling import profiler

# `import lightning_hbm.callbacks.lora` imports this package first, then finds its submodule here in sys.modules
FORMER_PATHS = {
    "activation_checkpointing": checkpointing,
    "attention_kernel": kernel,
    "fused_loss": loss,
    "lora": lora,
    "optimizer": optimizer,
    "profiler": profiler,
    "quality": quality,
}
for _name, _module in FORMER_PATHS.items():
    sys.modules[f"{__name__}.{_name}"] = _module
