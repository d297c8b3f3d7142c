"""Each single-device recipe of ``examples/`` against bf16-true full fine-tuning of the same model and batch.

Runs ``lightning-hbm fit -c examples/R.yaml`` in-process for a few steps (validation and logging off) and
reads the recipe's own ``HBMProfiler`` report: the forward-end breakdown (light mode, largest step) and
the step peak (detailed step 1: the whole step, backward and optimizer temporaries included). The
baseline is the recipes' model and data with ``precision: bf16-true``, no lightning_hbm feature and an
``HBMProfiler`` (the same YAML with its callbacks and strategy replaced). Memory is exact tensor bytes.

    OMP_NUM_THREADS=1 python benchmarks/recipes.py                   # every single-device recipe
    OMP_NUM_THREADS=1 python benchmarks/recipes.py --steps 3 qlora lora-bf16
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

from lightning_hbm.callbacks.profiler import HBMProfiler
from lightning_hbm.cli import HBMCLI
from lightning_hbm.memory.categories import CATEGORIES

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=["qlora", "lora-bf16", "int8-dynamic", "cpu-offload"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
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
