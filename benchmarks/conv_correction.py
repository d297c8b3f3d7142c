"""Does the calibrated correction on convolutions (``QuantizedPrecision(correction_rank=r)``) lift conv nets held out?

Issue 53 item 2's goal: held-out output cosine >= 0.98 at <= 0.6 bytes per conv weight on the four nets of
``conv_accuracy.py`` (BatchNorm statistics calibrated). The setup of ``conv_default.py`` (per seed: the model's
initialisation, a probe batch the plan and the correction are measured on, a held-out batch of 4 the probe never saw),
through the plugin's own ``convert_module`` and forward context (bf16 compute, as in training). Arms:

- ``default``: ``QuantizedPrecision(probe_batch=probe)``, the convolutions planned to a probe cosine of 0.985;
- ``default + cR``: the same with ``correction_rank=R`` (the plan as before, the correction fitted on top);
- ``nf4-dq + cR``: every convolution in ``nf4-dq`` (``min_cosine=0``: no widening) with the rank-``R`` correction;
- ``nf4-dq``: the same without correction (the reference of the correction's own gain).

Per arm: held-out cosine (centred, every output of the model), bytes per conv weight (the coverage table's: the
factors included), fit-start seconds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_correction.py [--models ResNet18 ...] [--seeds 0 1]
        [--ranks 8 16] [--probe-images 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_hbm import QuantizedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, calibrated_nets  # noqa: E402
from conv_default import run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--probe-images", type=int, default=4)
    parser.add_argument("--arms", nargs="+", default=["default", "default+c", "nf4-dq", "nf4-dq+c"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | arm | held-out cosine | B/conv weight | fit start (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for name, seed, reference, probe, held in calibrated_nets(args.models, args.seeds, args.probe_images):
        arms: list[tuple[str, QuantizedPrecision]] = []
        if "default" in args.arms:
            arms.append(("default", QuantizedPrecision(probe_batch=probe)))
        if "nf4-dq" in args.arms:
            arms.append(("nf4-dq", QuantizedPrecision(probe_batch=probe, min_cosine=0.0)))
        for rank in args.ranks:
            if "default+c" in args.arms:
                arms.append((f"default + c{rank}", QuantizedPrecision(probe_batch=probe, correction_rank=rank)))
            if "nf4-dq+c" in args.arms:
                arms.append((f"nf4-dq + c{rank}", QuantizedPrecision(probe_batch=probe, min_cosine=0.0, correction_rank=rank)))
        for arm, plugin in arms:
            h, b, s, _ = run(reference, plugin, held)
            print(f"| {name} | {seed} | {arm} | {h:.4f} | {b:.3f} | {s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
