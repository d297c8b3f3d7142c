"""Output channels, not layers, widened: int8 rows inside 4-bit convolutions (issue 53 item 2, session 37): measured, not in the library.

The conv plan widens whole convolutions (nf4-dq -> int8); at 0.6 bytes per conv weight its best ordering reached
0.94-0.97 held out on EfficientNet-B0 and the MobileNetV3-FPN backbone (session 26, ``conv_ceiling.py``). Under
calibrated BatchNorm each output channel is divided by its own data standard deviation, so a channel whose output
barely varies on the data turns its 4-bit weight error into noise as large as its signal (here up to 48x). Is the
loss in a few output channels that int8 rows could keep? Per conv net and seed (BatchNorm calibrated on 4 batches of 8
smooth 64-px images, probe of 4, held out 64: ``conv_probe_samples.py``'s batches), every convolution fake-quantized in
float32 to nf4 in blocks of 64 (bitsandbytes' layout, counted 0.516 B a weight as nf4-dq), then rows (output
channels) put in int8 (one absmax scale per row, counted 1.0 B a weight) until the budget, chosen by:

- ``nsr``: the row's error variance over its output variance on the probe (its noise-to-signal after BatchNorm), per
  weight of the row;
- ``layer``: that share of its layer's measured loss (1 - output cosine on the probe with only that layer in nf4),
  per weight of the row (the plan's per-layer measure, split over the layer's rows by their noise).

Also: the model in bf16 with BatchNorm kept in float32 (input cast up, output back): is it BatchNorm in 16 bits
that costs bf16's 0.005-0.011 on these nets? Figures: centred cosine of every output on the 64 held-out images.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_rows.py --models "MobileNetV3-FPN backbone" EfficientNet-B0 --seeds 0 1
    PYTHONPATH=.:/tmp/h2site OMP_NUM_THREADS=1 python benchmarks/conv_rows.py --schema-shim --models "timm efficientnet_b0"

(the second: ``pip install --target /tmp/h2site --no-deps torchvision==0.28.0 timm``, a throw-away folder). ``grad``
ranks rows by their first-order effect on the output (:func:`row_sensitivity`), the third ranking. ``--default``: the
library's default held out, as it computes and with every BatchNorm on float32 activations. ``--kinds``: which
convolutions lose the output (the first, depthwise, squeeze-excite, pointwise, dense kxk), each alone in nf4.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

if "--schema-shim" in sys.argv:  # timm imports torchvision, a CUDA build beside the CPU torch: conv_check_heldout.py
    _SHIM = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _SHIM.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
import conv_models  # noqa: E402
from conv_models import calibrate, images  # noqa: E402

from lightning_hbm.precision.accuracy import centred_cosine, outputs  # noqa: E402

NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])  # fmt: skip
BUILDERS = {"MobileNetV3-FPN backbone": conv_models.MobileNetV3FPN, "EfficientNet-B0": conv_models.EfficientNetB0, "ResNet18": conv_models.ResNet18}
NF4_B, INT8_B = 0.516, 1.0


def timm_efficientnet_b0() -> nn.Module:
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False)


BUILDERS["timm efficientnet_b0"] = timm_efficientnet_b0


def nf4(w: torch.Tensor, block: int = 64) -> torch.Tensor:
    flat = w.flatten()
    f = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)]).view(-1, block)
    a = f.abs().amax(1, keepdim=True).clamp_min(1e-12)
    return (NF4[(f / a).unsqueeze(-1).sub(NF4).abs().argmin(-1)] * a).flatten()[: flat.numel()].view_as(w)


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    r = w.flatten(1)
    a = r.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127
    return ((r / a).round().clamp(-127, 127) * a).view_as(w)


def fp32_statistics(model: nn.Module) -> nn.Module:
    """As ``QuantizedPrecision`` casts (``precision/quantize.py``): every BatchNorm kept float32 (weights and running
    statistics), given the bf16 activations (batch_norm computes inside in float32, returns bf16)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
    return model


