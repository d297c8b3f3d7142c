"""Does the fit-start accuracy check read what held-out data reads? (issue 53 item 2, session 34)

The default 4-bit convolutions' plan chooses its layer modes on the probe batch, and the fit-start check
(``precision/accuracy.py``) measured the quantized model on that same batch: timm EfficientNet-B0 seed 1 read 0.9825
there (quiet, threshold 0.98) and 0.9535 held out (session 33, ``conv_torchvision_timm.py``). Per model and seed
(BatchNorm calibrated on 4 batches of 8 image-like 64 px inputs, as ``conv_torchvision_timm.py``), a probe of 4 images
and 16 held-out images the probe never saw, through the plugin's own ``convert_module`` and forward context (bf16):

- ``plan on 4``: ``QuantizedPrecision(probe_batch=probe)`` (the default before); its check on the 4 images the plan
  chose on, and the same quantized model's figure on each half of the probe;
- ``plan on 2``: the plan chooses on the probe's first 2 images and the check measures the last 2 (the split).

Figures: centred cosine of every output, flattened (the check's metric), on the batch named; "held out 16": the
truth the check should predict. ``--models`` picks by name; torchvision / timm need the throw-away install of
``conv_torchvision_timm.py`` and ``--schema-shim``:

    PYTHONPATH=.:/tmp/tvsite OMP_NUM_THREADS=1 python benchmarks/conv_check_heldout.py --schema-shim

``--batches``: is it the probe's images or the plan's choice? The plan is chosen on each of three batches of 4 (the
probe above and two others) and every quantized model measured on each of four batches of 4 (``--models`` names them):

    PYTHONPATH=.:/tmp/tvsite OMP_NUM_THREADS=1 python benchmarks/conv_check_heldout.py --schema-shim --batches \
        --models "timm efficientnet_b0" "MobileNetV3-FPN backbone"
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

if "--schema-shim" in sys.argv:  # before lightning: torchmetrics imports torchvision where it is installed
    _SHIM = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _SHIM.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

from torch import nn  # noqa: E402

from lightning_hbm import QuantizedPrecision  # noqa: E402
from lightning_hbm.layers import coverage  # noqa: E402
from lightning_hbm.precision.accuracy import centred_cosine, outputs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
import conv_models  # noqa: E402
from conv_models import Pixels, calibrate, images  # noqa: E402

SIZE = 64



def builders() -> dict[str, Callable[[], nn.Module]]:
    import transformers as tf

    found: dict[str, Callable[[], nn.Module]] = {
        "ResNet18": conv_models.ResNet18,
        "EfficientNet-B0": conv_models.EfficientNetB0,
        "YOLO-style detector": conv_models.YoloDetector,
        "MobileNetV3-FPN backbone": conv_models.MobileNetV3FPN,
        "transformers MobileNetV2 (10 classes)": lambda: Pixels(tf.MobileNetV2ForImageClassification(
            tf.MobileNetV2Config(image_size=SIZE, depth_multiplier=0.35, num_labels=10))),
        "transformers ResNet (10 classes)": lambda: Pixels(tf.ResNetForImageClassification(
            tf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10))),
        "transformers ConvNeXt (10 classes)": lambda: Pixels(tf.ConvNextForImageClassification(
            tf.ConvNextConfig(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 2, 1], num_labels=10))),
    }
    try:
        import timm
        import torchvision
    except Exception:  # noqa: BLE001 - not installed: the other models
        return found
    found["torchvision mobilenet_v2"] = torchvision.models.mobilenet_v2
    found["torchvision resnet18"] = torchvision.models.resnet18
    found["timm efficientnet_b0"] = lambda: timm.create_model("efficientnet_b0", pretrained=False)
    return found


def computed(plugin: QuantizedPrecision, quantized: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), plugin.forward_context():
        return outputs(plugin.convert_output(quantized(plugin.convert_input(x))))


def arm(reference: nn.Module, chosen: torch.Tensor, batches: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    plugin = QuantizedPrecision(probe_batch=chosen)
    start = time.perf_counter()
    quantized = plugin.convert_module(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]
    figures = {name: centred_cosine(computed(plugin, quantized, x), want[name]) for name, x in batches.items()}
    checked = plugin.quantization.conv_accuracy
    return {"figures": figures, "bytes": conv.bytes / conv.params, "seconds": seconds,
            "check": checked.cosine if checked is not None else float("nan"), "check_s": checked.seconds if checked is not None else 0.0}


def by_batch(name: str, build: Callable[[], nn.Module], seed: int) -> None:
    torch.manual_seed(seed)
    reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
    drawn = {s: images(4, seed=s, size=SIZE) for s in (2 + 10 * seed, 500, 501, 502)}
    with torch.no_grad():
        want = {s: outputs(reference(x)) for s, x in drawn.items()}
    for chosen in list(drawn)[:3]:
        plugin = QuantizedPrecision(probe_batch=drawn[chosen])
        quantized = plugin.convert_module(copy.deepcopy(reference))
        figures = " / ".join(f"{centred_cosine(computed(plugin, quantized, x), want[s]):.4f}" for s, x in drawn.items())
        print(f"| {name} | {seed} | images seed {chosen} | {figures} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--schema-shim", action="store_true", help="define torchvision::nms and ::qnms first (read at import)")
    parser.add_argument("--batches", action="store_true", help="the plan chosen on each of 3 batches, measured on 4 (above)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.batches:
        print("| model | seed | plan chosen on | check on images seed 2 + 10 x seed / 500 / 501 / 502 |")
        print("|---|---:|---|---|")
        for name, build in builders().items():
            for seed in args.seeds if not args.models or name in args.models else ():
                by_batch(name, build, seed)
        return
    print("| model | seed | arm | check (batch) | probe halves 1 / 2 | held out 16 | B/conv weight | fit start | check |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    for name, build in builders().items():
        if args.models and name not in args.models:
            continue
        for seed in args.seeds:
            torch.manual_seed(seed)
            reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
            probe, held = images(4, seed=2 + 10 * seed, size=SIZE), images(16, seed=100 + seed, size=SIZE)
            batches = {"first 2": probe[:2], "last 2": probe[2:], "held 16": held}
            with torch.no_grad():
                want = {k: outputs(reference(x)) for k, x in batches.items()}
            four = arm(reference, probe, batches, want)
            f = four["figures"]
            print(f"| {name} | {seed} | plan on 4 | {four['check']:.4f} (probe 4) | {f['first 2']:.4f} / {f['last 2']:.4f} | "
                  f"{f['held 16']:.4f} | {four['bytes']:.3f} | {four['seconds']:.1f} s | {four['check_s']:.2f} s |", flush=True)
            two = arm(reference, probe[:2], batches, want)
            f = two["figures"]
            print(f"| {name} | {seed} | plan on 2 | {f['last 2']:.4f} (last 2) | {f['first 2']:.4f} / {f['last 2']:.4f} | "
                  f"{f['held 16']:.4f} | {two['bytes']:.3f} | {two['seconds']:.1f} s | {two['check_s']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
