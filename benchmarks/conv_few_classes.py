"""A classifier with few classes: the conv plan measured on its logits as a batch, not per row (issue 53, session 34).

``compare_outputs`` (the figure the convolutions' mode choice reaches, ``CONV_TARGET_COSINE``) took one cosine per row of the
last axis: a head of 2-10 classes gave rows of 2-10 logits, uncentred, which read their common offset (a 2-class
ResNet18 plan at 0.993 on the probe while its quantized model measured 0.76 held out). Now a sample of fewer than
``FEW_VALUES`` (16) values is measured over the whole batch, flattened, centred on the reference's mean. Per model,
class count and seed: BatchNorm calibrated on 4 batches of 8 image-like 64 px inputs, a probe of 4 images, 64
held-out images; the plugin's own ``convert_module`` and forward context (the default: nf4-dq, bf16). Arms: ``rows``
(the metric before: ``probe.FEW_VALUES = 0``) and ``batch`` (now). Held out: centred cosine of the logits, top-1
agreement with the model as built, KL(p_fp || p_q) per sample.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_few_classes.py
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import QuantizedPrecision, probe
from lightning_hbm.layers import coverage
from lightning_hbm.precision.accuracy import centred_cosine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
import conv_models  # noqa: E402
from conv_models import Pixels, calibrate, images  # noqa: E402

SIZE = 64



def builders() -> dict[str, Callable[[int], nn.Module]]:
    import transformers as tf

    return {
        "ResNet18": conv_models.ResNet18,
        "EfficientNet-B0": conv_models.EfficientNetB0,
        "transformers ResNet": lambda classes: Pixels(tf.ResNetForImageClassification(
            tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=classes))),
    }


def row(name: str, classes: int, seed: int, metric: str, build: Callable[[int], nn.Module]) -> str:
    torch.manual_seed(seed)
    reference = calibrate(build(classes), images(8, seed=10 + seed, batches=4, size=SIZE))
    chosen, held = images(4, seed=2 + 10 * seed, size=SIZE), images(64, seed=100 + seed, size=SIZE)
    with torch.no_grad():
        want = reference(held).float()
    probe.FEW_VALUES = 0 if metric == "rows" else 16  # type: ignore[attr-defined]
    plugin = QuantizedPrecision(probe_batch=chosen)
    start = time.perf_counter()
    quantized = plugin.convert_module(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    probe.FEW_VALUES = 16  # type: ignore[attr-defined]
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad(), plugin.forward_context():
        got = quantized(plugin.convert_input(held)).float()
    report, checked = plugin.quantization.conv_report, plugin.quantization.conv_accuracy
    top1 = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    kl = float(F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean"))
    plan = f"{report.uniform_cosine:.4f} -> {report.cosine:.4f}" if report is not None else "-"
    check = f"{checked.cosine:.4f}{' warned' if checked.warned else ''}" if checked is not None else "-"
    return (f"| {name} | {classes} | {seed} | {metric} | {plan} | {conv.bytes / conv.params:.3f} | "
            f"{centred_cosine(got.flatten(), want.flatten()):.4f} | {top1:.3f} | {kl:.4f} | {check} | {seconds:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--classes", nargs="+", type=int, default=[2, 4, 10])
    parser.add_argument("--models", nargs="+", default=None)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| model | classes | seed | plan metric | plan on the probe | B/conv weight | held out: centred cosine | top-1 agreement | KL | fit-start check | fit start |")
    print("|---|---:|---:|---|---|---:|---:|---:|---:|---|---:|")
    for name, build in builders().items():
        if args.models and name not in args.models:
            continue
        for classes in args.classes:
            for seed in args.seeds:
                for metric in ("rows", "batch"):
                    print(row(name, classes, seed, metric, build), flush=True)


if __name__ == "__main__":
    main()
