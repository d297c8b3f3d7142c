"""The memory figures the docs quote for the recipes are what the recipes measure now.

Each recipe's header (``examples/R.yaml``) quotes its step peak by term, from ``benchmarks/recipes.py``;
the recipe table of docs/cli.md quotes the same step peak. A change to quantization, LoRA or the profiler that
moves a figure fails here, so the docs are re-generated (``OMP_NUM_THREADS=1 python benchmarks/recipes.py``)
instead of drifting. Memory is exact tensor bytes: the same on every CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_hbm.cli import HBMCLI
from lightning_hbm.profiling.profiler import HBMProfiler

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qlora", "int8-dynamic"])
@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")
def test_recipe_header_and_readme_quote_the_measured_step_peak(recipe: str, tmp_path: Path) -> None:
    header = (ROOT / "examples" / f"{recipe}.yaml").read_text()
    quoted = re.search(r"# parameters ([\d.]+) \+ gradients ([\d.]+) \+ optimizer states ([\d.]+) \+ activations ([\d.]+)"
                       r"(?: \+ other ([\d.]+)[^=]*)? = ([\d.]+),", header)  # fmt: skip
    assert quoted, f"examples/{recipe}.yaml: no step-peak line to check"
    args = ["fit", "-c", str(ROOT / "examples" / f"{recipe}.yaml"), "--trainer.max_steps=2", "--trainer.limit_val_batches=0",
            "--trainer.logger=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    cli = HBMCLI(args=args, save_config_callback=None)
    profiler = next(c for c in cli.trainer.callbacks if isinstance(c, HBMProfiler))
    peak = profiler.report().step_peak()
    measured = [f"{peak[c] / MIB:.2f}" for c in ("parameters", "gradients", "optimizer_states", "activations")]
    assert list(quoted.group(1, 2, 3, 4)) == measured, f"examples/{recipe}.yaml header vs measured step 1"
    assert quoted.group(6) == f"{peak['total'] / MIB:.2f}"
    readme_row = re.search(rf"^\| `{recipe}\.yaml` \|[^|]*\| ([\d.]+) \|", (ROOT / "docs" / "cli.md").read_text(), re.MULTILINE)
    assert readme_row and readme_row.group(1) == quoted.group(6), "docs/cli.md recipe table vs the recipe header"
