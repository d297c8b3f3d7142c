"""Quantized convolutions under BatchNorm statistics like a trained network's (issue 53 item 2).

A randomly initialised conv net's BatchNorm layers hold running_mean 0 and running_var 1, which hides what 4-bit
storage does to a trained one: there each BatchNorm divides its channel by the channel's own (often small) standard
deviation, so a channel whose weights are small but quantized with a large absmax is amplified. Here the statistics
are calibrated first: the fp32 model runs in train mode over a few structured batches (smooth random images,
``momentum=None``: cumulative averages), then eval. Per model and mode: bytes per conv weight (constants included,
exact on CPU) and the cosine of the output against the unquantized model, centred on the reference's mean, on a
held-out batch. ``MODE+plan``: as ``QuantizedPrecision(MODE)`` at fit start (its convolutions' plan measured on another
batch of 4 images: the most sensitive convolutions widened to ``nf4-dq-b32`` or ``int8`` until the probe output cosine
reaches 0.98); ``bf16``: the whole model cast.

Models: ResNet18 and EfficientNet-B0 at their real layouts (``tests/layers/conv_models.py``), a YOLO-style detector
(Conv-BN-SiLU, CSP blocks, SPPF, FPN/PAN neck, three heads; about YOLOv8n's widths) and a MobileNetV3-style FPN
backbone (depthwise convs, squeeze-excite, hardswish), both hand-written here.

    OMP_NUM_THREADS=1 python benchmarks/conv_accuracy.py [--modes nf4-dq nf4-dq-b32 int8] [--models ResNet18 ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import coverage
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.quantization import Quantization

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import EfficientNetB0, MobileNetV3FPN, ResNet18, YoloDetector, calibrate, images  # noqa: E402

MODELS: dict[str, Callable[[], nn.Module]] = {
    "ResNet18": ResNet18, "EfficientNet-B0": EfficientNetB0, "YOLO-style detector": YoloDetector,
    "MobileNetV3-FPN backbone": MobileNetV3FPN,
}  # fmt: skip


def calibrated_nets(models: list[str], seeds: list[int], probe_images: int = 4) -> Iterator[tuple[str, int, nn.Module, torch.Tensor, torch.Tensor]]:
    """Per model and seed: the name, the seed, the fp32 net with BatchNorm statistics calibrated on data (eval mode),
    its probe batch and its held-out batch (seed 0: this script's batches, probe 2 and held out 1)."""
    for name in models:
        for seed in seeds:
            torch.manual_seed(seed)
            reference = MODELS[name]()
            calibrate(reference, images(8, seed=10, batches=4))
            reference.eval()
            yield name, seed, reference, images(probe_images, seed=2 + 10 * seed), images(4, seed=1 + 10 * seed)


def flat(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output.flatten().float()
    return torch.cat([flat(o) for o in (output.values() if isinstance(output, dict) else output)])  # type: ignore[union-attr]


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    mean = want.mean()
    return F.cosine_similarity(got - mean, want - mean, dim=0).item()


def measure(name: str, modes: list[str], calibrated: bool) -> None:
    torch.manual_seed(0)
    reference = MODELS[name]()
    if calibrated:
        calibrate(reference, images(8, seed=10, batches=4))
    reference.eval()
    x, probe = images(4, seed=1), images(4, seed=2)  # held out: the plan is measured on another batch
    with torch.no_grad():
        want = flat(reference(x))
    stats = "calibrated" if calibrated else "initial"
    for mode in modes:
        model = copy.deepcopy(reference)
        if mode == "bf16":
            model = model.to(torch.bfloat16)
            with torch.no_grad():
                got = flat(model(x.to(torch.bfloat16)))
            print(f"| {name} | {stats} | {mode} | | 2.000 | {cosine(got, want):.4f} |")
            continue
        if mode.endswith("+plan"):  # as QuantizedPrecision(mode) at fit start: the convolutions' plan on a probe batch
            plan = Quantization(QuantizationConfig(mode[: -len("+plan")], "float32", probe_batch=probe), "QuantizedPrecision")
            plan.check(model, None)
            plan.convert(model, None)
        else:
            quantize_model(model, mode, dtype="float32")
        rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}
        conv = rows["Conv"]
        with torch.no_grad():
            got = flat(model(x))
        print(f"| {name} | {stats} | {mode} | {conv.params:,} | {conv.bytes / conv.params:.3f} | {cosine(got, want):.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["bf16", "nf4-dq", "nf4-dq-b32", "int8", "nf4-dq+plan"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--initial", action="store_true", help="also BatchNorm at its initial statistics")
    args = parser.parse_args()
    print("| model | BatchNorm statistics | mode | conv params | B/conv weight | output cosine |")
    print("|---|---|---|---:|---:|---:|")
    for name in args.models:
        for calibrated in (True, False) if args.initial else (True,):
            measure(name, args.modes, calibrated)


if __name__ == "__main__":
    main()