def fp32_norms(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.float()
            m.register_forward_pre_hook(lambda m, a: (a[0].float(),))
            m.register_forward_hook(lambda m, a, o: o.to(torch.bfloat16))
    return model


def row_sensitivity(ref: nn.Module, probe: torch.Tensor, convs: dict[str, nn.Conv2d], quantized: dict[str, torch.Tensor], draws: int = 16) -> dict[str, torch.Tensor]:
    """Per row, the output's squared change from that row's nf4 error alone, to first order: ``E_r (g_r . e_row)^2``
    over random projections ``r`` of the output (Hutchinson's estimate of ``|J e_row|^2``, ``g_r`` the gradient of
    ``r . output`` in the weight): ``draws`` backward passes on the probe."""
    g = torch.Generator().manual_seed(0)
    found = {n: torch.zeros(m.weight.shape[0]) for n, m in convs.items()}
    weights = [m.weight for m in convs.values()]
    with torch.enable_grad():
        flat = outputs_with_grad(ref(probe))
        flat = flat - flat.mean()
        for _ in range(draws):
            r = torch.randn(flat.shape, generator=g)
            grads = torch.autograd.grad((r * flat).sum(), weights, retain_graph=True)
            for (n, m), gw in zip(convs.items(), grads):
                found[n] += ((gw * (quantized[n] - m.weight.detach())).flatten(1).sum(1)) ** 2 / draws
    return found


def outputs_with_grad(output: object) -> torch.Tensor:
    from torch.utils._pytree import tree_flatten

    return torch.cat([t.flatten() for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()])


@torch.no_grad()
def run(name: str, seed: int, budgets: list[float], ranks: list[str]) -> None:
    torch.manual_seed(seed)
    ref = calibrate(BUILDERS[name](), images(8, seed=10 + seed, batches=4, size=64))
    probe = images(4, seed=2 + 10 * seed, size=64)
    held = torch.cat([images(16, seed=100 + seed, size=64), images(48, seed=200 + seed, size=64)])
    want, on_probe = outputs(ref(held)), outputs(ref(probe))
    bf16 = centred_cosine(outputs(copy.deepcopy(ref).bfloat16()(held.bfloat16())), want)
    stats = centred_cosine(outputs(fp32_statistics(copy.deepcopy(ref).bfloat16())(held.bfloat16())), want)
    bf16_bn = centred_cosine(outputs(fp32_norms(copy.deepcopy(ref).bfloat16())(held.bfloat16())), want)
    print(f"| {name} | {seed} | bf16, nothing quantized: all bf16 / BatchNorm float32, 16-bit in and out (the "
          f"library's) / BatchNorm on float32 activations | {bf16:.4f} / {stats:.4f} / {bf16_bn:.4f} | 2.000 | |", flush=True)
    if not budgets:
        return
    convs = {n: m for n, m in ref.named_modules() if isinstance(m, nn.Conv2d)}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inputs.__setitem__(n, a[0])) for n, m in convs.items()]
    ref(probe)
    for h in hooks:
        h.remove()
    quantized = {n: nf4(m.weight) for n, m in convs.items()}
    rows: list[tuple[str, int, float, int]] = []  # layer, row, noise-to-signal, weights of the row
    loss = {}
    for n, m in convs.items():
        kw = dict(stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups)
        y, e = F.conv2d(inputs[n], m.weight, **kw), F.conv2d(inputs[n], quantized[n] - m.weight, **kw)
        nsr = e.transpose(0, 1).flatten(1).pow(2).mean(1) / y.transpose(0, 1).flatten(1).var(1).clamp_min(1e-20)
        rows += [(n, c, float(nsr[c]), m.weight[0].numel()) for c in range(m.weight.shape[0])]
        kept = m.weight.clone()
        m.weight.copy_(quantized[n])
        loss[n] = 1 - centred_cosine(outputs(ref(probe)), on_probe)
        m.weight.copy_(kept)
    total = sum(m.weight.numel() for m in convs.values())
    grad = row_sensitivity(ref, probe, convs, quantized) if "grad" in ranks else {}
    share = {n: sum(r[2] for r in rows if r[0] == n) for n in convs}
    nsr = torch.tensor([r[2] for r in rows])
    print(f"# {name} seed {seed}: {len(convs)} convs, {len(rows)} rows; row noise-to-signal 50/90/99 % / max: "
          f"{nsr.quantile(0.5):.3g} / {nsr.quantile(0.9):.3g} / {nsr.quantile(0.99):.3g} / {nsr.max():.3g}", flush=True)

    def evaluate(keep: dict[str, set[int]]) -> float:
        model = copy.deepcopy(ref)
        for n, m in model.named_modules():
            if n in quantized:
                w = quantized[n].clone()
                if keep.get(n):
                    idx = torch.tensor(sorted(keep[n]))
                    w[idx] = int8_rows(m.weight)[idx]
                m.weight.copy_(w)
        return centred_cosine(outputs(model(held)), want)

    print(f"| {name} | {seed} | every conv nf4 | {evaluate({}):.4f} | {NF4_B:.3f} | |", flush=True)
    for rank in ranks:
        score = {"nsr": lambda r: r[2] / r[3], "layer": lambda r: loss[r[0]] * r[2] / max(share[r[0]], 1e-20) / r[3],
                 "grad": lambda r: float(grad[r[0]][r[1]]) / r[3]}[rank]
        ordered = sorted(rows, key=score, reverse=True)
        for budget in budgets:
            extra, spent, keep = (budget - NF4_B) * total, 0.0, {}
            for n, c, _, length in ordered:
                if spent + (INT8_B - NF4_B) * length <= extra:
                    spent += (INT8_B - NF4_B) * length
                    keep.setdefault(n, set()).add(c)
            widened = sum(len(v) for v in keep.values())
            print(f"| {name} | {seed} | rows to int8 by {rank} | {evaluate(keep):.4f} | {NF4_B + spent / total:.3f} | "
                  f"{widened} of {len(rows)} rows |", flush=True)


