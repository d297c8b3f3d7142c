"""torchvision's ``mobilenet_v2`` and ``resnet18`` and timm's ``efficientnet_b0`` (from their builders, no weights)
with their convolutions stored quantized (issue 53 item 2, session 33).

Neither library is a dependency, and on this CPU dev machine neither imports as installed: the torchvision built for
torch 2.13 (0.28.0, offline from the machine's package mirror) is a CUDA build whose ``_C.so`` needs
``libtorch_cuda.so``, absent beside torch 2.13.0+cpu, so its import fails registering fake kernels for two of its ops
(``operator torchvision::nms does not exist``), and timm imports torchvision. These models use none of its ops:
``--schema-shim`` defines the two ops' schemas first (nothing else; a call of them would fail), so the import succeeds.
Install into a throw-away folder, never beside the project:

    pip install --target /tmp/tvsite --no-deps torchvision==0.28.0 timm
    PYTHONPATH=.:/tmp/tvsite OMP_NUM_THREADS=1 python benchmarks/conv_torchvision_timm.py --schema-shim

Per model and seed: BatchNorm calibrated on 4 batches of 8 image-like 64 px inputs (``tests/layers/conv_models.py``),
a probe batch of 4, a held-out batch of 4 it never saw (as ``conv_mobilenet_v2.py``). Arms, through the plugin's own
``convert_module`` and forward context: the default (``QuantizedPrecision()``: nf4-dq, bf16, the plan to
``CONV_TARGET_COSINE``), ``mode="int8", dtype="float32"``, and ``dtype="float32", sensitive_mode=["nf4-dq-b32", "int8",
"none"], min_cosine=0.99``. Per arm: held-out centred cosine of the logits, bytes per conv weight, the plan's probe
figures, the fit-start check's figure (on the probe; "warned" under its threshold: 0.98, or ``min_cosine``).
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

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from lightning_hbm import QuantizedPrecision  # noqa: E402
from lightning_hbm.layers import coverage  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import calibrate, images  # noqa: E402

SIZE = 64
LADDER = ["nf4-dq-b32", "int8", "none"]
ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "int8, float32": dict(mode="int8", dtype="float32"),
    "float32, 'none' in the ladder, min_cosine=0.99": dict(dtype="float32", sensitive_mode=LADDER, min_cosine=0.99),
}


def builders() -> dict[str, Callable[[], nn.Module]]:
    import timm
    import torchvision

    return {
        "torchvision mobilenet_v2": torchvision.models.mobilenet_v2,
        "torchvision resnet18": torchvision.models.resnet18,
        "timm efficientnet_b0": lambda: timm.create_model("efficientnet_b0", pretrained=False),
    }


def cosine(got: torch.Tensor, want: torch.Tensor) -> float:
    mean = want.mean()
    return F.cosine_similarity(got.flatten().float() - mean, want.flatten() - mean, dim=0).item()


def row(name: str, seed: int, arm: str, reference: nn.Module, probe: torch.Tensor, held: torch.Tensor, want: torch.Tensor) -> str:
    plugin = QuantizedPrecision(**{"probe_batch": probe, **ARMS[arm]})
    start = time.perf_counter()
    quantized = plugin.convert_module(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad(), plugin.forward_context():
        got = plugin.convert_output(quantized(plugin.convert_input(held)))
    report, checked = plugin.quantization.conv_report, plugin.quantization.conv_accuracy
    plan = f"{report.uniform_cosine:.4f} -> {report.cosine:.4f}" if report is not None else "-"
    check = f"{checked.cosine:.4f}{' warned' if checked.warned else ''}" if checked is not None else "-"
    return f"| {name} | {seed} | {arm} | {cosine(got, want):.4f} | {conv.bytes / conv.params:.3f} | {plan} | {check} | {seconds:.0f} s |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--schema-shim", action="store_true", help="define torchvision::nms and ::qnms first (see above; read at import)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print("| model | seed | arm | held-out cosine | bytes per conv weight | plan on the probe | fit-start check | fit start |")
    print("|---|---:|---|---:|---:|---|---|---:|")
    for name, build in builders().items():
        for seed in args.seeds:
            torch.manual_seed(seed)
            reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
            probe, held = images(4, seed=2 + 10 * seed, size=SIZE), images(4, seed=1 + 10 * seed, size=SIZE)
            with torch.no_grad():
                want = reference(held)
            for arm in ARMS:
                print(row(name, seed, arm, reference, probe, held, want), flush=True)


if __name__ == "__main__":
    main()
