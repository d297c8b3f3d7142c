"""How many probe samples does the fit-start conv check need to read what held-out data reads? (issue 53 item 2, session 35)

Session 34 (``conv_check_heldout.py``): the check on a probe of 4 images misses two runs of 20 against 16 held-out
images, and batches of 4 read up to 0.04 apart under one quantized model: the gap is which images the probe holds.
Here, per conv net and seed (BatchNorm calibrated as ``conv_check_heldout.py``), the probe is the first k training
batches of 4 images (the first is session 34's probe), N = 4 k images, through the plugin's own ``convert_module`` and
forward context (default: nf4-dq, bf16):

- ``plan on N``: ``QuantizedPrecision(probe_batch=<N images>)``: the convolutions' modes chosen and the check measured
  on the N images (the fit start of a probe of N);
- ``check on N``: the model the plan chose on the first 4 images quantized, measured on the N images (a check on N
  after a plan on the first batch: the cost of two forwards on N, the reference and the quantized model).

Held out: 16 images (session 34's) and 48 more, 64 in all. Figures: centred cosine of every output (the check's
metric). The times are ratios against the plan on 4 measured in the same process, interleaved.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_probe_samples.py --plans 4 16 32
    PYTHONPATH=.:/tmp/h2site OMP_NUM_THREADS=1 python benchmarks/conv_probe_samples.py --plans 4 16 32 --schema-shim \
        --models "torchvision mobilenet_v2" "torchvision resnet18" "timm efficientnet_b0"

(the second: ``pip install --target /tmp/h2site --no-deps torchvision==0.28.0 timm``, a throw-away folder).

``--fit``: the time to the first step through the Trainer (a loader of 10 batches of 4 images, the default plugin),
the check on 32 samples (now) against the first batch (``CHECK_SAMPLES = 0``: before), interleaved, median of 3:

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_probe_samples.py --fit --models ResNet18 "MobileNetV3-FPN backbone" \
        "transformers ResNet (10 classes)" "transformers ConvNeXt (10 classes)" --seeds 0

``--widened`` (session 36): per run, whether ``widened_convs_warning`` would be said, the check on the first 32 images
and 64 held out: is the caution a signal where the check on 32 is quiet? ``--fit-start``: issue 53's "what must show"
through the Trainer (every lightning_hbm warning at fit start, held out 64):

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_probe_samples.py --widened --seeds 0 1 2 3
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_probe_samples.py --fit-start --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_check_heldout import SIZE, builders, computed  # noqa: E402 - first: its --schema-shim runs before lightning
from conv_models import calibrate, images, lightning_net  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_hbm import QuantizedPrecision  # noqa: E402
from lightning_hbm.layers import coverage  # noqa: E402
from lightning_hbm.precision import quantization  # noqa: E402
from lightning_hbm.precision.accuracy import CHECK_SAMPLES, centred_cosine, outputs  # noqa: E402
from lightning_hbm.precision.sensitivity import CONV_MIN_COSINE, CONV_TARGET_COSINE, widened_convs_warning  # noqa: E402


def probe_images(seed: int, n: int) -> torch.Tensor:
    """The first n // 4 training batches of 4: session 34's probe first, then others."""
    batches = [images(4, seed=2 + 10 * seed, size=SIZE)] + [images(4, seed=300 + 10 * seed + j, size=SIZE) for j in range(1, n // 4)]
    return torch.cat(batches)


def plan(reference: nn.Module, probe: torch.Tensor) -> tuple[QuantizedPrecision, nn.Module, dict[str, Any]]:
    plugin = QuantizedPrecision(probe_batch=probe)
    start = time.perf_counter()
    quantized = plugin.convert_module(copy.deepcopy(reference))
    seconds = time.perf_counter() - start
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]
    checked = plugin.quantization.conv_accuracy
    return plugin, quantized, {"bytes": conv.bytes / conv.params, "seconds": seconds,
                               "check": checked.cosine if checked is not None else float("nan"), "warned": bool(checked and checked.warned)}


def check_on(plugin: QuantizedPrecision, quantized: nn.Module, reference: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """The check's figure on ``x`` and its cost: a reference forward and a quantized forward."""
    start = time.perf_counter()
    with torch.no_grad():
        want = outputs(reference(x))
    got = computed(plugin, quantized, x)
    return centred_cosine(got, want), time.perf_counter() - start


def run(name: str, build: Any, seed: int, plans: list[int], checks: list[int]) -> None:
    torch.manual_seed(seed)
    reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
    probe = probe_images(seed, max(plans + checks))
    held = torch.cat([images(16, seed=100 + seed, size=SIZE), images(48, seed=200 + seed, size=SIZE)])
    with torch.no_grad():
        want16, want64 = outputs(reference(held[:16])), outputs(reference(held))
    base_s = None
    for n in plans:
        plugin, quantized, got = plan(reference, probe[:n])
        h16 = centred_cosine(computed(plugin, quantized, held[:16]), want16)
        h64 = centred_cosine(computed(plugin, quantized, held), want64)
        base_s = got["seconds"] if n == plans[0] else base_s
        ratio = got["seconds"] / base_s if base_s else float("nan")
        print(f"| {name} | {seed} | plan on {n} | {got['check']:.4f}{' warned' if got['warned'] else ''} | {h16:.4f} | {h64:.4f} | "
              f"{got['bytes']:.3f} | {got['seconds']:.1f} s ({ratio:.2f}x) |", flush=True)
        if n == plans[0]:
            for m in checks:
                figure, seconds = check_on(plugin, quantized, reference, probe[:m])
                print(f"| {name} | {seed} | plan on {n}, check on {m} | {figure:.4f} | {h16:.4f} | {h64:.4f} | "
                      f"{got['bytes']:.3f} | +{seconds:.2f} s ({(got['seconds'] + seconds) / base_s:.2f}x) |", flush=True)


def widened(name: str, build: Any, seed: int) -> dict[str, Any]:
    """``--widened``: one fit start as the library runs it (modes chosen on the first batch of 4, the check on the first
    32 images) and what each of its two signals says: ``widened_convs_warning`` (the modes reached the target on the
    probe only by widening some convolutions) and the check on 32 (under 0.98: warned); the truth, 64 held-out images."""
    torch.manual_seed(seed)
    reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
    probe = probe_images(seed, CHECK_SAMPLES)
    held = torch.cat([images(16, seed=100 + seed, size=SIZE), images(48, seed=200 + seed, size=SIZE)])
    with torch.no_grad():
        want = outputs(reference(held))
    plugin, quantized, got = plan(reference, probe[:4])
    report = plugin.quantization.conv_report
    gap = report is not None and widened_convs_warning(reference, report, "nf4-dq", CONV_TARGET_COSINE, CONV_MIN_COSINE) is not None
    check, _ = check_on(plugin, quantized, reference, probe)
    truth = centred_cosine(computed(plugin, quantized, held), want)
    quiet, accurate = check >= CONV_MIN_COSINE, truth >= CONV_MIN_COSINE
    case = "-" if not gap or not quiet else "(a) only signal of a loss" if not accurate else "(b) fires on an accurate model"
    modes = "" if report is None else f"{report.uniform_cosine:.4f} -> {report.cosine:.4f}"
    print(f"| {name} | {seed} | {modes} | {got['bytes']:.3f} | {'fires' if gap else 'quiet'} | {check:.4f}{'' if quiet else ' (w)'} | "
          f"{truth:.4f} | {case} |", flush=True)
    return {"gap": gap, "quiet": quiet, "accurate": accurate}


def widened_table(names: list[str], seeds: list[int]) -> None:
    print("| model | seed | probe cosine, uniform -> modes (4 images) | B/conv weight | widened_convs_warning | check on 32 | held out 64 | |")
    print("|---|---:|---|---:|---|---:|---:|---|")
    runs = [widened(name, build, seed) for name, build in builders().items() if not names or name in names for seed in seeds]
    fired = [r for r in runs if r["gap"] and r["quiet"]]
    print(f"\n{len(runs)} runs; widened_convs_warning said (check quiet) on {len(fired)}: (a) {sum(not r['accurate'] for r in fired)} "
          f"with held out under {CONV_MIN_COSINE}, (b) {sum(r['accurate'] for r in fired)} accurate; check quiet and held out "
          f"under {CONV_MIN_COSINE}: {sum(r['quiet'] and not r['accurate'] for r in runs)}; check warned and held out at or above: "
          f"{sum(not r['quiet'] and r['accurate'] for r in runs)}")


def fit_start(name: str, build: Any, seed: int) -> None:
    """``--fit-start``: issue 53's "what must show" through the Trainer (the default plugin, a loader of the 8 batches
    of ``probe_images`` and 2 more, ``max_steps=0``: the surgery, no step): every lightning_hbm warning said at fit
    start, and the quantized model's centred cosine on 64 held-out images. Verdict "ok": held out at or above 0.98,
    or a warning that names a figure and a fix."""
    torch.manual_seed(seed)
    reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
    batches = list(probe_images(seed, CHECK_SAMPLES).split(4)) + [images(4, seed=400 + 10 * seed + j, size=SIZE) for j in range(2)]
    held = torch.cat([images(16, seed=100 + seed, size=SIZE), images(48, seed=200 + seed, size=SIZE)])
    with torch.no_grad():
        want = outputs(reference(held))
    plugin = QuantizedPrecision()
    trainer = Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[plugin])  # fmt: skip
    net = lightning_net(copy.deepcopy(reference))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(net, DataLoader(batches, batch_size=None))
    said = [str(w.message) for w in caught if str(w.message).startswith("lightning_hbm")]
    kinds = {"has a cosine of": "check", "planned to a probe output cosine": "widened caution", "widest plan of sensitive_mode": "missed target"}
    named = [next((k for s, k in kinds.items() if s in m), m[:60]) for m in said]
    truth = centred_cosine(computed(plugin, net.model, held), want)
    checked = plugin.quantization.conv_accuracy
    figure = f"{checked.cosine:.4f} on {checked.samples}" if checked is not None else "-"
    fixed = all("Fix" in m or "fix" in m for m in said)
    verdict = "ok" if truth >= CONV_MIN_COSINE or (said and fixed) else "SILENT LOSS"
    print(f"| {name} | {seed} | {figure} | {', '.join(named) or 'none'} | {truth:.4f} | {verdict} |", flush=True)


def fit_seconds(reference: nn.Module, samples: int, seed: int) -> float:
    """Wall seconds of ``trainer.fit`` to its first step (``max_steps=1``, the default plugin) on a loader of 10 batches
    of 4 images, the check on ``samples`` (0: the first batch, as before session 35)."""
    quantization.CHECK_SAMPLES = samples
    trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[QuantizedPrecision()])  # fmt: skip
    loader = DataLoader([images(4, seed=300 + 10 * seed + j, size=SIZE) for j in range(10)], batch_size=None)
    start = time.perf_counter()
    trainer.fit(lightning_net(copy.deepcopy(reference)), loader)
    return time.perf_counter() - start


