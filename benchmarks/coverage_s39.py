"""Coverage round four (session 39, issue 53): decoders, vision-language, audio-language, vision and time-series models
nobody here tried (families in ``tests/families_s39.py``), through the library's default recipe.

The same measurement as ``benchmarks/coverage_s38.py`` (whose functions it runs on these families): ``QuantizedPrecision()``
(nf4-dq, bf16 compute) + ``LoRA(r=8)`` + ``ActivationCheckpointing()`` (+ ``FusedLoss`` where the model has a causal
LM head), 2 steps in a real Trainer with a checkpoint after step 1; trains, resumes bit-exact, the layers kept wide with
the coverage table's reasons, ``plan()`` against torch's MemTracker peak of one real step.

Command: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/coverage_s39.py [--hooks-off] [name ...]`` (each family in
its own process). Prints one JSON line per family and a markdown table at the end. ``--hooks-off``: MemTracker without
its module hooks (``memtracker_peak(module_hooks=False)``), which keep alive the graph of a module whose output never
reaches the loss (Siglip2's attention-pooling head under a mean-pooling classifier).

A mixture of experts (``STEADY``) is measured at the steady state of a long run: one step on each of two batches of 16
sequences (every expert routed, so Adam has every expert's states, as the plan counts them), then one on the planned
batch (session 40: FlexOlmo's one-batch step left expert 0 of layer 1 unrouted, +3.88 %; at the steady state +0.31 %,
``tests/planner/test_plan_misses_s40.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import families_s39  # noqa: E402

_spec = importlib.util.spec_from_file_location("coverage_s38", Path(__file__).with_name("coverage_s38.py"))
assert _spec is not None and _spec.loader is not None
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
base.FAMILIES, base.Task = families_s39.FAMILIES, families_s39.Task  # the same measurement on this round's families


STEADY = {"qwen3_next", "glm4_moe", "dots1", "hunyuan_moe", "minimax", "granitemoehybrid", "flex_olmo", "lfm2_moe"}  # mixtures of experts


def warm_up(name: str) -> list[Any]:
    """The batches of the steps before the measured one: two of 16 sequences, then the planned batch."""
    import torch

    return [*(torch.cat([families_s39.tokens(100 + 8 * j + k) for k in range(8)]) for j in range(2)), families_s39.FAMILIES[name].batch(1)]


def main() -> None:
    from lightning_hbm.planner import reference

    if os.environ.get("COVERAGE_S39_HOOKS_OFF"):
        reference.memtracker_peak = functools.partial(reference.memtracker_peak, module_hooks=False)  # type: ignore[assignment]
    if len(sys.argv) > 2 and sys.argv[1] == "--one" and sys.argv[2] in STEADY:
        reference.memtracker_peak = functools.partial(reference.memtracker_peak, first_batches=warm_up(sys.argv[2]))  # type: ignore[assignment]
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(base.run_one(sys.argv[2])), flush=True)
        return
    hooks_off = "--hooks-off" in sys.argv
    names = [n for n in sys.argv[1:] if n != "--hooks-off"] or list(families_s39.FAMILIES)
    results = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **({"COVERAGE_S39_HOOKS_OFF": "1"} if hooks_off else {}))
    for name in names:
        model = families_s39.FAMILIES[name].model
        try:
            run = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True, timeout=900)
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"name": name, "model": model, "train_error": f"exit {run.returncode}: {run.stderr[-400:]}"}
        except subprocess.TimeoutExpired:
            result = {"name": name, "model": model, "train_error": "over 900 s"}
        print(json.dumps(result), flush=True)
        results.append(result)
    print(base.table(results))


if __name__ == "__main__":
    main()
