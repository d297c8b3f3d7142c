"""The experts' output error on held-out tokens, nearest rounding vs GPTQ on each expert's routed tokens (issue 52).

A transformers ``Qwen3MoeForCausalLM`` from a config (byte vocabulary, ``--hidden`` wide, 2 layers, 8 experts, top-2,
untied head) is trained in fp32 for ``--steps`` AdamW steps on byte text (``benchmarks/moe_correction.py``'s model and
data; each expert ``--intermediate`` wide), then quantized by ``QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=False)`` with the probe
batch = the first ``--probe`` training tokens, the attention left unquantized (``ignore_modules=["self_attn"]``) so
that only the experts (and the routers' inputs through them) change. The error is the relative Frobenius norm of each
MoE block's output against the fp32 block's, on the same inputs (the fp32 model's block inputs on ``--val`` held-out
windows, fed to both blocks: the routing is the same, the experts' weights alone differ), summed over the blocks.

Arms: ``nearest`` (``rounding="nearest"``); ``gptq`` (``rounding="gptq"``: an expert routed fewer than
:data:`~lightning_hbm.precision.gptq.EXPERT_MIN_TOKENS` probe tokens keeps nearest rounding); ``gptq, every expert``
(that minimum lowered to one token: GPTQ on every expert the probe reached). Per expert Linear, on the same held-out
block inputs, the output error of ``gptq, every expert`` over ``nearest``'s (each Linear's input and output hooked in the
quantized block, against ``F.linear`` with its fp32 weight), summed over the probes and seeds by the probe tokens routed
to that expert: what ``EXPERT_MIN_TOKENS`` is chosen on. ``--attention``: the same comparison on the attention
Linears, the experts kept (whether a model's inputs let GPTQ gain at all).

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/moe_expert_gptq.py --seeds 0 1 --probe 64 256 2048
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/moe_expert_gptq.py --seeds 0 1 --probe 64 256 2048 --hidden 256
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/moe_expert_gptq.py --seeds 0 1 --probe 64 256 2048 --intermediate 32 --attention --largest 5
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.nn.functional as F

from lightning_hbm import QuantizedPrecision, record
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.layers.experts import LinearExperts, convertible_experts, expert_names
from lightning_hbm.precision import gptq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_correction import moe_model  # noqa: E402  (the sibling benchmark's model)

BUCKETS = ((1, 1), (2, 3), (4, 7), (8, 31), (32, 127), (128, 10**9))


def block_inputs(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, list[tuple[Any, ...]]]:
    """``{MoE block name: its inputs on each batch}`` of ``model``."""
    blocks = {name: sub for name, sub in model.named_modules() if type(sub).__name__.endswith("SparseMoeBlock")}
    seen: dict[str, list[tuple[Any, ...]]] = {name: [] for name in blocks}
    handles = [sub.register_forward_hook(lambda m, a, o, name=name: seen[name].append(tuple(t.detach() for t in a))) for name, sub in blocks.items()]
    with torch.no_grad():
        for x in batches:
            model(x)
    for handle in handles:
        handle.remove()
    return seen


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def errors(reference: torch.nn.Module, quantized: torch.nn.Module, inputs: dict[str, list[tuple[Any, ...]]],
           weights: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:  # fmt: skip
    """The relative Frobenius error of every MoE block's output (the blocks and batches together), and per expert
    Linear of ``weights`` (its fp32 weight by name) the error of its output on the inputs it got (squared, summed)."""
    per_linear: dict[str, float] = defaultdict(float)
    linears = {name: quantized.get_submodule(name) for name in weights}

    def hook(name: str) -> Any:
        def record_error(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
            per_linear[name] += float((output.float() - F.linear(args[0].float(), weights[name])).pow(2).sum())

        return record_error

    handles = [linear.register_forward_hook(hook(name)) for name, linear in linears.items()]
    diff = norm = 0.0
    with torch.no_grad():
        for name, calls in inputs.items():
            for args in calls:
                want, got = _first(reference.get_submodule(name)(*args)), _first(quantized.get_submodule(name)(*args))
                diff += float((got - want).pow(2).sum())
                norm += float(want.pow(2).sum())
    for handle in handles:
        handle.remove()
    return (diff / norm) ** 0.5, dict(per_linear)


def quantize(model: torch.nn.Module, probe: torch.Tensor, rounding: str) -> tuple[torch.nn.Module, int, int]:
    """``model`` quantized; how many expert Linears GPTQ rounded, of how many."""
    quantized = copy.deepcopy(model)
    QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, quantize_embeddings=False, rounding=rounding,
                       ignore_modules=["self_attn"]).convert_module(quantized)  # fmt: skip
    experts = [linear for sub in quantized.modules() if isinstance(sub, LinearExperts) for linear in [*sub.gate_up_proj, *sub.down_proj]]
    rounded = sum(record.quantized_as(linear) == ("nf4-dq", "gptq") for linear in experts)
    return quantized, rounded, len(experts)


def expert_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each expert Linear's fp32 weight by its name in the quantized model (``LinearExperts``' layout)."""
    found = {}
    for name, layer in convertible_experts(model).items():
        linears = LinearExperts.from_transformers(layer)
        for linear_name in expert_names(name, layer):
            found[linear_name] = linears.get_submodule(linear_name[len(name) + 1 :]).weight.detach().float()
    return found


