"""Two questions left by issue 53 item 2 (conv nets at <= 0.6 bytes per conv weight, held-out cosine >= 0.98):

- **ordering ceiling**: is the miss the probe's ranking of the layers? The plan under ``max_bytes_per_param=0.6``
  chosen on the held-out batch itself (``choose_layer_modes``'s knapsack fed the very images it is scored on: the best any
  sensitivity estimate could do with nf4-dq / nf4-dq-b32 / int8), against the plan chosen on the probe;
- **compute in float32**: the library's default (``QuantizedPrecision(probe_batch=...)``: nf4-dq, bf16 compute, the
  convolutions planned to ``CONV_TARGET_COSINE``) against the same with ``dtype="float32"`` (the plan measured and the
  model run in float32), through the plugin's ``convert_module`` and forward context as ``conv_default.py``;
- **depthwise convolutions**: their share of the conv weights' bytes against their share of the error (only they in
  nf4-dq, the rest float32), and the 0.6 B plan with every depthwise conv in int8 and the rest planned to the bytes
  left.

Same nets, calibrated BatchNorm statistics, seeds and batches as ``conv_probe.py`` (probe of 4, held out 16),
float32 compute (storage is what is counted).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_ceiling.py [--models ...] [--seeds 0 1] [--compute]
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

from lightning_hbm import QuantizedPrecision, quantize_model
from lightning_hbm.layers import kind_of
from lightning_hbm.precision.sensitivity import choose_layer_modes, weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, cosine, flat  # noqa: E402
from conv_models import calibrate, images  # noqa: E402
from conv_probe import conv_bytes, cosines  # noqa: E402


def depthwise(conv: nn.Conv2d) -> bool:
    return conv.groups > 1 and conv.groups == conv.in_channels


def stored(reference: nn.Module, modes: dict[str, str]) -> nn.Module:
    model = copy.deepcopy(reference)
    quantize_model(model, "nf4-dq", dtype="float32", layer_modes=modes)
    return model


def planned(reference: nn.Module, names: list[str], probe: torch.Tensor, budget: float) -> dict[str, str]:
    plan = choose_layer_modes(reference, names, "nf4-dq", "auto", "float32", probe, max_bytes_per_param=budget, strict=False)
    return dict(plan.modes)


def plugin_rows(name: str, seed: int, reference: nn.Module, probe: torch.Tensor) -> None:
    """The default plugin in bf16 and in float32: held out 4 (``conv_default.py``'s batch) and 16."""
    held = (images(4, seed=1 + 10 * seed), images(16, seed=3 + 10 * seed))
    for label, plugin in (
        ("default (bf16 compute)", QuantizedPrecision(probe_batch=probe)),
        ("default, dtype='float32'", QuantizedPrecision(dtype="float32", probe_batch=probe)),
    ):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = plugin.convert_module(copy.deepcopy(reference))
        seconds = time.perf_counter() - start
        got = []
        for x in held:
            with torch.no_grad(), plugin.forward_context():
                out = flat(plugin.convert_output(model(plugin.convert_input(x))))
            with torch.no_grad():
                got.append(cosine(out, flat(reference(x))))
        print(f"| {name} | {seed} | {label} | held out 4: {got[0]:.4f} | {got[1]:.4f} | {conv_bytes(model):.3f} | | {seconds:.1f} |",
              flush=True)  # fmt: skip


def run(name: str, seed: int, compute: bool) -> None:
    torch.manual_seed(seed)
    reference = MODELS[name]()
    calibrate(reference, images(8, seed=10, batches=4))
    reference.eval()
    probe, held = images(4, seed=2 + 10 * seed), images(16, seed=3 + 10 * seed)
    if compute:
        plugin_rows(name, seed, reference, probe)
        return
    convs = {n: m for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)}
    dw = [n for n, m in convs.items() if depthwise(m)]
    rest = [n for n in convs if n not in dw]
    feats = {n: kind_of(m).features(m) for n, m in convs.items()}  # type: ignore[union-attr]
    params = {n: feats[n][0] * feats[n][1] for n in convs}
    total = sum(params.values())

    def row(label: str, modes: dict[str, str], seconds: float) -> None:
        model = stored(reference, modes)
        p, h = cosines(model, reference, (probe, held))
        widened = sum(m != "nf4-dq" for m in modes.values())
        print(f"| {name} | {seed} | {label} | {p:.4f} | {h:.4f} | {conv_bytes(model):.3f} | {widened}/{len(modes)} | {seconds:.1f} |",
              flush=True)  # fmt: skip

    for label, batch in (("budget 0.6, planned on the probe", probe), ("budget 0.6, planned on held out (ceiling)", held)):
        start = time.perf_counter()
        row(label, planned(reference, list(convs), batch, 0.6), time.perf_counter() - start)
    if not dw:
        return
    dw_int8 = sum(weight_bytes("int8", *feats[n], torch.float32) for n in dw)
    dw_nf4 = sum(weight_bytes("nf4-dq", *feats[n], torch.float32) for n in dw)
    all_nf4 = sum(weight_bytes("nf4-dq", *feats[n], torch.float32) for n in convs)
    only_dw = stored(reference, {n: ("nf4-dq" if n in dw else "none") for n in convs})
    uniform = stored(reference, dict.fromkeys(convs, "nf4-dq"))
    (_, h_dw), (_, h_all) = cosines(only_dw, reference, (probe, held)), cosines(uniform, reference, (probe, held))
    print(f"# {name} seed {seed}: {len(dw)} of {len(convs)} convs depthwise, {sum(params[n] for n in dw) / total:.1%} of "
          f"the conv weights, {dw_nf4 / all_nf4:.1%} of the nf4-dq bytes ({dw_int8 / total:.3f} B per conv weight in "
          f"int8); held out 1 - cosine with only them in nf4-dq {1 - h_dw:.4f}, all convs {1 - h_all:.4f}", flush=True)  # fmt: skip
    rest_params = sum(params[n] for n in rest)
    left = (0.6 * total - dw_int8) / rest_params
    start = time.perf_counter()
    modes = planned(reference, rest, probe, left)
    row(f"budget 0.6, depthwise int8, rest planned to {left:.3f} B", {**modes, **dict.fromkeys(dw, "int8")},
        time.perf_counter() - start)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--compute", action="store_true", help="only the bf16 / float32 compute rows")
    args = parser.parse_args()
    print("| model | seed | arm | probe cosine | held-out cosine (16) | B/conv weight | widened | plan (s) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        for name in args.models:
            run(name, seed, args.compute)


if __name__ == "__main__":
    main()