def fits(names: list[str], seeds: list[int], repeats: int) -> None:
    """``--fit``: the time to the first step with the check on 32 samples against the first batch, interleaved."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print("| model | seed | time to the first step: first batch (before) / 32 samples (now), median of each | ratio |")
    print("|---|---:|---|---:|")
    for name, build in builders().items():
        for seed in seeds if not names or name in names else ():
            torch.manual_seed(seed)
            reference = calibrate(build(), images(8, seed=10 + seed, batches=4, size=SIZE))
            fit_seconds(reference, 0, seed)  # warm-up
            times: dict[int, list[float]] = {0: [], 32: []}
            for _ in range(repeats):
                for samples in (0, 32):
                    times[samples].append(fit_seconds(reference, samples, seed))
            before, now = (statistics.median(times[k]) for k in (0, 32))
            print(f"| {name} | {seed} | {before:.1f} s / {now:.1f} s | {now / before:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--plans", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--checks", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--schema-shim", action="store_true", help="torchvision / timm: see conv_check_heldout.py")
    parser.add_argument("--fit", action="store_true", help="the time to the first step, check on 32 samples vs the first batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--widened", action="store_true", help="widened_convs_warning against the check on 32, held out 64")
    parser.add_argument("--fit-start", action="store_true", help="the warnings said at a Trainer's fit start, held out 64")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.fit_start:
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        print("| model | seed | fit-start check | lightning_hbm warnings at fit start | held out 64 | |")
        print("|---|---:|---|---|---:|---|")
        for name, build in builders().items():
            for seed in args.seeds if not args.models or name in args.models else ():
                fit_start(name, build, seed)
        return
    if args.widened:
        widened_table(args.models or [], args.seeds)
        return
    if args.fit:
        fits(args.models or [], args.seeds, args.repeats)
        return
    print("| model | seed | arm | check | held out 16 | held out 64 | B/conv weight | fit start (x plan on 4) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name, build in builders().items():
        if args.models and name not in args.models:
            continue
        for seed in args.seeds:
            run(name, build, seed, args.plans, args.checks)


if __name__ == "__main__":
    main()
