"""Each single-device recipe of ``examples/`` against bf16-true full fine-tuning of the same model and batch.

Runs ``lightning-hbm fit -c examples/R.yaml`` in-process for a few steps (validation and logging off) and
reads the recipe's own ``HBMProfiler`` report: the forward-end breakdown (light mode, largest step) and
the step peak (detailed step 1: the whole step, backward and optimizer temporaries included). The
baseline is the recipes' model and data with ``precision: bf16-true``, no lightning_hbm feature and an
``HBMProfiler`` (the same YAML with its callbacks and strategy replaced). Memory is exact tensor bytes.

    OMP_NUM_THREADS=1 python benchmarks/recipes.py                   # every single-device recipe
    OMP_NUM_THREADS=1 python benchmarks/recipes.py --steps 3 qlora lora-bf16
    OMP_NUM_THREADS=1 python benchmarks/recipes.py --step-time      # step time vs the former, narrower model
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.callbacks import Callback

from lightning_hbm.cli import HBMCLI
from lightning_hbm.memory.categories import CATEGORIES
from lightning_hbm.profiling.profiler import HBMProfiler

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MIB = 2**20


def baseline_yaml(recipe: Path, out: Path) -> Path:
    """The recipe's model and data, trained as written: bf16-true full fine-tuning, profiler only."""
    config = yaml.safe_load(recipe.read_text())
    config["trainer"] = {
        "precision": "bf16-true",
        "default_root_dir": "lightning_logs/baseline",
        "callbacks": [{"class_path": "HBMProfiler"}],
    }
    path = out / "baseline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def measure(config: Path, steps: int, root: Path) -> dict[str, Any]:
    start = time.perf_counter()
    args = ["fit", "-c", str(config), f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", f"--trainer.default_root_dir={root}"]  # fmt: skip
    cli = HBMCLI(args=args, save_config_callback=None)
    seconds = time.perf_counter() - start
    profiler = next(c for c in cli.trainer.callbacks if isinstance(c, HBMProfiler))
    report = profiler.report()
    params = sum(p.numel() for p in cli.model.parameters())
    return {"forward_end": report.forward_end_peak(), "step_peak": report.step_peak(), "seconds": seconds, "params": params}


class _StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self.start)


FORMER = (dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
          dict(seq_len=128, batch_size=8))  # fmt: skip


def step_time_ratio(steps: int = 6, rounds: int = 2) -> list[float]:
    """Median step time (steps 2..) of the recipes' model over the former one (hidden 128, batch 8 x 128), bf16-true +
    LoRA r=16, measured in alternation in this process: a ratio, since absolute times on a shared CPU measure the load."""
    import lightning.pytorch as pl
    import torch

    from lightning_hbm import LoRA
    from lightning_hbm.data import ByteTextDataModule
    from lightning_hbm.models import LlamaLM

    config = yaml.safe_load((EXAMPLES / "lora-bf16.yaml").read_text())
    current = ({k: v for k, v in config["model"]["init_args"].items() if k != "lr"}, config["data"]["init_args"])
    medians: dict[str, list[float]] = {"former": [], "current": []}
    for _ in range(rounds):
        for name, (model_args, data_args) in (("former", FORMER), ("current", current)):
            torch.manual_seed(0)
            timer = _StepTimes()
            trainer = pl.Trainer(accelerator="cpu", precision="bf16-true", max_steps=steps, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 limit_val_batches=0, num_sanity_val_steps=0, callbacks=[LoRA(r=16, alpha=32), timer],
                                 default_root_dir=tempfile.mkdtemp())  # fmt: skip
            trainer.fit(LlamaLM(**model_args), ByteTextDataModule(**data_args))
            later = sorted(timer.times[1:])
            medians[name].append(later[len(later) // 2])
            print(f"{name}: step times {[round(t, 3) for t in timer.times]} s", flush=True)
    return [c / f for c, f in zip(medians["current"], medians["former"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=["qlora", "lora-bf16", "int8-dynamic", "cpu-offload"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-time", action="store_true", help="only the step-time ratio against the former model")
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    if args.step_time:
        print("step time, recipes' model / former model:", [round(r, 2) for r in step_time_ratio()])
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        runs = {"baseline (bf16-true, full fine-tuning)": baseline_yaml(EXAMPLES / "qlora.yaml", out)}
        runs.update({f"{name}.yaml": EXAMPLES / f"{name}.yaml" for name in args.recipes})
        results = {name: measure(path, args.steps, out / name) for name, path in runs.items()}
    base = next(iter(results.values()))
    print(f"model: {base['params']:,} parameters; {args.steps} steps per run; MiB")
    for point in ("forward_end", "step_peak"):
        print(f"\n{point} | " + " | ".join(CATEGORIES) + " | total | vs baseline | wall s")
        for name, result in results.items():
            row = result[point]
            values = " | ".join(f"{row[c] / MIB:.2f}" for c in CATEGORIES)
            ratio = row["total"] / base[point]["total"]
            print(f"{name} (step {row['step']}) | {values} | {row['total'] / MIB:.2f} | {ratio:.2f} | {result['seconds']:.1f}")


if __name__ == "__main__":
    main()
