"""Optimizer-state memory: bytes per trainable parameter per optimizer kind, and the offload step-time ratio.

    python benchmarks/optimizer_memory.py                 # CPU (or CUDA when available)
    python benchmarks/optimizer_memory.py --device cuda   # adds peak HBM with/without CPUOffloadStrategy's optimizer

1. State bytes: one optimizer step on a NanoGPT, then the exact storage bytes of every tensor in
   ``optimizer.state`` (bitsandbytes' shared code books counted once), for torch AdamW and every
   ``MemoryEfficientOptimizer`` kind.
2. Offload: time per training step (forward + backward + step) with the user's AdamW vs the same
   AdamW offloaded by :class:`~lightning_hbm.strategies.cpu_offload.OffloadedOptimizer` (torchao
   engine on CUDA, lightning_hbm's own engine elsewhere), as a ratio of two runs in this process.
   Prints the state bytes on the training device (``optimizer.state``) and what the offloading optimizer
   holds in host memory (:func:`~lightning_hbm.strategies.cpu_offload.host_offload_bytes`: master copies,
   gradient buffers, states). On CUDA it also prints ``torch.cuda.max_memory_allocated`` for both.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import torch

from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory.storage import optimizer_state_bytes
from lightning_hbm.models import NanoGPT
from lightning_hbm.optim import OPTIMIZER_KINDS, MemoryEfficientOptimizer
from lightning_hbm.strategies.cpu_offload import OffloadedOptimizer, host_offload_bytes

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")


def make_model(device: torch.device, n_embd: int, n_layer: int) -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=128).to(device)


def train_step(model: NanoGPT, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    def closure() -> torch.Tensor:
        loss = model.loss(batch)
        loss.backward()
        return loss

    optimizer.step(closure)
    optimizer.zero_grad(set_to_none=True)


def state_bytes_table(device: torch.device, n_embd: int, n_layer: int) -> None:
    batch = tuple(t.to(device) for t in synthetic_batch(2, 64))
    print(f"{'optimizer':<18}{'state bytes':>14}{'B/param':>10}{'vs AdamW':>10}")
    base = None
    for kind in ["torch AdamW", *OPTIMIZER_KINDS]:
        model = make_model(device, n_embd, n_layer)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if kind != "torch AdamW":
            (optimizer,) = MemoryEfficientOptimizer(kind).transform_optimizers([optimizer], [])  # type: ignore[arg-type]
        train_step(model, optimizer, batch)
        n_params = sum(p.numel() for p in model.parameters())
        nbytes = optimizer_state_bytes(optimizer)
        base = base or nbytes
        print(f"{kind:<18}{nbytes:>14,}{nbytes / n_params:>10.3f}{nbytes / base:>10.3f}")
    print(f"(NanoGPT n_embd={n_embd} n_layer={n_layer}: {n_params:,} trainable parameters, device {device})")


def offload_ratio(device: torch.device, n_embd: int, n_layer: int, steps: int) -> None:
    """Median step time of both runs, measured alternately so that load on a shared machine hits both alike."""
    batch = tuple(t.to(device) for t in synthetic_batch(4, 128))
    runs = {}
    for name in ("plain", "offload"):
        model = make_model(device, n_embd, n_layer)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == "offload":
            optimizer = OffloadedOptimizer(optimizer, "cpu", use_torchao=device.type == "cuda")
        runs[name] = (model, optimizer)
    peaks: dict[str, int] = {}
    if device.type == "cuda":  # peak HBM of each run alone: one warm-up step after a reset
        for name, (model, optimizer) in runs.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            train_step(model, optimizer, batch)
            train_step(model, optimizer, batch)
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - baseline
    times: dict[str, list[float]] = {name: [] for name in runs}
    for model, optimizer in runs.values():
        train_step(model, optimizer, batch)  # warm-up: allocations, kernel selection
    for _ in range(steps):
        for name, (model, optimizer) in runs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            train_step(model, optimizer, batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, (_model, optimizer) in runs.items():
        engine = getattr(optimizer, "engine", "-")
        peak = f"  step peak above weights {peaks[name]:,} B" if name in peaks else ""
        print(
            f"{name:<8} {median[name] * 1e3:8.1f} ms/step (median of {steps})  state on device "
            f"{optimizer_state_bytes(optimizer):>12,} B  host (masters + gradient buffers + states) "
            f"{host_offload_bytes(optimizer):>12,} B  engine {engine}{peak}"
        )
    print(f"offload step-time ratio (offload / plain): {median['offload'] / median['plain']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    state_bytes_table(device, args.n_embd, args.n_layer)
    print()
    offload_ratio(device, args.n_embd, args.n_layer, args.steps)


if __name__ == "__main__":
    main()
