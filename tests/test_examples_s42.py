"""The docs' first example is the accurate 4-bit fine-tune (issue 52, item 3; session 42).

The README's Quickstart block, ``examples/quickstart.py`` and ``examples/qlora.yaml`` train on the accurate 4-bit base
(``nf4-dq-b32``, GPTQ rounding, a calibrated correction) at the rank AutoFit picks for their own model at its default
0.65 bytes per weight (:func:`lightning_hbm.planner.accurate.accurate_4bit`), and name ``nf4-dq`` (Hugging Face's QLoRA
base) on the line below as the reference. Their quality and cost: ``benchmarks/quickstart_quality.py`` and
benchmarks/README.md, "The quickstart's base".
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

from lightning_hbm import QuantizedPrecision
from lightning_hbm.cli import HBMCLI
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner.accurate import accurate_4bit
from lightning_hbm.precision.correction import corrected_layers

ROOT = Path(__file__).resolve().parents[1]
QLORA = ROOT / "examples" / "qlora.yaml"


def _quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_quickstart_s42", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plugin_lines(text: str) -> tuple[str, str]:
    """The ``plugins=[...]`` line a reader runs, and the line after it (``(line, next)``, stripped)."""
    lines = [line.strip() for line in text.splitlines()]
    index = next(i for i, line in enumerate(lines) if line.startswith("plugins=["))
    return lines[index], lines[index + 1]


def _settings(line: str) -> dict[str, Any]:
    """The arguments of the one ``QuantizedPrecision(...)`` call in ``line``, as written."""
    call = next(n for n in ast.walk(ast.parse(line.rstrip(",").split("=", 1)[1])) if isinstance(n, ast.Call))
    args = {"mode": ast.literal_eval(call.args[0])} if call.args else {}
    return {**args, **{k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}}


def _readme_quickstart_block() -> str:
    section = (ROOT / "README.md").read_text().split("## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "README's Quickstart lost its python block"
    return block.group(1)


def test_the_quickstart_trains_on_the_accurate_base_autofit_picks_for_its_model() -> None:
    script = (ROOT / "examples" / "quickstart.py").read_text()
    line, below = _plugin_lines(script)
    settings = _settings(line)
    picked = accurate_4bit(_quickstart().TinyGPT(), "bfloat16")
    assert picked.rank == 4 and picked.bytes_per_weight <= 0.65  # the 128-wide GPT: rank 4 at 0.645 B/weight
    assert settings == picked.settings, (settings, picked.describe())
    plugin = QuantizedPrecision(**settings)  # the line builds, with the compute dtype the comments name
    assert plugin.dtype == torch.bfloat16 and plugin.config.correction_rank == 4 and plugin.config.rounding == "gptq"
    # nf4-dq stays named, a line below, as the Hugging Face reference
    assert below.startswith('# plugins=[QuantizedPrecision("nf4-dq")]') and "Hugging Face" in below


def test_the_readme_shows_the_quickstarts_own_lines() -> None:
    line, below = _plugin_lines(_readme_quickstart_block())
    assert line == _plugin_lines((ROOT / "examples" / "quickstart.py").read_text())[0]
    assert below.startswith('# plugins=[QuantizedPrecision("nf4-dq")]') and "Hugging Face" in below


def test_the_qlora_recipe_is_the_accurate_base_autofit_picks_for_its_model() -> None:
    recipe = yaml.safe_load(QLORA.read_text())
    assert "precision" not in recipe["trainer"], "the plugin sets the precision"
    (plugin,) = recipe["trainer"]["plugins"]
    assert plugin["class_path"] == "QuantizedPrecision"
    model = LlamaLM(**{k: v for k, v in recipe["model"]["init_args"].items() if k != "lr"})
    picked = accurate_4bit(model, "bfloat16")
    assert picked.rank == 16 and plugin["init_args"] == picked.settings, (plugin, picked.describe())
    below = QLORA.read_text().split("init_args: {mode: nf4-dq-b32", 1)[1].splitlines()[1].strip()
    assert below.startswith("# precision: nf4-dq") and "Hugging Face" in below


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")
@pytest.mark.filterwarnings("ignore:.*get no calibrated correction:UserWarning")
def test_the_qlora_recipe_trains_from_the_command_line(tmp_path: Path) -> None:
    """``lightning-hbm fit -c examples/qlora.yaml --trainer.max_steps 2``, on a narrower model of the same kind."""
    tiny = ["--model.init_args.hidden_size=64", "--model.init_args.intermediate_size=172", "--model.init_args.num_hidden_layers=2",
            "--data.init_args.seq_len=32", "--data.init_args.max_bytes=200000"]  # fmt: skip
    args = ["fit", "-c", str(QLORA), "--trainer.max_steps", "2", "--trainer.limit_val_batches=0", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={tmp_path}", *tiny]  # fmt: skip
    cli = HBMCLI(args=args, save_config_callback=None)
    assert cli.trainer.global_step == 2
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, QuantizedPrecision)
    assert (plugin.mode.name, plugin.config.rounding, plugin.config.correction_rank) == ("nf4-dq-b32", "gptq", 16)
    assert len(corrected_layers(cli.model)) == 2 * 7  # every attention and MLP projection of the 2 layers
