"""What would bring the conv nets of ``conv_accuracy.py`` to output cosine 0.98 at <= 0.6 bytes per conv weight?

Issue 53's goal, measured lever by lever on the same four models (BatchNorm statistics calibrated, plan probe: a batch
of 4 images, cosine held out on another), each figure a plan's probe cosine, its held-out cosine and bytes per conv
weight:

- ``plan``: the library's convolutions' plan (:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`, ``nf4-dq``
  widened to ``nf4-dq-b32`` / ``int8`` by error removed per byte) to other probe targets (``min_cosine``), under a byte
  budget (``max_bytes_per_param``), and measured on a probe of 8 images;
- ``greedy``: the gains re-measured after each step (every layer's cosine gain per extra byte, in the plan as it stands,
  a forward each; 1 % of the bytes taken per round), with weights fake-quantized in fp32: nf4-dq (real round trip),
  symmetric int5 / int6 in blocks of 64 with an fp16 scale (0.656 / 0.781 B: formats the library does not have) and
  int8 per row (1.0 B); nf4-dq counted at 0.516 B a weight (its per-layer constants left out);
- ``lowrank``: every conv (groups 1) in nf4-dq plus the calibrated rank-r correction of
  :mod:`lightning_hbm.precision.correction` fitted on the probe as an ``(out, in*k*k)`` matrix (inputs unfolded), bf16.

    OMP_NUM_THREADS=1 python benchmarks/conv_levers.py [--models ResNet18 ...] [--levers plan greedy lowrank]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import coverage
from lightning_hbm.precision.correction import fit_factors
from lightning_hbm.precision.registry import get_format
from lightning_hbm.precision.sensitivity import choose_layer_modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, cosine, flat  # noqa: E402
from conv_models import calibrate, images  # noqa: E402

BYTES = {"nf4": 0.516, "int5": 5 / 8 + 2 / 64, "int6": 6 / 8 + 2 / 64, "int8": 1.0}


def setup(name: str) -> tuple[nn.Module, dict[str, nn.Conv2d], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    reference = MODELS[name]()
    calibrate(reference, images(8, seed=10, batches=4))
    reference.eval()
    convs = {n: m for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)}
    return reference, convs, images(4, seed=1), images(4, seed=2)


def held_out(reference: nn.Module, modes: dict[str, str], x: torch.Tensor) -> tuple[float, float]:
    model = copy.deepcopy(reference)
    quantize_model(model, "nf4-dq", dtype="float32", layer_modes=modes)
    conv = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad():
        return cosine(flat(model(x)), flat(reference(x))), conv.bytes / conv.params


def plan_levers(name: str) -> None:
    reference, convs, x, probe = setup(name)
    arms: list[tuple[str, Any, dict[str, float]]] = [
        ("target 0.98 (default)", probe, {"min_cosine": 0.98}), ("target 0.985", probe, {"min_cosine": 0.985}),
        ("target 0.99", probe, {"min_cosine": 0.99}), ("budget 0.6 B", probe, {"max_bytes_per_param": 0.6}),
        ("budget 0.65 B", probe, {"max_bytes_per_param": 0.65}), ("target 0.98, probe of 8", images(8, seed=2), {"min_cosine": 0.98}),
    ]  # fmt: skip
    for label, batch, target in arms:
        report = choose_layer_modes(reference, list(convs), "nf4-dq", "auto", "float32", batch, strict=False, **target)  # type: ignore[arg-type]
        held, per_weight = held_out(reference, report.modes, x)
        print(f"| {name} | plan, {label} | {report.cosine:.4f} | {held:.4f} | {per_weight:.3f} |", flush=True)


def nf4_round_trip(weight: torch.Tensor) -> torch.Tensor:
    matrix = weight.reshape(weight.shape[0], -1)
    linear = nn.Linear(matrix.shape[1], matrix.shape[0], bias=False)
    linear.weight = nn.Parameter(matrix.clone(), requires_grad=False)
    stored = get_format("nf4-dq").replace(linear, torch.float32, torch.device("cpu"))
    return get_format("nf4-dq").dequantize(stored, torch.float32).reshape(weight.shape)


def int_round_trip(weight: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    if bits == 8:  # per row, fp32 scale
        rows = weight.reshape(weight.shape[0], -1)
        scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-12) / qmax
        return ((rows / scale).round() * scale).reshape(weight.shape)
    values = weight.flatten()
    blocks = torch.cat([values, values.new_zeros((-values.numel()) % 64)]).reshape(-1, 64)
    scale = (blocks.abs().amax(1, keepdim=True).clamp_min(1e-12) / qmax).half().float()
    return ((blocks / scale).round().clamp(-qmax, qmax) * scale).flatten()[: values.numel()].reshape(weight.shape)


def greedy_lever(name: str, allowed: list[str]) -> None:
    reference, convs, x, probe = setup(name)
    original = {n: m.weight.data.clone() for n, m in convs.items()}
    variants = {n: {"nf4": nf4_round_trip(w), **{f"int{b}": int_round_trip(w, b) for b in (5, 6, 8)}} for n, w in original.items()}
    with torch.no_grad():
        want = {id(probe): flat(reference(probe)), id(x): flat(reference(x))}

    def run(plan: dict[str, str], batch: torch.Tensor) -> float:
        for n, mode in plan.items():
            convs[n].weight.data = variants[n][mode]
        with torch.no_grad():
            got = cosine(flat(reference(batch)), want[id(batch)])
        for n in plan:
            convs[n].weight.data = original[n]
        return got

    total = sum(w.numel() for w in original.values())
    plan, order = {n: "nf4" for n in convs}, list(BYTES)
    current, used, start = run(plan, probe), BYTES["nf4"] * total, time.time()
    while current < 0.98 and any(plan[n] != allowed[-1] for n in convs):
        gains = sorted(
            ((run({**plan, n: m}, probe) - current) / ((BYTES[m] - BYTES[plan[n]]) * original[n].numel()), n, m)
            for n in convs for m in allowed if order.index(m) > order.index(plan[n])
        )[::-1]  # fmt: skip
        spent, moved = 0.0, set()
        for ratio, n, m in gains:
            extra = (BYTES[m] - BYTES[plan[n]]) * original[n].numel()
            if ratio <= 0 or (spent > 0 and spent + extra > 0.01 * used):
                break
            if n not in moved:  # one move per layer a round: its other gains were measured from where it was
                plan[n], spent = m, spent + extra
                moved.add(n)
        used, current = used + spent, run(plan, probe)
    print(
        f"| {name} | greedy re-measured, {'/'.join(allowed)} | {current:.4f} | {run(plan, x):.4f} | {used / total:.3f} "
        f"({dict(Counter(plan.values()))}, {time.time() - start:.0f} s) |", flush=True,
    )  # fmt: skip


def lowrank_lever(name: str) -> None:
    reference, convs, x, probe = setup(name)
    hessians: dict[str, torch.Tensor] = {}

    def hook(n: str) -> Any:
        def record(layer: nn.Conv2d, args: tuple, output: torch.Tensor) -> None:
            if layer.groups == 1:
                cols = F.unfold(args[0], layer.kernel_size, layer.dilation, layer.padding, layer.stride)  # type: ignore[arg-type]
                cols = cols.transpose(1, 2).reshape(-1, layer.weight[0].numel()).double()
                hessians[n] = hessians.get(n, 0) + cols.T @ cols

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in convs.items()]
    with torch.no_grad():
        reference(probe)
        want = flat(reference(x))
    for handle in handles:
        handle.remove()
    original = {n: m.weight.data.clone() for n, m in convs.items()}
    total = sum(w.numel() for w in original.values())
    quantized = {n: nf4_round_trip(w) for n, w in original.items()}
    for rank in (2, 4, 8):
        extra = 0
        for n, layer in convs.items():
            matrix, stored = original[n].reshape(original[n].shape[0], -1), quantized[n].reshape(original[n].shape[0], -1)
            if n in hessians and min(matrix.shape) > rank:
                right, left = fit_factors(matrix.double() - stored.double(), hessians[n], rank)
                stored, extra = stored + (left @ right).float(), extra + 2 * rank * sum(matrix.shape)
            layer.weight.data = stored.reshape(original[n].shape)
        with torch.no_grad():
            got = cosine(flat(reference(x)), want)
        print(f"| {name} | nf4-dq + rank-{rank} correction | | {got:.4f} | 0.516 + {extra / total:.3f} |", flush=True)
    for n, layer in convs.items():
        layer.weight.data = original[n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--levers", nargs="+", default=["plan", "greedy", "lowrank"], choices=["plan", "greedy", "lowrank"])
    args = parser.parse_args()
    print("| model | lever | probe cosine | held-out cosine | B/conv weight |")
    print("|---|---|---:|---:|---:|")
    for name in args.models:
        if "plan" in args.levers:
            plan_levers(name)
        if "greedy" in args.levers:
            greedy_lever(name, ["nf4", "int8"])
            greedy_lever(name, list(BYTES))
        if "lowrank" in args.levers:
            lowrank_lever(name)


if __name__ == "__main__":
    main()
