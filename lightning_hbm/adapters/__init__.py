"""The **gradients** and **optimizer states** terms shrunk by training adapters on a frozen base.

``lora/``: :class:`LoRA` (peft's LoRA layers injected at the surgery point, their forward, export and merge).
"""

from lightning_hbm.adapters.lora import LoRA

__all__ = ["LoRA"]