def routed(model: torch.nn.Module, probe: torch.Tensor) -> dict[str, int]:
    """Probe tokens routed to each expert Linear (the statistics' rows, :func:`~lightning_hbm.precision.gptq.input_statistics`)."""
    return gptq.input_statistics(model, [], probe, convertible_experts(model))[1]


def trained(seed: int, hidden: int, intermediate: int, steps: int, data: ByteTextDataModule) -> torch.nn.Module:
    """``benchmarks/moe_correction.py``'s model and training, each expert ``intermediate`` wide."""
    model = moe_model(seed, hidden, intermediate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batches = iter(data.train_dataloader())
    for _ in range(steps):
        x, y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def attention_ratio(model: torch.nn.Module, probe: torch.Tensor, batches: list[torch.Tensor]) -> float:
    """The median over the attention Linears of GPTQ's held-out output error over nearest's, the experts kept (each
    quantized Linear's input and output hooked, against ``F.linear`` with its fp32 weight)."""
    names = [name for name, sub in model.named_modules() if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))]
    weights = {name: model.get_submodule(name).weight.detach().float() for name in names}
    found: dict[str, dict[str, float]] = {}
    for rounding in ("nearest", "gptq"):
        quantized = copy.deepcopy(model)
        QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, quantize_embeddings=False, rounding=rounding,
                           ignore_modules=["experts"]).convert_module(quantized)  # fmt: skip
        sums: dict[str, float] = defaultdict(float)

        def hook(name: str, sums: dict[str, float] = sums) -> Any:
            def record_error(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
                x = args[0].reshape(-1, args[0].shape[-1]).float()
                sums[name] += float((output.reshape(x.shape[0], -1).float() - F.linear(x, weights[name])).pow(2).sum())

            return record_error

        handles = [quantized.get_submodule(name).register_forward_hook(hook(name)) for name in names]
        with torch.no_grad():
            for x in batches:
                quantized(x)
        for handle in handles:
            handle.remove()
        found[rounding] = dict(sums)
    return float(torch.tensor([(found["gptq"][n] / found["nearest"][n]) ** 0.5 for n in names]).median())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=None, help="each expert's width (default: --hidden)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--probe", type=int, nargs="+", default=[2048], help="probe tokens (whole windows of --seq)")
    parser.add_argument("--val", type=int, default=16, help="held-out windows")
    parser.add_argument("--attention", action="store_true", help="also GPTQ vs nearest on the attention Linears (last probe)")
    parser.add_argument("--largest", type=int, default=0, help="print the expert Linears with the largest nearest error (last probe)")
    args = parser.parse_args()
    logging.getLogger("lightning_hbm").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, train_samples=4096, val_samples=args.val, max_bytes=2_000_000)
    windows = torch.cat([x for x, _ in data.train_dataloader()][: max(1, -(-max(args.probe) // (args.seq * args.batch)))])
    val = [x for x, _ in data.val_dataloader()]
    intermediate = args.intermediate or args.hidden
    print(f"Qwen3-MoE hidden {args.hidden}, experts {intermediate} wide, 2 layers, 8 experts top-2, {args.steps} fp32 steps; "
          f"{sum(x.numel() for x in val)} held-out tokens")
    minimum = gptq.EXPERT_MIN_TOKENS
    ratios: dict[tuple[int, int], list[float]] = defaultdict(list)
    for seed in args.seeds:
        model = trained(seed, args.hidden, intermediate, args.steps, data)
        inputs, weights = block_inputs(model, val), expert_weights(model)
        for tokens in args.probe:
            probe = windows[: max(1, tokens // args.seq)]
            rows = routed(model, probe)
            row, per_arm = [], {}
            for arm, rounding, least in (("nearest", "nearest", minimum), ("gptq", "gptq", minimum), ("gptq, every expert", "gptq", 1)):
                gptq.EXPERT_MIN_TOKENS = least
                try:
                    quantized, rounded, total = quantize(model, probe, rounding)
                finally:
                    gptq.EXPERT_MIN_TOKENS = minimum
                block, per_arm[arm] = errors(model, quantized, inputs, weights)
                row.append(f"{arm} {block:.4f} ({rounded}/{total} rounded)")
            print(f"seed {seed}, probe {probe.numel()} tokens: " + "; ".join(row), flush=True)
            if args.largest and tokens == args.probe[-1]:
                largest = sorted(per_arm["nearest"], key=lambda n: -per_arm["nearest"][n])[: args.largest]
                print("  largest nearest errors (sum of squares, nearest -> GPTQ): " + ", ".join(
                    f"{n.split('layers.')[1]} {per_arm['nearest'][n]:.1f} -> {per_arm['gptq'][n]:.1f}" for n in largest))
            if args.attention and tokens == args.probe[-1]:
                print(f"seed {seed}, probe {probe.numel()} tokens: the attention Linears (experts kept), GPTQ / nearest "
                      f"held-out output error, median {attention_ratio(model, probe, val):.3f}", flush=True)
            for name, nearest in per_arm["nearest"].items():
                bucket = next((b for b in BUCKETS if b[0] <= rows[name] <= b[1]), None)
                if bucket is not None and nearest > 0:
                    ratios[bucket].append((per_arm["gptq, every expert"][name] / nearest) ** 0.5)
    print("probe tokens routed to the expert | expert Linears | GPTQ / nearest held-out output error: median | max")
    for bucket in BUCKETS:
        if ratios[bucket]:
            values = torch.tensor(ratios[bucket])
            print(f"{bucket[0]}-{bucket[1]} | {len(values)} | {values.median():.3f} | {values.max():.3f}")


if __name__ == "__main__":
    main()
