"""GPTQ rounding and the calibrated correction of the Linears whose weight a model's code reads directly (issue 53).

torchvision Swin's attention hands ``self.qkv.weight`` / ``self.proj.weight`` to ``F.linear``: the layers are never
called, so the probe's forward hooks saw none of their inputs and ``rounding="gptq"`` / ``correction_rank`` left them
rounded to nearest, uncorrected. The probe now also records the inputs those reads multiply with
(``lightning_hbm.precision.gptq.input_statistics``). Measured on the Swin-like model of the tests
(``tests/layers/swin_models.py``: two stages of window attention, the second V2-flavoured; 8 of its 19 Linears are
read layers), nf4-dq, fp32 compute, before any training: relative error ``||y - y_fp32|| / ||y_fp32||`` of the logits
on 64 held-out images against the unquantized model, the probe another 64. "before" is the old behaviour, rebuilt by
dropping the read layers' statistics (what the old probe gave: none).

    OMP_NUM_THREADS=1 PYTHONPATH=.:tests/layers python benchmarks/read_layer_rounding.py [--seeds 0 1] [--rank 16]
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
from swin_models import SmallSwin, batch, read_layers
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.layers import base_layer, find_layers, readers
from lightning_hbm.precision.correction import CalibratedCorrection
from lightning_hbm.precision.gptq import input_statistics

ARMS = ("nearest", "gptq, before", "gptq", "gptq + correction, before", "gptq + correction")


def error(seed: int, arm: str, rank: int) -> float:
    """Held-out relative logit error of ``arm`` on the model of ``seed``."""
    torch.manual_seed(seed)
    model = SmallSwin().eval()
    readers.observe(model, batch(), {name: base_layer(layer) for name, layer, _ in find_layers(model)})  # the probe step
    probe, held_out = batch(100 + seed, size=64)[0], batch(200 + seed, size=64)[0]
    with torch.no_grad():
        reference = model(held_out)
    hessians: Optional[dict[str, torch.Tensor]] = None
    correct = None
    if arm != "nearest":
        hessians, rows = input_statistics(model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)], probe)
        if arm.endswith("before"):
            hessians = {n: h for n, h in hessians.items() if n not in read_layers(model)}
        if "correction" in arm:
            correct = CalibratedCorrection(rank, torch.float32)
            correct.measured(hessians, {n: r for n, r in rows.items() if n in hessians})
            correct.start()
    quantize_model(model, "nf4-dq", dtype="float32", hessians=hessians, correct=correct)
    with torch.no_grad():
        out = model(held_out)
    return float((out - reference).norm() / reference.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| arm | " + " | ".join(f"seed {s}" for s in args.seeds) + " |")
    print("|---|" + "---:|" * len(args.seeds))
    for arm in ARMS:
        print(f"| {arm} | " + " | ".join(f"{error(seed, arm, args.rank):.4f}" for seed in args.seeds) + " |")


if __name__ == "__main__":
    main()
