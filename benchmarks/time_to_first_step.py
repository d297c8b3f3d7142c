"""Time to the first step: the lightning_hbm stack built by a real ``Trainer.fit`` vs the Hugging Face QLoRA recipe.

Both on the real SmolLM2-135M (``lightning_hbm.pretrained.smollm2_path()``), in one process, interleaved:

* ``hf``: ``from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quant))`` (bitsandbytes 0.50
  quantizes on CPU), ``prepare_model_for_kbit_training(use_gradient_checkpointing=True)``,
  ``get_peft_model(LoRA r=16, all-linear)``, ``model.train()``, AdamW, one training step.
* ``lhbm``: ``from_pretrained(path)`` inside a plain LightningModule, ``Trainer(max_steps=1)`` with
  ``QuantizedPrecision("nf4-dq")`` + ``LoRA(r=16)`` (all attention + MLP Linears; the head stays unquantized and
  un-adapted in both stacks) + ``ActivationCheckpointing()``: surgery, probe, fingerprints, coverage and one step.

Compute dtype: bfloat16 where the CPU has AVX512-BF16 (bitsandbytes' fast CPU path), else float32 (``--dtype``).
Reported per stack: CPU time (``time.process_time``, less sensitive to other jobs on a shared machine) and wall
time from the start of the load to the end of the first optimizer step, and the ratio lhbm / hf.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/time_to_first_step.py --rounds 4 --breakdown
    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/time_to_first_step.py --stack lhbm --profile /tmp/ttfs.prof

``--breakdown`` prints the CPU seconds of each stage (counters around the functions, no profiler: cProfile inflates
Python-heavy stages several times over, so its cumulative times rank hot spots but do not measure them). Nested
stages are indented under the one that runs them; Lightning runs the step's forward and backward inside the
optimizer's ``step`` (its closure), so "optimizer step" holds them (session 34: the checks, the accuracy check's two
forwards, the quantization, the step and the whole ``Trainer.fit`` separated; HF's step forward and backward too).
``--trainer-defaults`` gives the lhbm Trainer Lightning's defaults (logger, a checkpoint saved at the end, model summary).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.pretrained import smollm2_path

LORA_R, LORA_ALPHA = 16, 32
BATCH, SEQ = 1, 128


def _default_dtype() -> str:
    try:
        from bitsandbytes.cextension import has_avx512bf16  # type: ignore[attr-defined]

        return "bfloat16" if has_avx512bf16() else "float32"
    except Exception:  # older/newer bnb layouts: read the flag ourselves
        try:
            return "bfloat16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "float32"
        except OSError:
            return "float32"


class CausalLM(pl.LightningModule):
    """What a user writes around a transformers causal LM: nothing about memory."""

    def __init__(self, path: str) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path)
        self.model.config.use_cache = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def hf_first_step(path: str, dtype: str, batch: torch.Tensor) -> float:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch_dtype = getattr(torch, dtype)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch_dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch_dtype, device_map="cpu")
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    start = time.process_time()
    loss = model(input_ids=batch, labels=batch).loss
    forward = time.process_time()
    loss.backward()
    STAGES["hf: step forward"] = forward - start
    STAGES["hf: step backward"] = time.process_time() - forward
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


#: ``--trainer-defaults``: Lightning's own defaults (a logger, checkpointing at the end, the model summary), in a temp dir
TRAINER_DEFAULTS = False


def lhbm_first_step(path: str, dtype: str, batch: torch.Tensor) -> float:
    module = CausalLM(path)
    extras: dict[str, Any] = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                  enable_model_summary=False)
    with tempfile.TemporaryDirectory() as root:
        if TRAINER_DEFAULTS:
            extras = dict(default_root_dir=root, enable_progress_bar=False)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1,
                             plugins=[QuantizedPrecision("nf4-dq", dtype=dtype)],
                             callbacks=[LoRA(r=LORA_R, alpha=LORA_ALPHA), ActivationCheckpointing()], **extras)
        return _fit(trainer, module, batch)


def _fit(trainer: pl.Trainer, module: pl.LightningModule, batch: torch.Tensor) -> float:
    trainer.fit(module, torch.utils.data.DataLoader([batch[0]] * batch.shape[0], batch_size=batch.shape[0]))
    return float(trainer.callback_metrics.get("train_loss", torch.tensor(float("nan"))))


STACKS = {"hf": hf_first_step, "lhbm": lhbm_first_step}
#: ``--breakdown``: CPU seconds per stage of the current round (nested stages are indented by their label)
STAGES: dict[str, float] = {}


def _time_stages() -> None:
    """Wrap the stages of both stacks with CPU-time counters (``--breakdown``; no profiler overhead)."""
    import functools

    import bitsandbytes.functional as bnb_functional
    import peft
    import transformers

    import lightning_hbm.precision.plugin as plugin
    import lightning_hbm.surgery.engine as surgery_engine
    from lightning_hbm import resume
    from lightning_hbm.layers import readers
    from lightning_hbm.precision import measures, quantization

    def wrap(owner: Any, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return inner(*args, **kwargs)
            finally:
                STAGES[label] = STAGES.get(label, 0.0) + time.process_time() - start

        setattr(owner, attr, timed)

    wrap(transformers.AutoModelForCausalLM, "from_pretrained", "from_pretrained")
    wrap(bnb_functional, "quantize_4bit", "  bitsandbytes quantize_4bit (both)")
    wrap(peft, "prepare_model_for_kbit_training", "hf: prepare_model_for_kbit_training")
    wrap(peft, "get_peft_model", "hf: get_peft_model")
    wrap(plugin, "trainer_surgery", "lhbm: surgery (convert_module)")
    wrap(resume, "as_built_record", "  as_built_record (fingerprints)")
    wrap(readers, "observe", "  probe step (readers.observe)")
    wrap(plugin.QuantizedPrecision, "convert_base", "  quantize_model")
    wrap(LoRA, "check_model", "  LoRA.check_model")
    wrap(LoRA, "transform_model", "  LoRA.transform_model")
    wrap(peft, "inject_adapter_in_model", "    peft inject_adapter_in_model")
    wrap(surgery_engine, "_guard", "  guards (unobserved reads)")  # where the engine looks it up (was: lightning_hbm.surgery, which never had it)
    wrap(plugin, "report_coverage", "lhbm: coverage table (connect)")
    wrap(LoRA, "on_fit_start", "lhbm: LoRA.on_fit_start")
    wrap(resume, "pack", "lhbm: resume.pack (--trainer-defaults: the save)")
    # session 34: the rest of the surgery and of the fit, separated
    wrap(pl.Trainer, "fit", "lhbm: Trainer.fit (all)")
    wrap(surgery_engine, "check_ranks", "  check_ranks")
    wrap(quantization.Quantization, "check", "  quantization checks (Quantization.check)")
    wrap(measures, "stepped_inputs", "    forward-less module: stepped_inputs")
    wrap(measures.Measures, "record_reference", "    accuracy check: reference forward")
    wrap(quantization, "quantize_listed", "    quantize_listed (the layers replaced)")
    wrap(quantization, "check_accuracy", "    accuracy check: quantized forward + figure")
    wrap(ActivationCheckpointing, "transform_model", "  ActivationCheckpointing.transform_model")
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization

    wrap(_AutomaticOptimization, "_training_step", "lhbm: step forward (the loop's training_step)")
    wrap(pl.LightningModule, "backward", "lhbm: step backward")
    wrap(torch.optim.AdamW, "step", "  optimizer step (both)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", choices=["both", *STACKS], default="both")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median of all but the first)")
    parser.add_argument("--profile", default=None, help="write a cProfile of one extra lhbm run here")
    parser.add_argument("--trainer-defaults", action="store_true",
                        help="lhbm: Lightning's default logger, checkpoint at the end and model summary (in a temp dir)")
    parser.add_argument("--breakdown", action="store_true", help="CPU seconds per stage, each round")
    parser.add_argument("--top", type=int, default=40, help="profile rows printed (cumulative time)")
    args = parser.parse_args()
    dtype = args.dtype or _default_dtype()
    global TRAINER_DEFAULTS
    TRAINER_DEFAULTS = args.trainer_defaults
    import transformers

    transformers.utils.logging.disable_progress_bar()  # one bar per load: noise in the log
    path = smollm2_path()
    if path is None:
        raise SystemExit("SmolLM2-135M is not installed: see lightning_hbm.pretrained.INSTALL")
    path = str(path)
    if args.breakdown:
        _time_stages()
    torch.manual_seed(0)
    batch = torch.randint(0, 49152, (BATCH, SEQ))
    names = list(STACKS) if args.stack == "both" else [args.stack]
    times: dict[str, dict[str, list[float]]] = {n: {"cpu": [], "wall": []} for n in names}
    # round 0 also pays the first imports (transformers' Llama code, peft's tuners, bnb's backends): left out of the
    # medians when there are later rounds; the profile (if asked) is one extra lhbm run after them
    for round_ in range(args.rounds + (1 if args.profile else 0)):
        profiling = bool(args.profile) and round_ == args.rounds
        for name in ["lhbm"] if profiling else names:
            gc.collect()
            STAGES.clear()
            profiler = cProfile.Profile() if profiling else None
            cpu, wall = time.process_time(), time.perf_counter()
            if profiler is not None:
                profiler.enable()
            STACKS[name](path, dtype, batch)
            if profiler is not None:
                profiler.disable()
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            print(f"round {round_} {name}: cpu {cpu:.1f} s, wall {wall:.1f} s{' (profiled)' if profiling else ''}", flush=True)
            for label, seconds in STAGES.items():
                print(f"    {label:<40} {seconds:6.2f}")
            if not profiling and (round_ > 0 or args.rounds == 1):
                times[name]["cpu"].append(cpu)
                times[name]["wall"].append(wall)
            if profiler is not None:
                profiler.dump_stats(args.profile)
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.top)
    kept = args.rounds - 1 if args.rounds > 1 else 1
    print(f"\nSmolLM2-135M, batch {BATCH} x {SEQ}, {dtype}, LoRA r={LORA_R}, median of {kept} round(s) after the first (of {args.rounds}), "
          f"torch threads {torch.get_num_threads()}")
    print("| stack | CPU s (median) | wall s (median) | CPU vs HF | wall vs HF |")
    print("|---|---:|---:|---:|---:|")
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for name in names:
        ref = med.get("hf", med[name])
        print(f"| {name} | {med[name]['cpu']:.1f} | {med[name]['wall']:.1f} | {med[name]['cpu'] / ref['cpu']:.2f}x | "
              f"{med[name]['wall'] / ref['wall']:.2f}x |")


if __name__ == "__main__":
    main()
