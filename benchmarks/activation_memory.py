"""Activation bytes and step time of ActivationCheckpointing policies on the test LM.

For each setup (none / selective / full / full+offload) the same NanoGPT (random weights) runs
forward + backward on one random batch:

* ``saved MiB``: bytes the forward keeps alive for backward, measured by the profiler's
  :func:`lightning_hbm.memory.activations.saved_activation_bytes` (exact live storage, any device);
* ``device MiB``: of those, what stays on the model's device: ``saved`` minus what the offload
  hooks copied away (on CPU the offload copy lands in the same memory, so this is what would stay
  in HBM, not a saving on the CPU run itself);
* ``peak HBM MiB`` (CUDA only): ``torch.cuda.max_memory_allocated`` over forward + backward minus
  what was allocated before the step (parameters): activations, gradients and temporaries;
* ``time``: median forward + backward time relative to ``none``, all setups in one process.

    python benchmarks/activation_memory.py                         # CPU, n_layer 4, n_embd 128, seq 256
    python benchmarks/activation_memory.py --device cuda --seq 2048 --batch 8 --n-embd 768 --n-layer 12
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

import torch

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory.activations import saved_activation_bytes
from lightning_hbm.models import NanoGPT

MiB = 2**20
SETUPS: dict[str, Optional[dict[str, Any]]] = {
    "none": None,
    "selective": dict(policy="selective"),
    "full": dict(policy="full"),
    "full+offload": dict(policy="full", offload=True),
}


def build(args: argparse.Namespace, setup: str) -> tuple[NanoGPT, Optional[ActivationCheckpointing]]:
    torch.manual_seed(0)
    model = NanoGPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq).to(args.device)
    kwargs = SETUPS[setup]
    callback = ActivationCheckpointing(**kwargs) if kwargs is not None else None
    if callback is not None:
        callback.transform_model(model)
    return model, callback


def step(model: NanoGPT, batch: Any) -> None:
    model.zero_grad(set_to_none=True)
    model.loss(batch).backward()
    if batch[0].is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per setup (after one warm-up)")
    args = parser.parse_args()
    cuda = torch.device(args.device).type == "cuda"
    batch = tuple(t.to(args.device) for t in synthetic_batch(args.batch, args.seq, seed=0))

    rows = {}
    for setup in SETUPS:
        model, callback = build(args, setup)
        offload = callback.offload if callback is not None else None
        if offload is not None:
            offload.reset_counts()
        saved = saved_activation_bytes(lambda: model.loss(batch), model)  # noqa: B023 - called at once, in this iteration
        offloaded = offload.copied_bytes if offload is not None else 0
        peak = None
        if cuda:
            step(model, batch)  # warm-up: gradients allocated, kernels chosen
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(model, batch)
            peak = torch.cuda.max_memory_allocated() - base
        rows[setup] = dict(model=model, saved=saved, device=saved - offloaded, peak=peak)

    # Time: interleave the setups round by round, so that machine load hits all of them alike.
    times: dict[str, list[float]] = {s: [] for s in SETUPS}
    for setup in SETUPS:
        step(rows[setup]["model"], batch)  # warm-up
    for _ in range(args.repeats):
        for setup in SETUPS:
            start = time.perf_counter()
            step(rows[setup]["model"], batch)
            times[setup].append(time.perf_counter() - start)
    base_time = statistics.median(times["none"])
    base_saved = rows["none"]["saved"]

    print(
        f"NanoGPT n_layer={args.n_layer} n_embd={args.n_embd} n_head={args.n_head}, batch {args.batch} x seq {args.seq}, "
        f"{args.device}, torch {torch.__version__}"
    )
    header = f"{'setup':<14}{'saved MiB':>11}{'vs none':>9}{'device MiB':>12}{'vs none':>9}{'time vs none':>14}"
    if cuda:
        header += f"{'peak HBM MiB':>14}"
    print(header)
    for setup, row in rows.items():
        line = (
            f"{setup:<14}{row['saved'] / MiB:>11.2f}{row['saved'] / base_saved:>9.2f}{row['device'] / MiB:>12.2f}"
            f"{row['device'] / base_saved:>9.2f}{statistics.median(times[setup]) / base_time:>13.2f}x"
        )
        if cuda:
            line += f"{row['peak'] / MiB:>14.1f}"
        print(line)


if __name__ == "__main__":
    main()
