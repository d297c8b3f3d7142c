"""GPTQ rounding of convolutions (issue 53 item 2): the same bytes, on the four conv nets of ``conv_accuracy.py``.

A convolution is a Linear over its input's patches (im2col): :mod:`lightning_hbm.precision.gptq` measures ``2 P^T P``
of each convolution's probe patches (per group for grouped and depthwise ones) and rounds its weight matrix with it.
Per model (BatchNorm statistics calibrated as in ``conv_accuracy.py``) and seed (the model's initialisation, a probe
batch of 4 images, a held-out batch of 4 images the probe never saw), each arm's probe cosine, held-out cosine, bytes
per conv weight and fit-start seconds (measuring and quantizing, on the model as built):

- ``nf4-dq``: every convolution in nf4-dq, rounded to nearest;
- ``nf4-dq gptq (damp d)``: the same bytes, GPTQ-rounded with damping ``d`` (a fraction of ``diag(H)``'s mean; the
  library's :data:`~lightning_hbm.precision.gptq.DAMP` is 0.1);
- ``plan``: ``QuantizedPrecision("nf4-dq")``'s default (the convolutions' plan to probe cosine 0.98,
  :func:`~lightning_hbm.precision.mode_choice.conv_modes`), nearest rounding;
- ``plan measured gptq-rounded``: the plan measured with every 4-bit convolution GPTQ-rounded, and stored so (what
  ``rounding="gptq"`` would do if :func:`~lightning_hbm.precision.sensitivity.measured_rounded` said yes for them);
- ``plan + gptq``: ``QuantizedPrecision("nf4-dq", rounding="gptq")``: the plan measured rounded to nearest (the
  ``plan`` row's), its 4-bit convolutions stored GPTQ-rounded.

    OMP_NUM_THREADS=1 python benchmarks/conv_gptq.py [--models ResNet18 ...] [--seeds 0 1] [--damps 0.1 1.0]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import coverage
from lightning_hbm.precision import gptq, sensitivity
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.quantization import Quantization
from lightning_hbm.precision.sensitivity import measured_rounded

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, calibrated_nets, cosine, flat  # noqa: E402


def figures(model: nn.Module, reference: nn.Module, batches: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float, float]:
    """(probe cosine, held-out cosine, bytes per conv weight) of the quantized ``model``."""
    conv = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad():
        probe, held = (cosine(flat(model(x)), flat(reference(x))) for x in batches)
    return probe, held, conv.bytes / conv.params


def arms(reference: nn.Module, probe: torch.Tensor, damps: list[float]) -> list[tuple[str, nn.Module, float]]:
    """``(label, quantized model, fit-start seconds)`` of every arm."""
    convs = [n for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)]
    built = []
    for damp in (None, *damps):
        model, start = copy.deepcopy(reference), time.perf_counter()
        if damp is None:
            quantize_model(model, "nf4-dq", dtype="float32")
        else:
            gptq.gptq_indices.__defaults__ = (damp,)  # the library's damping, for this arm
            quantize_model(model, "nf4-dq", dtype="float32", hessians=gptq.input_hessians(model, convs, probe))
            gptq.gptq_indices.__defaults__ = (gptq.DAMP,)
        built.append(("nf4-dq" if damp is None else f"nf4-dq gptq (damp {damp})", model, time.perf_counter() - start))
    for label, rounding in (("plan", "nearest"), ("plan measured gptq-rounded", "gptq"), ("plan + gptq", "gptq")):
        model, start = copy.deepcopy(reference), time.perf_counter()
        plan = Quantization(QuantizationConfig("nf4-dq", "float32", probe_batch=probe, rounding=rounding), "QuantizedPrecision")
        if label == "plan measured gptq-rounded":
            sensitivity.measured_rounded = lambda kind: True  # type: ignore[assignment]
        try:
            plan.check(model, None)
        finally:
            sensitivity.measured_rounded = measured_rounded
        plan.convert(model, None)
        built.append((label, model, time.perf_counter() - start))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--damps", nargs="+", type=float, default=[0.1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | arm | probe cosine | held-out cosine | B/conv weight | fit start (s) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, seed, reference, probe, held in calibrated_nets(args.models, args.seeds, 4):
        for label, model, seconds in arms(reference, probe, args.damps):
            p, h, b = figures(model, reference, (probe, held))
            print(f"| {name} | {seed} | {label} | {p:.4f} | {h:.4f} | {b:.3f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
