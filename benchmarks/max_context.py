"""The longest context per GiB: ``lightning_hbm.planner.max_context`` on the Llama-3.1-8B and Llama-3.3-70B shapes.

QLoRA as users quote it: NF4 + double quant base (``QuantizedPrecision("nf4-dq")``, bf16 compute), LoRA r=32 on the
seven projections (q, k, v, o, gate, up, down; fp32 adapters), 8-bit AdamW states (Unsloth's notebooks use
``adamw_8bit``), batch 1. ``max_context`` adds what trades time for memory: full recompute, the block inputs offloaded
to pinned host memory (CUDA), the MLP recomputed in token chunks, the fused loss. Predictions of the planner on this
CPU machine (fake tensors, nothing allocated), with the CUDA context it counts; not GPU measurements
(``benchmarks/gpu_checks.sh`` trains at one predicted length on a real device).

    python benchmarks/max_context.py                     # 8B at 8..80 GiB, 70B at 48 and 80 GiB: the README table
    python benchmarks/max_context.py --shape 8b --budgets 24
    python benchmarks/max_context.py --shape 8b --host-budget 64   # a machine with 64 GiB of RAM for the offload
    python benchmarks/max_context.py --shape 8b --host-budget 64 --max-regenerate 4  # and block inputs remade
    python benchmarks/max_context.py --gpu-check         # CUDA: train 2 steps at the predicted 8B length for the device
    python benchmarks/max_context.py --offload-cost      # CUDA: step time with and without the activation offload

Published figures beside ours (Unsloth's docs, "Llama-3.1 8B/3.3 70B max context", QLoRA r=32 on all 7 projections,
batch 1; HF + FlashAttention-2 from the same table). Their budgets are the cards' GB, ours GiB as the table says.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner import LLAMA_8B  # noqa: E402  (benchmarks/planner.py: the 8B shape)

from lightning_hbm import LoRA, MemoryEfficientOptimizer, QuantizedPrecision  # noqa: E402
from lightning_hbm.models import LlamaLM  # noqa: E402
from lightning_hbm.planner import format_bytes, max_context  # noqa: E402

LLAMA_8B_LONG = {**LLAMA_8B, "max_position_embeddings": 131072}
LLAMA_70B = dict(
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_position_embeddings=131072,
)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# budget (GB of the card) -> (Unsloth, HF + FA2) published maximum context, tokens; None: out of memory
UNSLOTH_8B = {8: (2972, None), 12: (21848, 932), 16: (40724, 2551), 24: (78475, 5789), 40: (153977, 12264),
              48: (191728, 15502), 80: (342733, 28454)}  # fmt: skip
UNSLOTH_70B = {48: (12106, None), 80: (89389, None)}
SHAPES = {"8b": (LLAMA_8B_LONG, UNSLOTH_8B), "70b": (LLAMA_70B, UNSLOTH_70B)}


def plugin() -> QuantizedPrecision:
    """NF4 + double quant; the embedding and the head quantized too (issue 51, item 1; FusedLoss unpacks the head a
    vocabulary slice at a time), as the README's table was planned (Dec 4 2026)."""
    return QuantizedPrecision("nf4-dq", dtype="bfloat16", quantize_embeddings=True, quantize_head=True)


def callbacks() -> list:
    return [LoRA(r=32, alpha=64.0, target_modules=PROJECTIONS), MemoryEfficientOptimizer(kind="adamw8bit")]


def table(shape: str, budgets: list[int], host_budget: Optional[int] = None, max_regenerate: int = 1) -> None:
    config, published = SHAPES[shape]
    start, cpu = time.perf_counter(), time.process_time()
    results = max_context(partial(LlamaLM, **config), [f"{b}GiB" for b in budgets], plugin=plugin(), callbacks=callbacks(),
                          host_budget=None if host_budget is None else f"{host_budget}GiB", max_regenerate=max_regenerate)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    options = plugin()
    host = "" if host_budget is None else f"; host RAM at most {host_budget} GiB"
    print(f"\n{shape}: {options.name}, LoRA r=32 x 7 projections, adamw8bit, batch 1{host}; choices {results[0].choices}; "
          f"{len(budgets)} budgets in {seconds:.0f} s ({cpu:.0f} s of CPU)")
    print("| budget | ours: longest context | host RAM (pinned) | device total | x Unsloth | Unsloth | HF + FA2 | what holds it |")
    print("|---|---|---|---|---|---|---|---|")
    for gib, result in zip(budgets, results):
        unsloth, hf = published.get(gib, (None, None))
        ratio = f"{result.tokens / unsloth:.2f}x" if unsloth else "-"
        offload = "" if result.choices["offload"] else " (no offload)"
        offload += f" (regenerate={result.choices['regenerate']})" if result.choices["regenerate"] > 1 else ""
        print(f"| {gib} GiB | {result.tokens:,}{offload} | {format_bytes(result.host)} | {format_bytes(result.prediction.total)} "
              f"| {ratio} | {unsloth and f'{unsloth:,}' or '-'} | {hf and f'{hf:,}' or 'OOM'} | {result.limit} |", flush=True)


