"""What ``QuantizedPrecision()`` (the library's default: ``nf4-dq``, bf16 compute) does to the conv nets of issue 53.

The four nets of ``conv_accuracy.py`` (BatchNorm statistics calibrated), per seed (the model's initialisation, a probe
batch of 4 images, a held-out batch of 4 the probe never saw; seed 0: ``conv_gptq.py``'s batches). Arms, each through
the plugin's own ``convert_module`` and forward context (bf16 compute, as in training):

- ``probe batch``: a Trainer with a datamodule (the plan is measured on its first batch) or ``probe_batch=``: the
  convolutions' plan to a probe output cosine of 0.985 (``CONV_TARGET_COSINE``; 0.98 before session 25);
- ``no probe``: ``trainer.fit(model, train_dataloaders=...)``, no datamodule and no ``probe_batch``: nothing measured;
- ``min_cosine=0.98`` (the default target before session 25) and ``min_cosine=0.985`` (these also plan the Linears);
- the fixes the warnings name: ``mode='int8'`` (bf16 and fp32 compute).

Per arm: held-out cosine (centred, every output of the model), bytes per conv weight, fit-start seconds (plan and
quantization), and the lightning_hbm warnings raised at conversion (their first words).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_default.py [--models ResNet18 ...] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers import coverage

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, calibrated_nets, cosine, flat  # noqa: E402


def run(reference: nn.Module, plugin: QuantizedPrecision, held: torch.Tensor) -> tuple[float, float, float, list[str]]:
    """(held-out cosine, bytes per conv weight, fit-start seconds, warnings) of ``reference`` converted by ``plugin``."""
    model = copy.deepcopy(reference)
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = plugin.convert_module(model)
    seconds = time.perf_counter() - start
    conv = {r.kind: r for r in coverage(model, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad(), plugin.forward_context():
        got = flat(plugin.convert_output(model(plugin.convert_input(held))))
    with torch.no_grad():
        want = flat(reference(held))
    said = [str(w.message)[:90] for w in caught if "lightning_hbm" in str(w.message)]
    return cosine(got, want), conv.bytes / conv.params, seconds, said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | arm | held-out cosine | B/conv weight | fit start (s) | warning at fit start |")
    print("|---|---:|---|---:|---:|---:|---|")
    for name, seed, reference, probe, held in calibrated_nets(args.models, args.seeds, 4):
        arms = (
            ("probe batch", QuantizedPrecision(probe_batch=probe)), ("no probe", QuantizedPrecision()),
            ("probe batch, min_cosine=0.98", QuantizedPrecision(probe_batch=probe, min_cosine=0.98)),
            ("probe batch, min_cosine=0.985", QuantizedPrecision(probe_batch=probe, min_cosine=0.985)),
            ("mode='int8'", QuantizedPrecision("int8", probe_batch=probe)),
            ("mode='int8', dtype='float32'", QuantizedPrecision("int8", dtype="float32", probe_batch=probe)),
        )  # fmt: skip
        for arm, plugin in arms:
            h, b, s, said = run(reference, plugin, held)
            print(f"| {name} | {seed} | {arm} | {h:.4f} | {b:.3f} | {s:.1f} | {'; '.join(said) or 'none'} |", flush=True)


if __name__ == "__main__":
    main()
