from lightning_hbm.strategies.fsdp_qlora import QuantizedFSDPStrategy
from lightning_hbm.strategies.fsdp_qlora import register as _register_fsdp_qlora

_register_fsdp_qlora()  # Trainer(strategy="fsdp_qlora")
from lightning_hbm.strategies.cpu_offload import CPUOffloadStrategy
from lightning_hbm.strategies.cpu_offload import register as _register_cpu_offload

_register_cpu_offload()  # Trainer(strategy="cpu_offload"), plus presets "cpu_offload_fsdp", "cpu_offload_zero2/3"
