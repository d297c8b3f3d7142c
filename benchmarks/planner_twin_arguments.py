"""The real twins' arguments read without pytree (session 36): CPU seconds of the calls of
``planner_set_up_reuse.py`` (plan() over a grid of 8 candidates, a partial-offload predict(), max_context() at two
budgets; transformers' Llama, 8 blocks of hidden 64) with :class:`~lightning_hbm.planner.realvalues.RealValues` reading
each op's arguments and outputs by pytree ("before", as before session 36) and by its own walk over aten's lists and
tuples ("after"), interleaved in one process, 3 runs each; the predictions of both arms compared field by field.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_twin_arguments.py            # all three
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_twin_arguments.py plan       # one of them
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_set_up_reuse import BATCH, GRID, LLAMA, OFFLOAD  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from lightning_hbm.activations import ActivationCheckpointing  # noqa: E402
from lightning_hbm.adapters.lora import LoRA  # noqa: E402
from lightning_hbm.planner import max_context, plan, predict, realvalues  # noqa: E402
from lightning_hbm.precision import QuantizedPrecision  # noqa: E402

AFTER = realvalues.RealValues._run_real, realvalues._leaves


def _run_real_by_pytree(self: realvalues.RealValues, func: Any, args: tuple, kwargs: dict) -> Any:
    """``RealValues._run_real`` before session 36: the arguments flattened and rebuilt by pytree."""
    real = self._real((args, kwargs))
    if real is None:
        return realvalues._FAILED
    try:
        with realvalues._disable_current_modes():
            return func(*real[0], **real[1])
    except Exception:
        return realvalues._FAILED


def _arm(arm: str) -> None:
    run_real, leaves = AFTER if arm == "after" else (_run_real_by_pytree, lambda value: tree_flatten(value)[0])
    realvalues.RealValues._run_real = run_real  # type: ignore[method-assign]
    realvalues._leaves = leaves


def _fields(predictions: list) -> list:
    """Every field of each prediction; the candidate by name (its repr holds the addresses of the callbacks
    ``max_context`` makes for each call)."""
    return [sorted((k, v.name if k == "candidate" else repr(v)) for k, v in vars(p).items()) for p in predictions]


CALLS = {
    "plan, 8 candidates": lambda: _fields(plan(LLAMA, BATCH, candidates=GRID).predictions),
    "predict, partial offload": lambda: _fields([predict(LLAMA, BATCH, OFFLOAD, device="cuda")]),
    "max_context, 2 budgets": lambda: _fields([r.prediction for r in max_context(
        LLAMA, ["64MiB", "1GiB"], plugin=QuantizedPrecision("nf4-dq"), callbacks=[LoRA(r=8), ActivationCheckpointing()],
        device="cuda")]),
}


def main(which: list[str]) -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for name, call in CALLS.items():
        if which and not any(w in name for w in which):
            continue
        times: dict[str, list[float]] = {"before": [], "after": []}
        results = {}
        for run in range(3):
            for arm in ("before", "after") if run % 2 == 0 else ("after", "before"):
                _arm(arm)
                start = time.process_time()
                results[arm] = call()
                times[arm].append(time.process_time() - start)
        _arm("after")
        before, after = times["before"], times["after"]
        print(f"{name}: before {' / '.join(f'{t:.1f}' for t in before)} s, after {' / '.join(f'{t:.1f}' for t in after)} s, "
              f"ratio {sum(after) / sum(before):.3f}, same results: {results['before'] == results['after']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