def kind(name: str, conv: nn.Conv2d, first: str, spatial: int) -> str:
    if name == first:
        return "first conv"
    if conv.groups > 1 and conv.groups == conv.in_channels:
        return "depthwise"
    if spatial == 1:
        return "squeeze-excite (1x1 input)"
    return "pointwise 1x1" if conv.kernel_size == (1, 1) else "dense kxk"


@torch.no_grad()
def kinds(name: str, seed: int) -> None:
    """``--kinds``: which convolutions lose the output? Each kind alone in nf4 (the rest float32), held out 64; its
    share of the conv weights; and every convolution in nf4 but that kind."""
    torch.manual_seed(seed)
    ref = calibrate(BUILDERS[name](), images(8, seed=10 + seed, batches=4, size=64))
    held = torch.cat([images(16, seed=100 + seed, size=64), images(48, seed=200 + seed, size=64)])
    want = outputs(ref(held))
    convs = {n: m for n, m in ref.named_modules() if isinstance(m, nn.Conv2d)}
    sizes: dict[str, int] = {}
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: sizes.__setitem__(n, a[0].shape[-1] * a[0].shape[-2])) for n, m in convs.items()]
    ref(held[:1])
    for h in hooks:
        h.remove()
    first = next(iter(convs))
    by_kind: dict[str, list[str]] = {}
    for n, m in convs.items():
        by_kind.setdefault(kind(n, m, first, sizes[n]), []).append(n)
    total = sum(m.weight.numel() for m in convs.values())

    def with_nf4(names: list[str]) -> float:
        model = copy.deepcopy(ref)
        for n, m in model.named_modules():
            if n in names:
                m.weight.copy_(nf4(m.weight))
        return centred_cosine(outputs(model(held)), want)

    for k, names in by_kind.items():
        share = sum(convs[n].weight.numel() for n in names) / total
        rest = [n for n in convs if n not in names]
        print(f"| {name} | {seed} | {k} | {len(names)} | {100 * share:.1f} % | {with_nf4(names):.4f} | {with_nf4(rest):.4f} |", flush=True)


