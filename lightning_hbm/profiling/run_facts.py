"""What a Trainer run applied, as the :class:`~lightning_hbm.memory.facts.RunFacts` the memory report advises from.

The memory package (level 0) defines the record and cannot see the callbacks; this module, beside them, fills it:
the quantized base from the model's own layers (its bits per weight measured on the model) named by the
``QuantizedPrecision`` plugin's mode, the features from the Trainer's callbacks by type, the optimizers from the
Trainer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import lightning.pytorch as pl
import torch

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.activations import ActivationCheckpointing, FusedLoss
from lightning_hbm.adapters import LoRA
from lightning_hbm.memory.facts import RunFacts, quantized_base
from lightning_hbm.precision import QuantizedPrecision

#: Optimizers whose states are already compact: bitsandbytes and torchao name their low-bit optimizers by the
#: states' bits (``AdamW8bit``, ``AdamW4bit``); ``CPUOffload`` ones hold them in host memory.
_COMPACT_STATES = re.compile(r"8bit|4bit|CPUOffload")


def run_facts(trainer: pl.Trainer, pl_module: pl.LightningModule) -> RunFacts:
    """The facts of ``trainer``'s run of ``pl_module``, read once the surgery has run (at ``on_train_start``).

    Args:
        trainer: the Trainer (its precision plugin, callbacks and optimizers).
        pl_module: the model as trained (its quantized layers).
    """
    precision, bits = quantized_base(pl_module)
    plugin = trainer.precision_plugin
    if bits is not None and isinstance(plugin, QuantizedPrecision):  # the mode as configured: nf4-dq, not its layer class's nf4
        precision = plugin.mode.name
    optimizers = optimizer_names(trainer.optimizers)
    callbacks = trainer.callbacks  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
    return RunFacts(
        precision=precision,
        bits_per_weight=bits,
        lora=any(isinstance(cb, LoRA) for cb in callbacks),
        checkpointing=any(isinstance(cb, ActivationCheckpointing) for cb in callbacks),
        fused_loss=any(isinstance(cb, FusedLoss) for cb in callbacks),
        optimizers=optimizers,
        compact_states=any(_COMPACT_STATES.search(name) for name in optimizers),
    )


def optimizer_names(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[str, ...]:
    """Class names of the real optimizers under Lightning's wrappers."""
    return tuple(type(lightning_compat.unwrap_optimizer(opt)).__name__ for opt in optimizers)


__all__ = ["optimizer_names", "run_facts"]
