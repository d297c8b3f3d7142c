"""Coverage round three (session 38, issue 53): encoder, seq2seq, audio and vision-language models nobody here tried.

Each family is built from its transformers config (tiny, no download) and run with the library's default recipe,
``QuantizedPrecision()`` (nf4-dq, bf16 compute) + ``LoRA(r=8)`` + ``ActivationCheckpointing()`` (+ ``FusedLoss`` where
the model has a causal LM head), in a real Trainer: 2 epochs of 1 batch (2 steps), a checkpoint after step 1; then

* trains: both losses finite, every adapter got a nonzero gradient or was named by a warning;
* resume: the step-1 checkpoint resumed gives the same second loss and adapters, bit for bit;
* wide: every layer kind with parameters not stored quantized, and whether the coverage table gives a reason for each;
* plan: ``planner.plan(...)`` of the same plugin and callbacks against torch's MemTracker peak of one real step.

Command: ``PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/coverage_s38.py [name ...]`` (each family in its own
process, so a crash or a hang is one row). Prints one JSON line per family and a markdown table at the end.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import test_model_families_s29 as s29  # noqa: E402  (the same Task and checks as sessions 29-30)
from tests.families_s38 import FAMILIES, Task  # noqa: E402


def _fit(name: str, root: Path, ckpt_path: Any = None) -> tuple[Any, Any, list[str]]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from tests.test_any_model import Recorder

    torch.manual_seed(0)
    module, recorder = Task(name), Recorder()
    plugin, callbacks = recipe(name)
    checkpoints = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1, every_n_epochs=1, enable_version_counter=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, plugins=[plugin],
        callbacks=[*callbacks, recorder, checkpoints],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([FAMILIES[name].batch(1)], batch_size=None), ckpt_path=ckpt_path)
    return module, recorder, [str(w.message) for w in caught]


def recipe(name: str) -> tuple[Any, list[Any]]:
    from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision

    callbacks: list[Any] = [LoRA(r=8, alpha=16), ActivationCheckpointing()]
    if FAMILIES[name].causal:
        callbacks.append(FusedLoss(chunk_size=24))
    return QuantizedPrecision(), callbacks


def wide_rows(module: Any) -> list[dict[str, Any]]:
    """Each layer kind with parameters not stored quantized: how many, and the reasons the table gives for them."""
    from lightning_hbm import coverage_of
    from lightning_hbm.layers import RAW_WEIGHTS

    rows = []
    for r in coverage_of(module) or []:
        if r.kind in (s29.OTHER, s29.ADAPTERS):
            continue
        wide = r.params - r.quantized
        if wide > 0:
            said = sum(r.reasons.values())
            rows.append({"kind": r.kind, "wide": wide, "of": r.params, "reasons": dict(r.reasons), "unsaid": max(0, wide - said),
                         "raw": r.kind == RAW_WEIGHTS})  # fmt: skip
    return rows


def run_one(name: str) -> dict[str, Any]:
    from lightning_hbm.planner import Candidate, plan
    from lightning_hbm.planner.reference import memtracker_peak

    out: dict[str, Any] = {"name": name, "model": FAMILIES[name].model}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            module, recorder, warned = _fit(name, root / "straight")
            untrained = sorted({n.split(".lora_")[0] for n in recorder.adapters if n not in recorder.trained})
            named = [u for u in untrained if any(u in w for w in warned)]
            out["losses"] = recorder.losses
            out["trains"] = len(recorder.losses) == 2 and all(math.isfinite(x) for x in recorder.losses) and bool(recorder.adapters)
            out["untrained"], out["untrained_unnamed"] = untrained, sorted(set(untrained) - set(named))
            out["wide"] = wide_rows(module)
            out["warnings"] = [w[:400] for w in warned if "lightning_hbm" in w or "kept" in w or "left" in w][:8]
        except Exception as error:  # noqa: BLE001
            out["trains"], out["train_error"] = False, f"{type(error).__name__}: {str(error)[:600]}"
            out["train_tb"] = traceback.format_exc()[-3000:]
            return out
        try:
            from lightning_hbm import LoRA

            resumed, again, _ = _fit(name, root / "resumed", ckpt_path=root / "straight" / "epoch=0.ckpt")
            want, got = recorder.after_epoch[1], LoRA.adapter_state_dict(resumed)
            out["resume"] = again.losses == recorder.losses[1:] and set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
        except Exception as error:  # noqa: BLE001
            out["resume"], out["resume_error"] = False, f"{type(error).__name__}: {str(error)[:600]}"
    try:
        plugin, callbacks = recipe(name)
        candidate = Candidate.from_trainer(plugin, callbacks)
        factory, batch = (lambda: Task(name)), FAMILIES[name].batch(1)
        predicted = plan(factory, batch, candidates=[candidate]).find(candidate)
        measured = memtracker_peak(factory, batch, candidate)
        out["plan"], out["measured"], out["fallbacks"] = predicted.peak, measured, list(predicted.fallbacks)
        out["plan_pct"] = round(100 * (predicted.peak - measured) / measured, 2)
    except Exception as error:  # noqa: BLE001
        out["plan_error"] = f"{type(error).__name__}: {str(error)[:600]}"
        out["plan_tb"] = traceback.format_exc()[-3000:]
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | trains | resume | plan vs MemTracker | layers kept wide (reason) |", "|---|---|---|---|---|"]
    for r in results:
        trains = "yes" if r.get("trains") else f"no: {r.get('train_error', '')[:120]}"
        resume = "bit-exact" if r.get("resume") else ("-" if not r.get("trains") else f"no {r.get('resume_error', '')[:80]}")
        planned = f"{r['plan_pct']:+.2f} %" if "plan_pct" in r else ("-" if "plan_error" not in r else f"failed: {r['plan_error'][:80]}")
        if r.get("fallbacks"):
            planned += f" (fallbacks: {', '.join(r['fallbacks'])})"
        wide = "; ".join(f"{w['kind']} {w['wide']:,}/{w['of']:,}: " + (", ".join(w["reasons"]) or "NO REASON") for w in r.get("wide", [])) or "-"
        lines.append(f"| {r['model']} | {trains} | {resume} | {planned} | {wide} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print("RESULT " + json.dumps(run_one(sys.argv[2])), flush=True)
        return
    names = sys.argv[1:] or list(FAMILIES)
    results = []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in names:
        try:
            run = subprocess.run([sys.executable, __file__, "--one", name], env=env, capture_output=True, text=True, timeout=900)
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[-1][7:]) if lines else {"name": name, "model": FAMILIES[name].model,
                                                               "train_error": f"exit {run.returncode}: {run.stderr[-400:]}"}  # fmt: skip
        except subprocess.TimeoutExpired:
            result = {"name": name, "model": FAMILIES[name].model, "train_error": "over 900 s"}
        print(json.dumps(result), flush=True)
        results.append(result)
    print(table(results))


if __name__ == "__main__":
    main()
