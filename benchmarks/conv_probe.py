"""Two levers for the conv nets of issue 53 item 2: a larger probe batch, and BatchNorm statistics re-estimated.

Same four nets as ``conv_accuracy.py`` / ``conv_gptq.py`` (BatchNorm statistics calibrated on 4 batches of 8 smooth
64-px images), per seed the model's initialisation, a probe batch of ``N`` images (``--probes``; seed 0 and N=4:
``conv_gptq.py``'s probe) and two held-out batches the probe never saw (4 images: ``conv_gptq.py``'s, and 16 more).
Float32 compute, as ``conv_levers.py`` / ``conv_gptq.py``. Arms per probe size:

- ``gptq``: every convolution nf4-dq, GPTQ-rounded with the probe's patches (``H = 2 P^T P``);
- ``plan``: the library's convolutions' plan (``choose_layer_modes``, ladder ``nf4-dq-b32`` / ``int8``) to probe cosine 0.98,
  rounded to nearest; ``plan + gptq``: the same plan stored GPTQ-rounded (``rounding="gptq"`` today);
- ``plan measured gptq``: measured with every 4-bit convolution GPTQ-rounded (``sensitivity.measured_rounded`` said
  yes), stored so; ``plan measured gptq, rows >= c x inputs``: only the convolutions whose probe gives at least
  ``c`` patches per input are measured GPTQ-rounded (the others to nearest), all stored GPTQ-rounded;
- ``budget 0.6``: the plan under ``max_bytes_per_param=0.6`` (nearest, ``+ gptq``, measured gptq).

Lever (b), applied after quantization to some arms (``... | bn``): the BatchNorm statistics recomputed with the
quantized weights on the probe batch,

- ``bn re-estimated``: every BatchNorm (only they) in train mode with ``momentum=None``, one forward of the probe, back
  to eval: its running mean / variance become the probe's, through the quantized layers;
- ``bn shift``: each BatchNorm's statistics moved by what quantization changes on the probe: ``mean + (mean_q -
  mean_fp)``, ``var * var_q / var_fp`` of its input (in one forward, each
  BatchNorm corrected just before it runs, through the corrections upstream); ``bn mean shift``:
  the mean only (a per-channel bias correction at each BatchNorm);

and ``fp32 | bn re-estimated``: the unquantized model's statistics re-estimated on the probe (the floor of that lever).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_probe.py [--models ...] [--seeds 0 1] [--probes 4 16 32]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import coverage
from lightning_hbm.precision import sensitivity
from lightning_hbm.precision.gptq import input_statistics
from lightning_hbm.precision.sensitivity import choose_layer_modes, measured_rounded

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, cosine, flat  # noqa: E402
from conv_models import calibrate, images  # noqa: E402

NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def norms(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NORMS)}


@torch.no_grad()
def bn_reestimate(model: nn.Module, probe: torch.Tensor) -> None:
    """Every BatchNorm's running statistics recomputed on ``probe`` (cumulative, ``momentum=None``), the rest in eval."""
    model.eval()
    for norm in norms(model).values():
        norm.reset_running_stats()
        norm.momentum, norm.training = None, True
    model(probe)
    for norm in norms(model).values():
        norm.momentum, norm.training = 0.1, False


def moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance of a ``[batch, channels, ...]`` tensor."""
    x = x.float().transpose(0, 1).reshape(x.shape[1], -1)
    return x.mean(1), x.var(1, unbiased=False)


@torch.no_grad()
def bn_shift(model: nn.Module, reference: nn.Module, probe: torch.Tensor, variance: bool = True) -> None:
    """Each BatchNorm's statistics moved by what quantization changes in its input's moments on ``probe``: in one
    eval forward, each BatchNorm corrected just before it runs, on its input through the corrections upstream."""
    want: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    done: set[str] = set()  # one correction a layer: a second call (a shared module) leaves it

    def record(name: str) -> Any:
        return lambda layer, args: want.setdefault(name, moments(args[0])) and None

    def correct(name: str) -> Any:
        def hook(layer: nn.Module, args: tuple) -> None:
            if name in done:
                return
            done.add(name)
            mean, var = moments(args[0])
            layer.running_mean.add_(mean - want[name][0])
            if variance:
                layer.running_var.mul_(var / want[name][1].clamp_min(1e-12))

        return hook

    for net, hook in ((reference, record), (model, correct)):
        handles = [m.register_forward_pre_hook(hook(n)) for n, m in norms(net).items()]
        try:
            net.eval()
            net(probe)
        finally:
            for handle in handles:
                handle.remove()


def conv_bytes(model: nn.Module) -> float:
    """Bytes per conv weight, constants included (of the model as built: a deep copy of a 4-bit layer counts its
    shared constants twice)."""
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
    return rows["Conv"].bytes / rows["Conv"].params if "Conv" in rows else 4.0


def cosines(model: nn.Module, reference: nn.Module, batches: tuple[torch.Tensor, ...]) -> list[float]:
    """Cosine of each batch's output against the reference's."""
    with torch.no_grad():
        return [cosine(flat(model(x)), flat(reference(x))) for x in batches]


def planned(
    reference: nn.Module, convs: list[str], probe: torch.Tensor, hessians: dict[str, torch.Tensor], target: dict[str, float],
    measure: Optional[dict[str, torch.Tensor]], store: Optional[dict[str, torch.Tensor]],
) -> nn.Module:
    """A copy of ``reference`` with its convs planned to ``target`` (measured GPTQ-rounded with ``measure``'s
    Hessians where given), stored GPTQ-rounded with ``store``'s."""
    if measure is not None:
        sensitivity.measured_rounded = lambda kind: True  # type: ignore[assignment]
    try:
        report = choose_layer_modes(reference, convs, "nf4-dq", "auto", "float32", probe, strict=False, hessians=measure, **target)  # type: ignore[arg-type]
    finally:
        sensitivity.measured_rounded = measured_rounded
    model = copy.deepcopy(reference)
    quantize_model(model, "nf4-dq", dtype="float32", layer_modes=report.modes, hessians=store)
    return model


