"""Every memory term measured: :class:`HBMProfiler` (``profiler``: the Lightning callback, a thin adapter) over
:class:`MemoryProfile` (``memory_profile``: which steps are measured, their rows and metrics, the CSV, report and figure
files; usable without a Trainer) over ``steps`` (``StepMemory``: one step measured, term by term, and the rows kept), ``timeline`` (``StepRecorder``: one step's storages over its ops), ``figure`` (the step's terms
over its ops, built, drawn and redrawn: ``lightning-hbm figure``) and ``run_facts`` (what the run was set up with,
for the report)."""

from lightning_hbm.profiling.memory_profile import MemoryProfile
from lightning_hbm.profiling.profiler import HBMProfiler

__all__ = ["HBMProfiler", "MemoryProfile"]
