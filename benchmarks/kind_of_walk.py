"""CPU time of one ``kind_of`` walk over every module of the real SmolLM2-135M (session 34).

``kind_of`` runs on every module of each walk of the model (~14,000 calls in one surgery of the default recipe).
Run it on two checkouts in turn on the same machine to compare:

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/kind_of_walk.py
"""

from __future__ import annotations

import time

from lightning_hbm.layers.kinds import kind_of
from lightning_hbm.pretrained import smollm2_path


def main() -> None:
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2-135M is not installed: see lightning_hbm.pretrained.INSTALL")
    modules = list(AutoModelForCausalLM.from_pretrained(str(path)).modules())
    kind_of(modules[0])  # first calls: imports
    rounds = []
    for _ in range(5):
        start = time.process_time()
        for _ in range(10):
            for module in modules:
                kind_of(module)
        rounds.append((time.process_time() - start) / 10 * 1000)
    print(f"kind_of over {len(modules)} modules: {min(rounds):.2f} ms (best of 5 rounds of 10 walks)")


if __name__ == "__main__":
    main()
