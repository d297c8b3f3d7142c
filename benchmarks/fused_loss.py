"""FusedLoss: the loss term with and without fusion, measured and predicted.

    python benchmarks/fused_loss.py --memtracker   # 2 layers, width 64, 32k vocab, batch 2 x 512, nf4-dq + LoRA + AC
    python benchmarks/fused_loss.py --planner      # Llama-3.1-8B shape, batch 2 x 2048, QLoRA r=16 + full AC (~5 min CPU)
    python benchmarks/fused_loss.py --chunks       # the loss alone: [1024 x 768] hidden, nf4 head, 32k vocab, per chunk size
    python benchmarks/fused_loss.py --bart         # BART (final_logits_bias), 50265 vocab, d_model 64, batch 2 x 512, fp32
    python benchmarks/fused_loss.py --large-vocab --dtypes bfloat16 --sizes u 0 256  # 128k vocab, hidden 256,
                                 # batch 1 x 1024: peak vs floor and step time vs the unfused loss (u), per chunk rule

``--memtracker``: the step's peak by torch's own ``MemTracker`` (not lightning_hbm's profiler) and the step-time
ratio (CPU time of this process, median of interleaved rounds), fused vs unfused, in float32 and bfloat16 compute.
``--planner``: ``lightning_hbm.planner.predict`` for the QLoRA candidate as it is, and with ``FusedLoss()`` added to
the candidate's callbacks (what a ``fused_loss`` candidate axis will do; the planner traces the chunked loss on
fake tensors like any other code), with the head quantized (lightning_hbm's default) or kept in bf16
(``QuantizedPrecision(ignore_modules=["model.lm_head"])``, as transformers' and torchtune's QLoRA do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision, quantize_model
from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.models import LlamaLM

TINY = dict(vocab_size=32000, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def peaks_and_times(step: Any, models: dict, optims: dict, rounds: int) -> tuple[dict, dict]:
    """MemTracker peak of one ``step(fused)`` each, then CPU times of ``rounds`` interleaved unfused/fused steps."""
    peaks = {f: torch_peak_bytes(partial(step, f), models[f], optims[f]) for f in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(rounds):
        for fused in (False, True):
            start = time.process_time()
            step(fused)
            times[fused].append(time.process_time() - start)
    return peaks, times


def memtracker(dtype: str, rounds: int = 3) -> None:
    batch = synthetic_batch(2, 512, vocab_size=32000)
    tokens, vocab = 1024, 32000
    models, optims = {}, {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = LlamaLM(**TINY)
        quantize_model(model, "nf4-dq", dtype)
        LoRA(r=8).transform_model(model)
        ActivationCheckpointing().transform_model(model)
        if fused:
            FusedLoss().transform_model(model)
        models[fused] = model
        optims[fused] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    def step(fused: bool) -> None:
        models[fused].loss(batch).backward()
        optims[fused].step()
        optims[fused].zero_grad(set_to_none=True)

    for fused in (False, True):
        step(fused)  # warm-up: optimizer states exist
    peaks, times = peaks_and_times(step, models, optims, rounds)
    limit = 0.35 * 6 * tokens * vocab
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    six = 6 * tokens * vocab
    print(f"{dtype}: MemTracker step peak unfused {peaks[False] / 2**20:.1f} MiB ({peaks[False] / six:.3f} x 6 B x tokens "
          f"x vocab), fused {peaks[True] / 2**20:.1f} MiB ({peaks[True] / six:.3f} x; the test's limit is 0.35 x = "
          f"{limit / 2**20:.1f} MiB); step time fused / unfused {ratio:.2f}")


def chunks(rounds: int = 3) -> None:
    """CPU time of the loss alone (forward + backward to the hidden states), unfused vs per chunk size."""
    import torch.nn.functional as F
    from torch import nn

    from lightning_hbm.activations.loss import fused_linear_cross_entropy

    torch.manual_seed(0)
    hidden, vocab, tokens = 768, 32000, 1024
    head = nn.Sequential(nn.Linear(hidden, vocab, bias=False))
    quantize_model(head, "nf4-dq", "float32")
    head = head[0]
    h0, y = torch.randn(tokens, hidden), torch.randint(0, vocab, (tokens,))

    def run(chunk: int) -> None:
        h = h0.clone().requires_grad_()
        loss = F.cross_entropy(head(h).float(), y) if chunk == 0 else fused_linear_cross_entropy(h, head, y, chunk_size=chunk)
        loss.backward()

    sizes = (0, 64, 256, 1024)
    times: dict[int, list[float]] = {c: [] for c in sizes}
    for _ in range(rounds + 1):  # the first round warms up
        for c in sizes:
            start = time.process_time()
            run(c)
            times[c].append(time.process_time() - start)
    ref = statistics.median(times[0][1:])
    print("loss alone, CPU time vs unfused: " + ", ".join(
        f"{'unfused' if c == 0 else f'{c}-token chunks'} {statistics.median(times[c][1:]) / ref:.2f}" for c in sizes))


def large_vocab(dtype: str = "float32", rounds: int = 3, sizes: tuple = ("u", "0"), vocab: int = 128256) -> None:
    """A 128k vocabulary (Llama-3's): the step's MemTracker peak against the analytic QLoRA floor, per chunk rule
    (``u``: no FusedLoss, the unfused loss of HF's recipe: full logits, ``.float()``, aten cross-entropy; ``0``: the
    default, :func:`chunk_tokens`; else a fixed ``chunk_size``; a ``w`` suffix softmaxes each chunk whole in one fp32
    copy, as before ``SOFTMAX_BYTES``), and each rule's step time over the first rule's (put ``u`` first: time is
    reported against the unfused loss), in one process (interleaved rounds, median of CPU time). ``vocab`` other
    than 128256 runs the same model at that vocabulary (32000: the 32k row).

    On a CPU without AVX512-BF16 a bf16 [96 x 256] x [256 x 128256] matmul took 66x the fp32 one (the dev machine of
    Nov 30): use ``--dtypes float32`` there. MemTracker runs once per rule (it adds ~1.8x to the step)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from planner import analytic_qlora_floor

    import lightning_hbm.activations.loss.cost as cost

    config = dict(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
    batch = synthetic_batch(1, 1024, vocab_size=config["vocab_size"])
    compute = getattr(torch, dtype)
    whole = {rule: rule.endswith("w") for rule in sizes}  # the chunk softmaxed in one fp32 copy
    rules = {rule: 1024 if rule == "u" else cost.chunk_tokens(1024, config["vocab_size"], compute, int(rule.rstrip("w")) or None)
             for rule in sizes}
    models, optims = {}, {}
    for rule in rules:
        torch.manual_seed(0)
        model = LlamaLM(**config)
        quantize_model(model, "nf4-dq", dtype)
        model.to(compute)  # the embedding, head and norms in the compute dtype, as QuantizedPrecision does
        LoRA(r=8).transform_model(model)
        ActivationCheckpointing().transform_model(model)
        if rule != "u":
            FusedLoss(chunk_size=int(rule.rstrip("w")) or None).transform_model(model)
        models[rule], optims[rule] = model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    default_softmax = cost.SOFTMAX_BYTES

    def step(rule: str) -> None:
        cost.SOFTMAX_BYTES = rules[rule] * config["vocab_size"] * 4 if whole[rule] else default_softmax
        models[rule].loss(batch).backward()
        optims[rule].step()
        optims[rule].zero_grad(set_to_none=True)

    for rule in rules:
        step(rule)  # warm-up: optimizer states exist
    peaks = {rule: torch_peak_bytes(partial(step, rule), models[rule], optims[rule]) for rule in rules}
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {rule: [] for rule in rules}
    for _ in range(rounds):
        for rule in rules:
            start = time.process_time()
            step(rule)
            times[rule].append(time.process_time() - start)
    floor = analytic_qlora_floor(config, 1, 1024, 8, itemsize=compute.itemsize)
    ref = statistics.median(times[sizes[0]])
    print(f"{vocab} vocabulary, hidden 256, 2 layers, batch 1 x 1024, nf4-dq ({dtype} compute) + LoRA r=8 + full AC + "
          f"FusedLoss; analytic floor {floor / 2**20:.1f} MiB; CPU time, median of {rounds} interleaved rounds; load "
          f"average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    for rule, tokens in rules.items():
        name = ("unfused (full logits, aten cross-entropy)" if rule == "u" else "default (chunk_tokens)" if rule == "0"
                else f"chunk_size={rule.rstrip('w')}") + (", whole fp32 copy" if whole[rule] else "")
        print(f"| {name} | {tokens} | {peaks[rule] / 2**20:.1f} MiB | {peaks[rule] / floor:.2f}x | "
              f"{statistics.median(times[rule]):.2f} s | {statistics.median(times[rule]) / ref:.2f} |", flush=True)


def bart(rounds: int = 3) -> None:
    """A tiny BART with BART's own vocabulary (50265): its logits get ``+ final_logits_bias``, which FusedLoss applies
    chunk by chunk. MemTracker step peak (full fine-tuning, AdamW, fp32) and step time, unfused vs fused."""
    import copy

    from torch import nn
    from transformers import BartConfig, BartForConditionalGeneration

    vocab, tokens = 50265, 512
    config = BartConfig(vocab_size=vocab, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=tokens,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    models = {False: nn.ModuleDict({"model": BartForConditionalGeneration(config)})}
    models[True] = copy.deepcopy(models[False])
    FusedLoss().transform_model(models[True])
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(3, vocab, (2, tokens), generator=g), torch.randint(3, vocab, (2, tokens), generator=g)
    optims = {f: torch.optim.AdamW(m.parameters()) for f, m in models.items()}

    def step(fused: bool) -> float:
        loss = models[fused]["model"](input_ids=x, labels=y).loss
        loss.backward()
        optims[fused].step()
        optims[fused].zero_grad(set_to_none=True)
        return float(loss)

    losses = {f: step(f) for f in (False, True)}  # warm-up: optimizer states exist
    peaks, times = peaks_and_times(step, models, optims, rounds)
    logits = 2 * tokens * vocab * 4
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"BART 1+1 layers, d_model 64, vocab {vocab}, batch 2 x {tokens}, fp32, AdamW: fp32 logits {logits:,} B; "
          f"first-step loss unfused {losses[False]:.6f}, fused {losses[True]:.6f}")
    print(f"| unfused | {peaks[False]:,} B ({peaks[False] / 2**20:.1f} MiB) | | 1.00 |")
    print(f"| FusedLoss | {peaks[True]:,} B ({peaks[True] / 2**20:.1f} MiB) | {(peaks[False] - peaks[True]) / logits:.2f}x "
          f"the logits saved, {peaks[True] / peaks[False]:.3f}x the peak | {ratio:.2f} |")


def planner() -> None:
    """The 8B plan with the very objects a Trainer gets, with the output head in nf4 or kept bf16 (the default)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from planner import LLAMA_8B, TORCHTUNE_QLORA_GIB

    from lightning_hbm.planner import format_bytes, plan

    batch = synthetic_batch(2, 2048, vocab_size=LLAMA_8B["vocab_size"])
    print(f"Llama-3.1-8B shape, batch 2 x 2048, nf4-dq + LoRA r=16 + full AC (torchtune publishes {TORCHTUNE_QLORA_GIB} GiB)")
    for head, quantize_head in (("nf4 head (quantize_head=True)", True), ("bf16 head (the default)", False)):
        for fused in (False, True):
            callbacks = [LoRA(r=16), ActivationCheckpointing()] + ([FusedLoss()] if fused else [])
            start = time.perf_counter()
            p = plan(partial(LlamaLM, **LLAMA_8B), batch, plugin=QuantizedPrecision("nf4-dq", quantize_head=quantize_head),
                     callbacks=callbacks, device="cuda").predictions[0]
            cats = ", ".join(f"{k} {format_bytes(v)}" for k, v in p.categories.items())
            print(f"| {head} | {'FusedLoss' if fused else 'unfused'} | {format_bytes(p.peak)} ({p.peak:,} B) | {cats} | "
                  f"loss term {format_bytes(p.loss)} | {time.perf_counter() - start:.1f} s |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memtracker", action="store_true")
    parser.add_argument("--planner", action="store_true")
    parser.add_argument("--chunks", action="store_true")
    parser.add_argument("--large-vocab", action="store_true")
    parser.add_argument("--bart", action="store_true")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="+", default=["u", "0"],
                        help="--large-vocab chunk sizes (u: unfused; 0: the default rule; suffix w: one whole fp32 copy per chunk)")
    parser.add_argument("--vocab", type=int, default=128256, help="--large-vocab vocabulary size")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.memtracker:
        for dtype in args.dtypes:
            memtracker(dtype)
    if args.chunks:
        chunks()
    if args.bart:
        bart(args.rounds)
    if args.large_vocab:
        for dtype in args.dtypes:
            large_vocab(dtype, args.rounds, tuple(args.sizes), args.vocab)
    if args.planner:
        planner()


if __name__ == "__main__":
    main()
