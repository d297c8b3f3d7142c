"""The examples a new user runs: every YAML recipe, ``quickstart.py`` and the Hugging Face export.

Each recipe is parsed with ``--print_config`` and trained for ``fast_dev_run`` steps on CPU with a
tiny model override (same architecture, fewer and narrower layers). What each recipe asks for
(precision mode, callbacks, strategy) is read from the YAML itself and checked on the trained
Trainer, so a recipe that silently drops a feature fails. Multi-device recipes run in a subprocess
through the console script: Lightning starts the other ranks by re-running the same command.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

import lightning_hbm
from lightning_hbm import QuantizedPrecision, applied_transforms
from lightning_hbm.cli import HBMCLI
from lightning_hbm.precision import available_precisions
from lightning_hbm.precision.correction import corrected_layers

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# the real-weights recipe trains a pretrained model (tests/test_pretrained.py), not the shared tiny Llama
REAL_RECIPES = [EXAMPLES / "smollm2-qlora.yaml"]
RECIPES = [p for p in sorted(EXAMPLES.glob("*.yaml")) if p not in REAL_RECIPES]
TINY = [
    "--model.init_args.hidden_size=64",
    "--model.init_args.intermediate_size=172",
    "--model.init_args.num_hidden_layers=2",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_bytes=200000",
    "--data.init_args.val_samples=8",
]


def _recipe(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _devices(path: Path) -> int:
    devices = _recipe(path)["trainer"].get("devices", 1)
    return devices if isinstance(devices, int) else 1


def test_the_recipes_exist() -> None:
    names = {p.name for p in RECIPES}
    assert {"qlora.yaml", "lora-bf16.yaml", "int8-dynamic.yaml", "cpu-offload.yaml", "fsdp-qlora.yaml", "autofit.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES + REAL_RECIPES, ids=lambda p: p.stem)
def test_recipe_has_a_header_and_prints_its_config(path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = path.read_text().splitlines()
    header = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert len(header) >= 5, f"{path.name} needs a comment header: what it is for, what it shrinks, how to run it"
    text = "\n".join(header)
    assert "Shrinks" in text and "Memory" in text and f"lightning-hbm fit -c examples/{path.name}" in text
    with pytest.raises(SystemExit) as exit_info:
        HBMCLI(args=["fit", "-c", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    recipe = _recipe(path)
    assert printed["trainer"]["precision"] == recipe["trainer"].get("precision")
    # every short class name was resolved to a full import path
    for callback in printed["trainer"]["callbacks"] or []:
        assert "." in callback["class_path"]


def _check_recipe_applied(recipe: dict[str, Any], trainer: Any, model: Any) -> None:
    precision = recipe["trainer"].get("precision")
    if precision in available_precisions():
        assert isinstance(trainer.precision_plugin, QuantizedPrecision)
        assert trainer.precision_plugin.mode.name == precision
        assert f"QuantizedPrecision({precision})" in applied_transforms(model)
    for spec in recipe["trainer"].get("callbacks") or []:
        cls = getattr(lightning_hbm, spec["class_path"].rsplit(".", 1)[-1])
        assert any(isinstance(cb, cls) for cb in trainer.callbacks), f"{cls.__name__} missing"
        if issubclass(cls, lightning_hbm.SurgeryCallback):
            assert cls.__qualname__ in applied_transforms(model)
    for spec in recipe["trainer"].get("plugins") or []:  # qlora.yaml: the plugin's options as written
        if spec["class_path"].endswith("QuantizedPrecision"):
            plugin = trainer.precision_plugin
            assert isinstance(plugin, QuantizedPrecision)
            assert {k: plugin.mode.name if k == "mode" else getattr(plugin, k) for k in spec["init_args"]} == spec["init_args"]
            assert bool(corrected_layers(model)) == bool(spec["init_args"].get("correction_rank"))
    strategy = recipe["trainer"].get("strategy")
    if isinstance(strategy, dict):
        assert type(trainer.strategy).__name__ == strategy["class_path"].rsplit(".", 1)[-1]
    if any(spec["class_path"].endswith("LoRA") for spec in recipe["trainer"].get("callbacks") or []):
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)


# Test-only overrides. AutoFit (the last callback of autofit.yaml, which `--trainer.callbacks.*` edits) gets a
# one-candidate grid: planning every candidate is the planner's tests' job, and the tiny model fits any budget.
OVERRIDES = {"autofit": ["--trainer.callbacks.lora_ranks=[0]", "--trainer.callbacks.checkpointing=[full]"]}


@pytest.mark.parametrize("path", [p for p in RECIPES if _devices(p) == 1], ids=lambda p: p.stem)
@pytest.mark.slow
def test_recipe_trains_fast_dev_run(path: Path, tmp_path: Path) -> None:
    args = ["fit", "-c", str(path), "--trainer.fast_dev_run=2", f"--trainer.default_root_dir={tmp_path}", *TINY]
    cli = HBMCLI(args=[*args, *OVERRIDES.get(path.stem, [])])
    assert cli.trainer.state.finished and cli.trainer.global_step == 2
    _check_recipe_applied(_recipe(path), cli.trainer, cli.model)
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    if path.stem == "autofit":  # its choice was applied through the ordinary callback
        assert "ActivationCheckpointing" in applied_transforms(cli.model)


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "lightning-hbm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "lightning_hbm.cli"]


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in RECIPES if _devices(p) > 1], ids=lambda p: p.stem)
def test_multi_device_recipe_trains_on_cpu_processes(path: Path, tmp_path: Path) -> None:
    # CPU processes (gloo) even on a machine with one GPU, where `devices: 2` could not run
    cmd = [*_console_script(), "fit", "-c", str(path), "--trainer.accelerator=cpu", "--trainer.fast_dev_run=2"]
    cmd += [f"--trainer.default_root_dir={tmp_path}", *TINY]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stdout + proc.stderr


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quickstart_loss_falls(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    losses = _load("quickstart").main(steps=8, root_dir=str(tmp_path))
    assert len(losses) == 8
    # from ~log(256)=5.55; measured on CPU: 4.34 at step 6 (LoRA on a 4-bit base trains; the bf16 head stays frozen)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    out = capsys.readouterr().out
    assert "done: 8 steps" in out and "HBMProfiler (MiB):" in out
    assert (tmp_path / "hbm_profile.csv").exists()


@pytest.mark.slow
def test_hf_example_exports_a_peft_adapter(tmp_path: Path) -> None:
    result = _load("hf_peft_export").main(steps=3, out=str(tmp_path))
    # 2 layers x 4 attention projections x (lora_A, lora_B), reloaded by peft and equal
    assert result["matched"] == result["trained"] == 16
    adapter = Path(result["adapter_path"])
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()


def test_recipes_share_the_model_their_savings_are_measured_on() -> None:
    # docs/cli.md's recipe table compares each recipe with bf16-true full fine-tuning of one model and batch
    # (benchmarks/recipes.py): every recipe must train that same model on that same batch, at a width where
    # LoRA's removed gradients and optimizer states outweigh its adapters' own activations (hidden >= 512).
    def architecture(path: Path) -> tuple[Any, Any, Any]:
        model, data = _recipe(path)["model"], _recipe(path)["data"]
        shape = {k: v for k, v in model["init_args"].items() if k != "lr"}  # the learning rate may differ
        return model["class_path"], shape, data

    shapes = {path.name: architecture(path) for path in RECIPES}
    first = next(iter(shapes.values()))
    assert all(s == first for s in shapes.values()), shapes
    class_path, shape, data = first
    assert class_path == "lightning_hbm.models.LlamaLM" and shape["hidden_size"] >= 512
    assert data["init_args"] == {"seq_len": 64, "batch_size": 4}