def arms(reference: nn.Module, probe: torch.Tensor, quick: bool) -> list[tuple[str, Callable[[], nn.Module], bool]]:
    """``(label, build, also with BatchNorm re-estimated)`` of every arm."""
    convs = [n for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)]
    hessians, rows = input_statistics(reference, convs, probe)
    enough = {c: {n: h for n, h in hessians.items() if rows[n] >= c * h.shape[-1]} for c in (1, 4)}
    target, budget = {"min_cosine": 0.98}, {"max_bytes_per_param": 0.6}

    def uniform(store: Optional[dict[str, torch.Tensor]]) -> nn.Module:
        model = copy.deepcopy(reference)
        quantize_model(model, "nf4-dq", dtype="float32", hessians=store)
        return model

    built: list[tuple[str, Callable[[], nn.Module], bool]] = [
        ("fp32", lambda: copy.deepcopy(reference), True),
        ("nf4-dq", lambda: uniform(None), True),
        ("gptq", lambda: uniform(hessians), False),
        ("plan", lambda: planned(reference, convs, probe, hessians, target, None, None), True),
        ("plan + gptq", lambda: planned(reference, convs, probe, hessians, target, None, hessians), True),
        ("budget 0.6", lambda: planned(reference, convs, probe, hessians, budget, None, None), True),
        ("budget 0.6 + gptq", lambda: planned(reference, convs, probe, hessians, budget, None, hessians), True),
    ]
    if not quick:
        built += [
            ("plan measured gptq", lambda: planned(reference, convs, probe, hessians, target, hessians, hessians), False),
            (f"plan measured gptq, rows >= 1 x inputs ({len(enough[1])}/{len(convs)} convs)",
             lambda: planned(reference, convs, probe, hessians, target, enough[1], hessians), False),
            (f"plan measured gptq, rows >= 4 x inputs ({len(enough[4])}/{len(convs)} convs)",
             lambda: planned(reference, convs, probe, hessians, target, enough[4], hessians), False),
            ("budget 0.6 measured gptq", lambda: planned(reference, convs, probe, hessians, budget, hessians, hessians), False),
        ]  # fmt: skip
    return built


def run(name: str, seed: int, size: int, quick: bool) -> None:
    torch.manual_seed(seed)
    reference = MODELS[name]()
    calibrate(reference, images(8, seed=10, batches=4))
    reference.eval()
    # seed 0, 4 images: conv_gptq.py's batches (probe 2, held out 1); 16 more held out
    probe = images(size, seed=2 + 10 * seed)
    batches = (probe, images(4, seed=1 + 10 * seed), images(16, seed=3 + 10 * seed))
    for label, build, with_bn in arms(reference, probe, quick):
        start = time.perf_counter()
        model = build()
        seconds, b = time.perf_counter() - start, conv_bytes(model)
        fixes: list[tuple[str, Callable[[nn.Module], None]]] = [("", lambda m: None)]
        if with_bn:
            fixes += [
                (" | bn re-estimated", lambda m: bn_reestimate(m, probe)),
                (" | bn shift", lambda m: bn_shift(m, reference, probe)),
                (" | bn mean shift", lambda m: bn_shift(m, reference, probe, variance=False)),
            ]
        for suffix, fix in fixes[1:] + fixes[:1]:  # the model itself last: copied before its forwards
            if label == "fp32" and suffix in ("", " | bn shift", " | bn mean shift"):
                continue  # the reference itself, and shifts of zero
            copied = copy.deepcopy(model) if suffix else model
            fix(copied)
            p, h4, h16 = cosines(copied, reference, batches)
            print(f"| {name} | {seed} | {size} | {label}{suffix} | {p:.4f} | {h4:.4f} | {h16:.4f} | {b:.3f} | {seconds:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--probes", nargs="+", type=int, default=[4, 16, 32])
    parser.add_argument("--quick", action="store_true", help="leave out the plans measured GPTQ-rounded")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | probe images | arm | probe cosine | held out (4) | held out (16) | B/conv weight | build (s) |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        for size in args.probes:
            for seed in args.seeds:
                run(name, seed, size, args.quick)


if __name__ == "__main__":
    main()
