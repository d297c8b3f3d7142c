"""The planner's probe step shared by the candidates of a plan (session 35): CPU seconds of plan() over the grid of 8
candidates of ``planner_set_up_reuse.py`` (bf16-true and nf4-dq, with and without full recompute, both optimizers;
transformers' Llama, 8 blocks of hidden 64, cut to 3 and 4), with the surgery's probe step shared between the set-ups
of one cut model ("after") and not ("before": each set-up runs its own, as before session 35), interleaved in one
process, 3 runs each; the probe steps counted and the predictions of both arms compared.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/planner_probe_sharing.py
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_set_up_reuse import BATCH, GRID, LLAMA  # noqa: E402

from lightning_hbm.layers import readers  # noqa: E402
from lightning_hbm.planner import api, plan  # noqa: E402
from lightning_hbm.planner.candidates import Candidate  # noqa: E402
from lightning_hbm.planner.tracing import Decided  # noqa: E402


class _Forgets(dict):
    def __setitem__(self, key: Any, value: Any) -> None:
        pass


SET_UPS_FOR = api._set_ups_for


def _unshared(candidate: Candidate, last: tuple[Optional[Candidate], Decided], probes: dict) -> Any:
    return SET_UPS_FOR(candidate, last, _Forgets())


def main() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    observe, count = readers.observe, [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return observe(*args, **kwargs)

    readers.observe = counted
    times: dict[str, list[float]] = {"before": [], "after": []}
    steps: dict[str, int] = {}
    results = {}
    for run in range(3):
        for arm in ("before", "after") if run % 2 == 0 else ("after", "before"):
            api._set_ups_for = _unshared if arm == "before" else SET_UPS_FOR  # type: ignore[assignment]
            count[0] = 0
            start = time.process_time()
            results[arm] = plan(LLAMA, BATCH, candidates=GRID).predictions
            times[arm].append(time.process_time() - start)
            steps[arm] = count[0]
    api._set_ups_for = SET_UPS_FOR
    before, after = times["before"], times["after"]
    print(f"plan, 8 candidates: before {' / '.join(f'{t:.1f}' for t in before)} s ({steps['before']} probe steps), "
          f"after {' / '.join(f'{t:.1f}' for t in after)} s ({steps['after']} probe steps), "
          f"ratio {sum(after) / sum(before):.3f}, same results: {results['before'] == results['after']}", flush=True)


if __name__ == "__main__":
    main()
