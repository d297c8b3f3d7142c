"""What the RNG snapshots of ``ActivationCheckpointing(regenerate=n)`` cost in a step, against ``regenerate`` off.

Under ``regenerate=n`` a checkpointed block records its forward (:class:`lightning_hbm.activations.regenerate.Record`)
with the global RNG states it starts from (Python's, NumPy's, torch's CPU and CUDA ones), so that the remake of its
output in the backward draws dropout's masks as the forward did; each remake also puts the states back after it.
A fp32 transformers Llama from its config (hidden 256, intermediate 688, 4 blocks, batch 2 x 512 tokens, no
dropout), full recompute; forward + backward steps of each setting interleaved in one process, one thread, the median
of each after the first. The time spent in the snapshots (``rng_states`` / ``set_rng_states``) inside the steps is
measured by timing those calls (a timing wrapper around the real functions: the same work done).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/regenerate_rng_cost.py [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy  # noqa: F401  (imported by transformers anyway: its state is part of every snapshot)
import torch

from lightning_hbm import ActivationCheckpointing
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM

SPENT = {"calls": 0, "seconds": 0.0}


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            SPENT["calls"] += 1
            SPENT["seconds"] += time.perf_counter() - start

    return wrapper


def model(regenerate: int) -> LlamaLM:
    torch.manual_seed(0)
    built = LlamaLM(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(built)
    return built


def main(steps: int) -> None:
    torch.set_num_threads(1)
    # the module's functions, looked up at each call by Record, remake and preserved_rngs
    torch_compat.rng_states = _timed(torch_compat.rng_states)  # type: ignore[method-assign]
    torch_compat.set_rng_states = _timed(torch_compat.set_rng_states)  # type: ignore[method-assign]
    x, y = synthetic_batch(2, 512, vocab_size=2048)
    models = {n: model(n) for n in (1, 2)}
    times: dict[int, list[float]] = {n: [] for n in models}
    spent: dict[int, list[tuple[int, float]]] = {n: [] for n in models}
    for _ in range(steps):
        for n, built in models.items():
            SPENT.update(calls=0, seconds=0.0)
            start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(built(x).flatten(0, 1), y.flatten())
            loss.backward()
            times[n].append(time.perf_counter() - start)
            spent[n].append((int(SPENT["calls"]), float(SPENT["seconds"])))
            built.zero_grad(set_to_none=True)
    base = statistics.median(times[1][1:])
    for n, measured in times.items():
        median = statistics.median(measured[1:])
        calls = spent[n][-1][0]
        snapshot = statistics.median(s for _, s in spent[n][1:])
        least = min(s for _, s in spent[n][1:])
        print(f"regenerate={n}: median step {median * 1000:.1f} ms ({median / base:.3f}x), {steps - 1} steps after the "
              f"first; RNG state calls {calls} a step, {snapshot * 1e3:.3f} ms a step (median; least {least * 1e3:.3f}"
              f" ms), {snapshot / median:.2%} of the step")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    main(parser.parse_args().steps)
