"""``LoRA``: train small adapters on a frozen (optionally quantized) base, on any LightningModule.

What it shrinks: the **gradients** and **optimizer states** terms (and the checkpoint). Only the
LoRA matrices (and the ``modules_to_save``) require grad, so the user's unchanged
``AdamW(self.parameters())`` ends up holding states for them only (the surgery spine prunes the
frozen parameters from the param groups). On top of :class:`~lightning_hbm.QuantizedPrecision`
this is QLoRA: the base is 4-bit and frozen, the adapters stay in ``adapter_dtype``.

The adapters are peft's own LoRA layers, injected with ``peft.inject_adapter_in_model`` into the
LightningModule itself (plain torch models and Hugging Face models inside it alike), at
lightning_hbm's surgery point (:mod:`lightning_hbm.surgery`): after ``configure_model`` and the
quantization, before ``configure_optimizers`` and activation checkpointing.

The package, one job per module: ``base`` (peft import, the adapted layers, the trained weights), ``config``
(``LoRAConfig``: the settings, checked and frozen, as peft's ``LoraConfig``), ``targets`` (``select``: the layers
adapted and trained in full, checked), ``callback`` (``LoRA``: the friendly face, injection), ``checks`` (what it refuses before any
change), ``notices`` (the layers and heads it names at fit start), ``export``
(``save_adapter``: peft's format), ``folder`` (the adapter folder written as a unit), ``quantized_base`` (the quantized base an adapter exported with
its corrections fits: recorded, ``check_quantized_base``), ``merge`` (a plain merged
state_dict), ``watch`` (dead adapters).
"""

from lightning_hbm.adapters.lora.base import _PEFT_AVAILABLE, ADAPTER_NAME, ALL_LINEAR, _import_peft
from lightning_hbm.adapters.lora.callback import LoRA
from lightning_hbm.adapters.lora.config import LoRAConfig

__all__ = ["LoRA", "LoRAConfig"]
