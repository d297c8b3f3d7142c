"""What the surgery engine asks a precision plugin that takes part in it: :class:`SurgeryPlugin`.

The engine (:func:`lightning_hbm.surgery.run_surgery`, the Trainer adapter, the checkpoint packing) talks to a
precision plugin through these methods only. A plugin is one of two kinds, decided by ``isinstance(plugin,
SurgeryPlugin)``:

* lightning_hbm's own (``QuantizedPrecision``, which declares the protocol as a base class): it calls the engine
  from its ``convert_module`` and ``connect``, and the engine calls it back at each point below;
* any other (Lightning's ``bf16-true``, a user's plugin): the first ``SurgeryCallback`` of the Trainer wraps its
  ``convert_module`` and ``connect`` (``lightning_hbm.surgery.install``); the engine asks it nothing else.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable  # the engine tells lightning_hbm's plugins from Lightning's by isinstance
class SurgeryPlugin(Protocol):
    """A precision plugin that runs lightning_hbm's surgery itself: what the engine calls on it, in that order.

    Methods only (no data members), so that ``isinstance`` and ``issubclass`` both work on it.
    """

    def check_model(self, module: nn.Module) -> None:
        """Raise before any change if ``module`` cannot take this plugin's conversion (the engine's checks).

        Raises:
            ValueError: the settings do not fit ``module`` (nothing is changed).
        """

    def place_on(self, device: torch.device) -> None:
        """Build the converted layers on ``device`` (the strategy's root device), from the next conversion on."""

    def convert_base(self, module: nn.Module) -> nn.Module:
        """Convert ``module``'s frozen base in place (once per model) and return it; nothing else changes."""

    def resume_config(self) -> dict[str, Any]:
        """What a resumed run must share with the run that saved the checkpoint (saved under the plugin's class
        name in the checkpoint's ``configs``; a difference is a resume error naming it)."""

    def add_checkpoint_metadata(self, meta: dict[str, Any]) -> None:
        """Add this plugin's own entries (e.g. the GPTQ CRC) to ``meta``, what every checkpoint's lightning_hbm part gets.

        Called once per surgery, after the quantization: the engine hands the entries down to resume
        (:class:`lightning_hbm.resume.Saves`), which adds them to each checkpoint it packs, after the rest.
        """


__all__ = ["SurgeryPlugin"]
