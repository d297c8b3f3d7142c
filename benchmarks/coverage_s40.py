"""Coverage round five (session 40, issue 53): the six vision-language models session 39 did not reach (Mllama, Aria,
LLaVA-NeXT, Janus, Emu3, Chameleon; families in ``tests/families_s40.py``), through the library's default recipe.

Session 39's measurement (``benchmarks/coverage_s39.py``, itself ``benchmarks/coverage_s38.py``'s functions) run on
these families: ``QuantizedPrecision()`` (nf4-dq, bf16 compute) + ``LoRA(r=8)`` + ``ActivationCheckpointing()`` +
``FusedLoss``, 2 steps in a real Trainer with a checkpoint after step 1; trains, resumes bit-exact, the layers kept wide
with the coverage table's reasons, ``plan()`` against torch's MemTracker peak of one real step.

Command: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/coverage_s40.py [--hooks-off] [name ...]`` (each family in
its own process). Prints one JSON line per family and a markdown table at the end.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import families_s40  # noqa: E402

_spec = importlib.util.spec_from_file_location("coverage_s39", Path(__file__).with_name("coverage_s39.py"))
assert _spec is not None and _spec.loader is not None
s39 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s39)
s39.base.FAMILIES, s39.base.Task = families_s40.FAMILIES, families_s40.Task  # the same measurement on this round's families
s39.families_s39 = families_s40  # the families its main() lists
s39.__file__ = __file__  # and the script each family's process runs: this one

if __name__ == "__main__":
    s39.main()
