"""The conv nets at equal bytes: the calibrated correction against spending the same bytes otherwise (issue 53).

Issue 53's goal: held-out output cosine >= 0.98 at <= 0.6 bytes per conv weight on the four nets of
``conv_accuracy.py``. Session 41 measured the correction on top of the default plan (0.8-1.0 B); here every arm is held
to one budget, ``--budget`` bytes per quantized weight (factors and quantization constants included: the plan's own
count, ``max_bytes_per_param``), through the plugin's ``convert_module`` and forward context (bf16 compute). The setup
of ``conv_correction.py`` (per seed: the model's initialisation, calibrated BatchNorm, a probe batch of
``--probe-images`` images the plan and the correction are measured on, a held-out batch of 4 the probe never saw). Arms:

- ``nf4-dq``, ``nf4-dq-b32``: every quantized layer in that mode (``min_cosine=0``: no widening; 0.54 / 0.56 B);
- ``int8 ends``: ``nf4-dq``, the first and the last convolution in ``int8`` (``layer_modes``);
- ``plan``: the sensitivity plan under the budget (``max_bytes_per_param=budget``: the most sensitive layers widened
  to ``nf4-dq-b32`` / ``int8`` until the bytes are spent);
- ``plan + cR``: the same with ``correction_rank=R``, the factors counted in the budget (less is left to widen);
- ``... gptq``: the same with ``rounding="gptq"`` (no bytes: the same formats rounded on the probe).

Per arm: held-out cosine (centred, every output), bytes per conv weight (the coverage table's, factors included),
fit-start seconds.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_equal_bytes.py [--models ResNet18 ...] [--seeds 0 1]
        [--budget 0.6] [--ranks 4 8] [--probe-images 16] [--arms nf4-dq nf4-dq-b32 int8-ends plan plan+c]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_hbm import QuantizedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, calibrated_nets  # noqa: E402
from conv_default import run  # noqa: E402

ARMS = ["nf4-dq", "nf4-dq-b32", "int8-ends", "plan", "plan+c", "plan+gptq", "plan+c+gptq"]


def ends(model: nn.Module) -> dict[str, str]:
    """The first and the last convolution of ``model`` (module order) in int8."""
    convs = [name for name, sub in model.named_modules() if isinstance(sub, nn.Conv2d)]
    return {convs[0]: "int8", convs[-1]: "int8"}


def arms(args: argparse.Namespace, reference: nn.Module, probe: torch.Tensor) -> list[tuple[str, dict[str, Any]]]:
    """The arms asked for, as ``QuantizedPrecision`` settings."""
    budget = {"max_bytes_per_param": args.budget}
    out: list[tuple[str, dict[str, Any]]] = []
    for arm in args.arms:
        if arm in ("nf4-dq", "nf4-dq-b32"):
            out.append((arm, {"mode": arm, "min_cosine": 0.0}))
        elif arm == "int8-ends":
            out.append(("int8 ends", {"layer_modes": ends(reference)}))
        elif arm in ("plan", "plan+gptq"):
            out.append((arm, {**budget, **({"rounding": "gptq"} if "gptq" in arm else {})}))
        else:  # plan+c, plan+c+gptq
            gptq = {"rounding": "gptq"} if "gptq" in arm else {}
            out += [(arm.replace("+c", f" + c{r}"), {**budget, **gptq, "correction_rank": r}) for r in args.ranks]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--budget", type=float, default=0.6)
    parser.add_argument("--ranks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--probe-images", type=int, default=16)
    parser.add_argument("--arms", nargs="+", default=ARMS[:5], choices=ARMS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | arm | held-out cosine | B/conv weight | fit start (s) |")
    print("|---|---:|---|---:|---:|---:|")
    for name, seed, reference, probe, held in calibrated_nets(args.models, args.seeds, args.probe_images):
        for arm, settings in arms(args, reference, probe):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the figures are the point here; run() records lightning_hbm's
                    h, b, s, _ = run(reference, QuantizedPrecision(probe_batch=probe, **settings), held)
            except ValueError as err:  # a budget the plan cannot meet: said, not a row
                print(f"| {name} | {seed} | {arm} | ValueError: {str(err)[:120]} | | |", flush=True)
                continue
            print(f"| {name} | {seed} | {arm} | {h:.4f} | {b:.3f} | {s:.1f} |", flush=True)


if __name__ == "__main__":
    main()