def default(name: str, seed: int, aware: bool = False) -> None:
    """``--default``: the library's default (``QuantizedPrecision(probe_batch=<4 images>)``: nf4-dq, its plan, bf16)
    held out, as it computes and with every BatchNorm on float32 activations (input cast up, output back to bf16)."""
    from lightning_hbm import QuantizedPrecision
    from lightning_hbm.layers import coverage

    torch.manual_seed(seed)
    ref = calibrate(BUILDERS[name](), images(8, seed=10 + seed, batches=4, size=64))
    held = torch.cat([images(16, seed=100 + seed, size=64), images(48, seed=200 + seed, size=64)])
    with torch.no_grad():
        want = outputs(ref(held))
    plugin = QuantizedPrecision(probe_batch=images(4, seed=2 + 10 * seed, size=64))
    quantized = plugin.convert_module(copy.deepcopy(ref))
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]

    def held_out() -> float:
        with torch.no_grad(), plugin.forward_context():
            return centred_cosine(outputs(plugin.convert_output(quantized(plugin.convert_input(held)))), want)

    before = held_out()
    for m in quantized.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(lambda m, a: (a[0].float(),))
            m.register_forward_hook(lambda m, a, o: o.to(torch.bfloat16))
    print(f"| {name} | {seed} | default: as computed / BatchNorm on float32 activations | {before:.4f} / {held_out():.4f} | "
          f"{conv.bytes / conv.params:.3f} | |", flush=True)
    if aware:
        dtype_aware(name, seed, ref, held, want)


def dtype_aware(name: str, seed: int, ref: nn.Module, held: torch.Tensor, want: torch.Tensor) -> None:
    """``--dtype-aware``: the plan's target raised by what the compute dtype loses on its own (the plan measures the
    rest of the model in float32): ``min_cosine = 0.985 + (1 - c)``, ``c`` the probe's cosine of the model as built
    computed in bf16 (BatchNorm float32, as the library casts) against float32; 1 - c at least 0.015: no target."""
    from lightning_hbm import QuantizedPrecision
    from lightning_hbm.layers import coverage

    probe = images(4, seed=2 + 10 * seed, size=64)
    with torch.no_grad():
        c = centred_cosine(outputs(fp32_statistics(copy.deepcopy(ref).bfloat16())(probe.bfloat16())), outputs(ref(probe)))
    target = 0.985 + (1 - c)
    if target >= 1:
        print(f"| {name} | {seed} | dtype-aware target: bf16 alone {c:.4f} on the probe, no target | | | |", flush=True)
        return
    plugin = QuantizedPrecision(probe_batch=probe, min_cosine=target)
    quantized = plugin.convert_module(copy.deepcopy(ref))
    conv = {r.kind: r for r in coverage(quantized, quantizing=True, adapting=False)}["Conv"]
    with torch.no_grad(), plugin.forward_context():
        got = centred_cosine(outputs(plugin.convert_output(quantized(plugin.convert_input(held)))), want)
    print(f"| {name} | {seed} | dtype-aware target {target:.4f} (bf16 alone {c:.4f} on the probe) | {got:.4f} | "
          f"{conv.bytes / conv.params:.3f} | |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["MobileNetV3-FPN backbone", "EfficientNet-B0"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--budgets", nargs="*", type=float, default=[0.6, 0.65], help="none: the bf16 line only")
    parser.add_argument("--ranks", nargs="+", default=["nsr", "layer", "grad"])
    parser.add_argument("--schema-shim", action="store_true", help="timm: see conv_check_heldout.py")
    parser.add_argument("--dtype-aware", action="store_true", help="with --default: the plan's target raised by bf16's own loss")
    parser.add_argument("--kinds", action="store_true", help="each kind of convolution alone in nf4, and all but it")
    parser.add_argument("--default", action="store_true", help="the library's default, with BatchNorm on float32 activations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kinds:
        print("| model | seed | kind | convs | of the conv weights | only these in nf4 | all but these in nf4 |")
        print("|---|---:|---|---:|---:|---:|---:|")
        for name in args.models:
            for seed in args.seeds:
                kinds(name, seed)
        return
    if args.default:
        import warnings

        warnings.simplefilter("ignore")
        for name in args.models:
            for seed in args.seeds:
                default(name, seed, args.dtype_aware)
        return
    print("| model | seed | arm | held out 64 | B/conv weight | |")
    print("|---|---:|---|---:|---:|---|")
    for name in args.models:
        for seed in args.seeds:
            run(name, seed, args.budgets, args.ranks)


if __name__ == "__main__":
    main()
