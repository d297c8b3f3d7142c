"""transformers' MobileNetV2 with its convolutions stored quantized (issue 53 item 2, session 33).

``MobileNetV2Model`` from a small config (``image_size=64, depth_multiplier=0.35``: 52 convolutions, 17 of them
depthwise), BatchNorm statistics calibrated on 4 batches of 8 image-like inputs (``tests/layers/conv_models.py``'s
``calibrate``), then a probe batch of 4 images for the plan and a held-out batch of 4 it never saw. Per arm, through the
plugin's own ``convert_module`` and forward context (as in training): the held-out centred cosine of the output
(``last_hidden_state``, ``[4, 1280, 2, 2]``) against the model as built, the bytes per conv weight (constants included,
exact), the plan's probe figures (uniform -> planned) and its modes.

Arms: ``default`` (``QuantizedPrecision()``: nf4-dq, bfloat16 compute, the plan to ``CONV_TARGET_COSINE``);
``bf16, none quantized`` (the compute dtype's own loss: every convolution kept); ``int8, float32``;
``float32, 'none' in the ladder`` (``sensitive_mode=['nf4-dq-b32', 'int8', 'none']``, to the default target, and to
``min_cosine=0.99``). Sensitivity of the model as built (``#`` lines): the held-out cosine after every conv weight is
multiplied by ``1 + e * N(0, 1)`` (``e = 2**-9``, bf16's rounding; ``2**-7``).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_mobilenet_v2.py [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers import coverage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import calibrate, images  # noqa: E402

SIZE = 64
LADDER = ["nf4-dq-b32", "int8", "none"]


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    mean = want.mean()
    return F.cosine_similarity(got.flatten().float() - mean, want.flatten() - mean, dim=0).item()


def model(seed: int) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    built = transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=SIZE, depth_multiplier=0.35))
    return calibrate(built, images(8, seed=10 + seed, batches=4, size=SIZE))


def arms(convs: list[str]) -> dict[str, dict[str, Any]]:
    return {
        "default": {},
        "bf16, none quantized": dict(mode="int8", ignore_modules=convs),
        "int8, float32": dict(mode="int8", dtype="float32"),
        "float32, 'none' in the ladder": dict(dtype="float32", sensitive_mode=LADDER),
        "float32, 'none' in the ladder, min_cosine=0.99": dict(dtype="float32", sensitive_mode=LADDER, min_cosine=0.99),
    }


def sensitivity(reference: nn.Module, held: torch.Tensor, want: torch.Tensor, seed: int) -> str:
    g = torch.Generator().manual_seed(5)
    said = []
    for e in (2**-9, 2**-7):
        noisy = copy.deepcopy(reference)
        with torch.no_grad():
            for layer in noisy.modules():
                if isinstance(layer, nn.Conv2d):
                    layer.weight.mul_(1 + e * torch.randn(layer.weight.shape, generator=g))
            said.append(f"2**{round(torch.tensor(e).log2().item())}: {cosine(noisy(pixel_values=held).last_hidden_state, want):.4f}")
    return f"# seed {seed}, conv weights times 1 + e * N(0, 1): " + ", ".join(said)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| arm | seed | held-out cosine | bytes per conv weight | plan on the probe (uniform -> planned) | modes | fit start |")
    print("|---|---:|---:|---:|---|---|---:|")
    notes = []
    for seed in args.seeds:
        reference = model(seed)
        probe, held = images(4, seed=2 + 10 * seed, size=SIZE), images(4, seed=1 + 10 * seed, size=SIZE)
        with torch.no_grad():
            want = reference(pixel_values=held).last_hidden_state
        convs = [n for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)]
        for arm, kwargs in arms(convs).items():
            plugin = QuantizedPrecision(**{"probe_batch": {"pixel_values": probe}, **kwargs})
            start = time.perf_counter()
            quantized = plugin.convert_module(copy.deepcopy(reference))
            seconds = time.perf_counter() - start
            rows = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}
            conv = rows["Conv"]
            with torch.no_grad(), plugin.forward_context():
                got = quantized(pixel_values=plugin.convert_input(held)).last_hidden_state
            report = plugin.quantization.conv_report
            plan = f"{report.uniform_cosine:.4f} -> {report.cosine:.4f}" if report is not None else "-"
            modes = ", ".join(f"{k} {v}" for k, v in sorted(Counter(report.modes.values()).items())) if report is not None else "-"
            bytes_per = conv.bytes / conv.params
            print(f"| {arm} | {seed} | {cosine(got, want):.4f} | {bytes_per:.3f} | {plan} | {modes} | {seconds:.1f} s |", flush=True)
        notes.append(sensitivity(reference, held, want, seed))
    print("\n".join(notes))


if __name__ == "__main__":
    main()
