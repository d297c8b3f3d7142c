"""Per-step cost of ``QuantizedPrecision.convert_input`` on an image batch (16x3x224x224 float32 -> bf16, issue 55):
the whole-number check at every batch (the rule before: the plugin's positions forgotten before each call) against
the check on a position's first batch only (the rule since Dec 4 2026), and Lightning's own ``bf16-true`` cast (no
check). Each rule in a process of its own, interleaved call by call with Lightning's cast there (one rule's large
temporaries slow the allocator for whatever runs next: timed side by side, the rules would measure each other),
1,500 calls each, median; the figure is the median's excess over Lightning's in the same process.

    OMP_NUM_THREADS=1 python benchmarks/convert_input_time.py
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import warnings
from typing import Callable

import torch
from lightning.pytorch.plugins.precision import HalfPrecision

from lightning_hbm import QuantizedPrecision


def run(rule: str, calls: int) -> tuple[float, float]:
    """(Lightning's median, the rule's median) in ms, interleaved call by call."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    ours, lightning = QuantizedPrecision("nf4-dq", dtype="bfloat16"), HalfPrecision("bf16-true")
    batch = {"image": torch.randn(16, 3, 224, 224), "label": torch.randint(0, 10, (16,))}

    def every_batch() -> object:
        ours.__dict__.pop("_continuous_inputs", None)
        return ours.convert_input(batch)

    arms: list[Callable[[], object]] = [lambda: lightning.convert_input(batch), every_batch if rule == "before" else lambda: ours.convert_input(batch)]
    times: list[list[float]] = [[], []]
    for _ in range(calls):
        for arm, call in enumerate(arms):
            start = time.perf_counter()
            call()
            times[arm].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[0]), statistics.median(times[1])


def main(calls: int = 1500) -> None:
    for rule, what in (("before", "check at every batch (before)"), ("now", "check on the first batch (now)")):
        done = subprocess.run([sys.executable, __file__, rule, str(calls)], capture_output=True, text=True, check=True)
        base, ms = map(float, done.stdout.split())
        print(f"{what:32s} {ms:.3f} ms, Lightning bf16-true beside it {base:.3f} ms: {ms - base:+.3f} ms a call")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(*run(sys.argv[1], int(sys.argv[2])))
    else:
        main()
