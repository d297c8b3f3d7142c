"""The fit-start accuracy check and the 4-bit conv plan on detectors whose post-processing keeps the same number of
boxes as built and quantized (issue 53, session 27).

Two detectors, the YOLO-style net of ``tests/layers/conv_models.py`` (8 classes, BatchNorm calibrated on image-like
batches, seed 0), post-processed in ``forward``:

- ``top-20``: the 20 best-scoring cells of each image, in score order (``tests/precision/test_accuracy_selected.py``);
- ``NMS, threshold 0.5``: score threshold, NMS written plainly, top-50 (``tests/precision/test_accuracy_postprocessed.py``;
  at 0.5 the box count agrees as built and quantized).

Arms, each through ``QuantizedPrecision(...).convert_module`` on a probe of 4 images (64 px): ``int8`` in bf16 and in
fp32 (healthy), the default ``nf4-dq``, and ``nf4-dq`` with every convolution pinned (``layer_modes``: uniform, a
wrecked model). Per arm: the check's figure, where it was measured, whether it warned; for ``nf4-dq``, the plan's
uniform and planned figures and bytes per conv weight; and ``convert_module`` seconds (``int8`` fp32: median of 5).

``--overhead``: instead, the cost of recording the selections: one forward (eval, no grad) under ``recording_calls``,
with and without ``recording_selections``, median of 7, on the two detectors and ResNet18.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/selected_detector.py [--overhead]
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "layers"), str(ROOT / "tests" / "precision")]
from conv_models import ResNet18, calibrate, images  # noqa: E402
from test_accuracy_postprocessed import PostProcessed  # noqa: E402
from test_accuracy_selected import TopK  # noqa: E402

from lightning_hbm import QuantizedPrecision  # noqa: E402
from lightning_hbm.probe import recording_calls, recording_selections  # noqa: E402


def _built(model: nn.Module, net: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    calibrate(net, images(8, seed=10, batches=4))
    return model.eval()


def _arm(model: nn.Module, mode: str, dtype: str, **options: Any) -> str:
    plugin = QuantizedPrecision(mode, dtype=dtype, probe_batch=images(4, seed=2), **options)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        start = time.perf_counter()
        plugin.convert_module(copy.deepcopy(model))
        seconds = time.perf_counter() - start
    a, r = plugin.quantization.conv_accuracy, plugin.quantization.conv_report
    check = "not measured" if a is None else f"{a.cosine:.4f} at {a.measured_at or 'every output'}{', warned' if a.warned else ', quiet'}"
    plan = f"; plan {r.uniform_cosine:.3f} -> {r.cosine:.3f} at {r.bytes_per_param:.3f} B ({r.measured_at or 'output'})" if r is not None else ""
    return f"{check}{plan} ({seconds:.2f} s)"


def overhead(models: dict[str, nn.Module]) -> None:
    x = images(4, seed=2)

    def run(model: nn.Module, selections: bool) -> float:
        start = time.perf_counter()
        with torch.no_grad(), recording_calls(model, None, 4096) as calls:
            if selections:
                with recording_selections(calls):
                    model(x)
            else:
                model(x)
        return time.perf_counter() - start

    for name, model in models.items():
        run(model, True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(7):
            for selections in (False, True):
                times[selections].append(run(model, selections))
        without, with_ = (statistics.median(times[k]) * 1000 for k in (False, True))
        print(f"{name}: forward with its calls recorded {without:.1f} ms, with the selections too {with_:.1f} ms", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    if "--overhead" in sys.argv:
        torch.manual_seed(0)
        resnet = ResNet18()
        calibrate(resnet, images(8, seed=10, batches=2))
        torch.manual_seed(0)
        top = TopK()
        torch.manual_seed(0)
        nms = PostProcessed(threshold=0.5)
        overhead({"ResNet18": resnet, "top-20": _built(top, top.model), "NMS, threshold 0.5": _built(nms, nms.model)})
        return
    torch.manual_seed(0)
    top = TopK()
    torch.manual_seed(0)
    nms = PostProcessed(threshold=0.5)
    for name, model in (("top-20", _built(top, top.model)), ("NMS, threshold 0.5", _built(nms, nms.model))):
        convs = {n: "nf4-dq" for n, layer in model.named_modules() if isinstance(layer, nn.Conv2d)}
        for arm, args, options in (
            ("int8, bf16", ("int8", "bfloat16"), {}),
            ("int8, fp32", ("int8", "float32"), {}),
            ("default nf4-dq, bf16", ("nf4-dq", "bfloat16"), {}),
            ("nf4-dq pinned uniform, bf16", ("nf4-dq", "bfloat16"), {"layer_modes": convs}),
        ):
            print(f"| {name} | {arm} | {_arm(model, *args, **options)} |", flush=True)
        times = []
        for _ in range(5):
            plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=images(4, seed=2))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                start = time.perf_counter()
                plugin.convert_module(copy.deepcopy(model))
                times.append(time.perf_counter() - start)
        print(f"{name}: int8 fp32 convert_module median of 5: {statistics.median(times):.3f} s", flush=True)


if __name__ == "__main__":
    main()
