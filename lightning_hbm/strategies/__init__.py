"""Where tensors live: CPU offload of optimizer states, FSDP sharding with a quantized base.

Importing this package registers the strategies in Lightning's ``StrategyRegistry``:
``Trainer(strategy="cpu_offload")`` (plus the presets ``cpu_offload_fsdp``, ``cpu_offload_zero2``,
``cpu_offload_zero3``) and ``Trainer(strategy="fsdp_qlora")``.
"""

from lightning_hbm.strategies.cpu_offload import CPUOffloadStrategy
from lightning_hbm.strategies.cpu_offload import register as _register_cpu_offload
from lightning_hbm.strategies.fsdp_qlora import QuantizedFSDPStrategy
from lightning_hbm.strategies.fsdp_qlora import register as _register_fsdp_qlora

_register_cpu_offload()
_register_fsdp_qlora()

__all__ = ["CPUOffloadStrategy", "QuantizedFSDPStrategy"]