def offload_cost(tokens: int = 8192, steps: int = 4) -> None:
    """CUDA: step time and max_memory_allocated of the ~1B shape (benchmarks/planner.py) with and without
    ``ActivationCheckpointing(offload=True)`` (side-stream copies, backward prefetch), same length, QLoRA."""
    import lightning.pytorch as pl
    from planner import LLAMA_1B
    from torch.utils.data import DataLoader

    from lightning_hbm import ActivationCheckpointing, FusedLoss
    from lightning_hbm.data import synthetic_batch

    batch = synthetic_batch(1, tokens, vocab_size=LLAMA_1B["vocab_size"])
    for offload in (False, True):
        cbs = [*callbacks(), ActivationCheckpointing("full", offload=offload, mlp_chunks=4), FusedLoss()]
        trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, plugins=[plugin()], callbacks=cbs)
        with torch.device("cuda"):
            model = LlamaLM(**{**LLAMA_1B, "max_position_embeddings": tokens})
        times: list[float] = []

        class _Clock(pl.Callback):
            def on_train_batch_start(self, *args: object) -> None:
                torch.cuda.synchronize()
                self.start = time.perf_counter()

            def on_train_batch_end(self, *args: object) -> None:
                torch.cuda.synchronize()
                times.append(time.perf_counter() - self.start)  # noqa: B023 - this iteration's fit is the only one that calls it

        trainer.callbacks.append(_Clock())  # type: ignore[attr-defined]  # Lightning's list of callbacks
        torch.cuda.reset_peak_memory_stats()
        trainer.fit(model, DataLoader([tuple(t[0] for t in batch)] * steps, batch_size=1))
        steady = sorted(times[1:])[len(times[1:]) // 2]
        print(f"offload={offload}: median step {steady * 1000:.0f} ms, max_memory_allocated "
              f"{format_bytes(torch.cuda.max_memory_allocated())} ({tokens:,} tokens, ~1B QLoRA)", flush=True)
        del trainer, model
        torch.cuda.empty_cache()


def gpu_check(budget_gib: Optional[float] = None) -> None:
    """Train 2 steps of the 8B shape (random weights) at the length predicted for ``budget_gib`` (default: 90 % of this
    device's free memory) and 70 %
    of the host's free RAM (the pinned block inputs), and compare the pinned bytes torch's host allocator handed out
    (its own count, ``torch.cuda.host_memory_stats``) with the planned host bytes (the pieces: not yet run on GPU)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hbm import ActivationCheckpointing, FusedLoss
    from lightning_hbm.data import synthetic_batch

    if not torch.cuda.is_available():
        sys.exit("--gpu-check needs a CUDA device")
    free, _ = torch.cuda.mem_get_info()
    budget = int(free * 0.9) if budget_gib is None else int(budget_gib * 2**30)
    host = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") * 0.7)
    result = max_context(partial(LlamaLM, **LLAMA_8B_LONG), budget, plugin=plugin(), callbacks=callbacks(), host_budget=host)
    print(f"predicted for {format_bytes(budget)}: {result}")
    tokens, choices = result.tokens, result.choices
    cbs = [*callbacks(), ActivationCheckpointing("full", offload=choices["offload"], mlp_chunks=choices["mlp_chunks"]), FusedLoss()]
    trainer = pl.Trainer(accelerator="cuda", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, plugins=[plugin()], callbacks=cbs)
    with torch.device("cuda"):
        model = LlamaLM(**LLAMA_8B_LONG)
    batch = synthetic_batch(1, tokens, vocab_size=LLAMA_8B["vocab_size"])
    steps: list[tuple[float, int]] = []

    class _StepPeak(pl.Callback):
        # each step's own peak: the fp32 model built on the device before the fit is not the step's
        def on_train_batch_start(self, *args: object) -> None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: object) -> None:
            torch.cuda.synchronize()
            steps.append((time.perf_counter() - self.start, torch.cuda.max_memory_allocated()))

    trainer.callbacks.append(_StepPeak())  # type: ignore[attr-defined]  # Lightning's list of callbacks
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(model, DataLoader([tuple(t[0] for t in batch)] * 2, batch_size=1))
    print(f"trained 2 steps at {tokens:,} tokens in {time.perf_counter() - start:.0f} s: max_memory_allocated "
          f"{format_bytes(torch.cuda.max_memory_allocated())}, predicted peak {format_bytes(result.prediction.peak)}")
    for i, (seconds, peak) in enumerate(steps):
        print(f"step {i}: {seconds:.1f} s, step peak (max_memory_allocated) {format_bytes(peak)} = {peak:,} B; predicted "
              f"{result.prediction.peak:,} B ({100 * (result.prediction.peak / peak - 1):+.2f} %), budget {budget:,} B")
    print(f"prediction terms: {result.prediction.terms if hasattr(result.prediction, 'terms') else ''}")
    pinned = torch.cuda.host_memory_stats().get("active_bytes.peak", 0)
    print(f"pinned (host allocator's active_bytes.peak) {format_bytes(pinned)}, planned host {format_bytes(result.host)} "
          f"(host budget {format_bytes(host)})")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # each plan's length and total
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default=None, help="one shape (default: both)")
    parser.add_argument("--budgets", nargs="*", type=int, default=None, help="GiB (default: the published sizes)")
    parser.add_argument("--host-budget", type=int, default=None, help="GiB of host RAM the offload may pin")
    parser.add_argument("--max-regenerate", type=int, default=1,
                        help="with --host-budget: the most blocks per kept input max_context may choose (the others remade)")
    parser.add_argument("--gpu-check", action="store_true")
    parser.add_argument("--gpu-budget", type=float, default=None, help="GiB for --gpu-check (default: 90 %% of free)")
    parser.add_argument("--offload-cost", action="store_true")
    args = parser.parse_args()
    if args.offload_cost:
        offload_cost()
    elif args.gpu_check:
        gpu_check(args.gpu_budget)
    else:
        for shape in [args.shape] if args.shape else list(SHAPES):
            table(shape, args.budgets or sorted(SHAPES[shape][1]), args.host_budget, args.max_regenerate)
