"""The planner's set-up reuse (session 34): CPU seconds of plan() over a grid of 8 candidates, of a partial-offload
predict() and of a max_context() call, on transformers' Llama (8 blocks of hidden 64), with the reuse on ("after") and
off ("before": planner.api's ``Decided`` keeps nothing, so every trace sets its model up, as before session 34),
interleaved in one process, 3 runs each; the results of both arms compared.

    OMP_NUM_THREADS=1 python benchmarks/planner_set_up_reuse.py            # all three
    OMP_NUM_THREADS=1 python benchmarks/planner_set_up_reuse.py plan       # one of them (plan, partial, max_context)
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from functools import partial
from typing import Any, Callable

from lightning_hbm.activations import ActivationCheckpointing
from lightning_hbm.adapters.lora import LoRA
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, api, default_candidates, max_context, plan, predict, tracing
from lightning_hbm.precision import QuantizedPrecision


class _Forgets(dict):
    def __setitem__(self, key: Any, value: Any) -> None:
        pass


class _NoReuse(tracing.Decided):
    """Keeps nothing: each trace sets its model up (the planner before session 34)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_depth = _Forgets()
        self.built = _Forgets()


LLAMA = partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2)
BATCH = tuple(t.contiguous() for t in synthetic_batch(2, 64))
GRID = default_candidates(lora_ranks=[16], checkpointing=["none", "full"])  # bf16-true and nf4-dq, both optimizers
OFFLOAD = Candidate.from_trainer(QuantizedPrecision("nf4-dq"), [LoRA(r=8), ActivationCheckpointing(offload=5)], None)
CALLS: dict[str, Callable[[], Any]] = {
    "plan, 8 candidates": lambda: [p.total for p in plan(LLAMA, BATCH, candidates=GRID).predictions],
    "predict, partial offload": lambda: predict(LLAMA, BATCH, OFFLOAD, device="cuda").total,
    "max_context, 2 budgets": lambda: [r.tokens for r in max_context(
        LLAMA, ["64MiB", "1GiB"], plugin=QuantizedPrecision("nf4-dq"), callbacks=[LoRA(r=8), ActivationCheckpointing()],
        device="cuda")],
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
                api.Decided = _NoReuse if arm == "before" else tracing.Decided  # type: ignore[misc]
                start = time.process_time()
                results[arm] = call()
                times[arm].append(time.process_time() - start)
        api.Decided = tracing.Decided  # type: ignore[misc]
        before, after = times["before"], times["after"]
        print(f"{name}: before {' / '.join(f'{t:.1f}' for t in before)} s, after {' / '.join(f'{t:.1f}' for t in after)} s, "
              f"ratio {sum(after) / sum(before):.2f}, same results: {results['before'] == results['after']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
