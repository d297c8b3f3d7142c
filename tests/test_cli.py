"""``lightning-hbm`` (``lightning_hbm.cli``): precision names, short class names, defaults, plan, report.

Everything runs in-process with ``run=False`` (classes are built, nothing is trained) except the
``report`` test, which trains two tiny steps to have a real profiler report to re-render. The
recipes' end-to-end runs are in ``tests/test_examples.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import Strategy

import lightning_hbm
from lightning_hbm import HBMProfiler, LoRA, QuantizedPrecision, available_precisions
from lightning_hbm.cli import HBMCLI, PlanCLI, main, render_report, resolve_precision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner.config import _offload_cell

# pytest's own argv is in sys.argv while the tests hand LightningCLI its args: Lightning warns about both
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")

TINY = [
    "--model.init_args.hidden_size=64",
    "--model.init_args.intermediate_size=172",
    "--model.init_args.num_hidden_layers=2",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_bytes=200000",
]


def _cli(tmp_path: Path, *args: str) -> HBMCLI:
    """Parse and instantiate (model, data, trainer) without running anything."""
    base = ["--trainer.accelerator=cpu", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    return HBMCLI(args=[*base, *TINY, *args], run=False)


@pytest.mark.parametrize("name", available_precisions())
def test_every_registered_precision_name_becomes_the_plugin(tmp_path: Path, name: str) -> None:
    cli = _cli(tmp_path, f"--trainer.precision={name}")
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, QuantizedPrecision)
    assert plugin.mode.name == name
    assert cli.trainer.precision == "bf16-true"  # what QuantizedPrecision reports for its bf16 compute dtype


@pytest.mark.parametrize(("value", "expected"), [("bf16-true", "bf16-true"), ("32", "32-true"), (32, "32-true")])
def test_lightning_precision_names_keep_working(tmp_path: Path, value: Any, expected: str) -> None:
    # a YAML `precision: 32` arrives as an int, `--trainer.precision 32` as a string
    cli = HBMCLI(
        args={"trainer": {"accelerator": "cpu", "logger": False, "default_root_dir": str(tmp_path), "precision": value}},
        run=False,
    )
    assert not isinstance(cli.trainer.precision_plugin, QuantizedPrecision)
    assert cli.trainer.precision == expected


def test_unknown_precision_lists_both_sets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"Unknown trainer.precision 'nf5'\. Did you mean 'nf4'.*\? lightning_hbm's quantized modes: .*nf4-dq.*Lightning's precisions: .*bf16-true"):
        _cli(tmp_path, "--trainer.precision=nf5")
    with pytest.raises(ValueError, match=r"Unknown trainer.precision 8\."):
        resolve_precision(8)


def test_precision_name_keeps_the_other_plugins(tmp_path: Path) -> None:
    cli = _cli(tmp_path, "--trainer.precision=nf4-dq", "--trainer.plugins=TorchCheckpointIO")
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    assert isinstance(cli.trainer.precision_plugin, QuantizedPrecision)
    assert isinstance(cli.trainer.strategy.checkpoint_io, TorchCheckpointIO)


def _public_classes(base: type) -> list[str]:
    return sorted(n for n in lightning_hbm.__all__ if isinstance(getattr(lightning_hbm, n), type) and issubclass(getattr(lightning_hbm, n), base))


def test_short_class_names_resolve_for_every_public_class(tmp_path: Path) -> None:
    cli = _cli(tmp_path)
    callbacks = [c for c in _public_classes(Callback) if c != "SurgeryCallback"]
    strategies, plugins = _public_classes(Strategy), _public_classes(Precision)
    assert {"LoRA", "ActivationCheckpointing", "HBMProfiler"} <= set(callbacks)
    assert "QuantizedPrecision" in plugins
    for name in callbacks:
        config = cli.parser.parse_object({"trainer": {"callbacks": [{"class_path": name}]}})
        assert config.trainer.callbacks[0].class_path.rsplit(".", 1)[-1] == name
    for name in strategies:
        config = cli.parser.parse_object({"trainer": {"strategy": {"class_path": name}}})
        assert config.trainer.strategy.class_path.rsplit(".", 1)[-1] == name
    for name in plugins:
        config = cli.parser.parse_object({"trainer": {"plugins": [{"class_path": name}]}})
        assert config.trainer.plugins[0].class_path.rsplit(".", 1)[-1] == name


def test_short_names_instantiate_with_init_args(tmp_path: Path) -> None:
    cli = HBMCLI(
        args={
            "trainer": {
                "accelerator": "cpu",
                "logger": False,
                "default_root_dir": str(tmp_path),
                "precision": "nf4-dq",
                "callbacks": [{"class_path": "LoRA", "init_args": {"r": 4, "alpha": 8}}, {"class_path": "HBMProfiler"}],
            },
            "model": {"init_args": {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2}},
        },
        run=False,
    )
    lora = [c for c in cli.trainer.callbacks if isinstance(c, LoRA)]
    assert len(lora) == 1 and lora[0].r == 4
    assert any(isinstance(c, HBMProfiler) for c in cli.trainer.callbacks)


def test_defaults_are_llama_on_stdlib_text(tmp_path: Path) -> None:
    cli = _cli(tmp_path)
    assert type(cli.model) is LlamaLM and cli.model.hparams.hidden_size == 64
    assert type(cli.datamodule) is ByteTextDataModule and cli.datamodule.seq_len == 32


def test_own_model_class_as_lightning_cli(tmp_path: Path) -> None:
    from lightning_hbm.models import NanoGPT

    args = ["--trainer.accelerator=cpu", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = HBMCLI(NanoGPT, args=[*args, "--model.n_layer=1", "--model.n_embd=32", "--trainer.precision=nf4"], run=False)
    assert type(cli.model) is NanoGPT and len(cli.model.model.h) == 1
    assert cli.trainer.precision_plugin.mode.name == "nf4"


def test_validate_subcommand_applies_the_precision(tmp_path: Path) -> None:
    base = ["--trainer.accelerator=cpu", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = HBMCLI(args=["validate", *base, *TINY, "--trainer.precision=nf4-dq", "--trainer.limit_val_batches=1"])
    assert "QuantizedPrecision(nf4-dq)" in lightning_hbm.applied_transforms(cli.model)
    assert 0 < float(cli.trainer.callback_metrics["val_loss"]) < 10


def test_console_script_points_to_main() -> None:
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("lightning-hbm") == "lightning_hbm.cli:main"


@pytest.mark.slow
def test_plan_predicts_and_chooses_within_budget(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = [
        *TINY,
        "--budget=1.5MiB",
        "--candidates.precisions=[nf4-dq]",
        "--candidates.lora_ranks=[16]",
        "--candidates.checkpointing=[none, full]",
        "--candidates.optimizers=[user]",
    ]
    cli = PlanCLI(args=args, run=False)
    names = [p.candidate.name for p in cli.plan.predictions]
    assert sorted(names) == ["nf4-dq+lora16", "nf4-dq+lora16+ac-full"]
    # checkpointing must shrink the predicted activations, and the choice must fit the budget
    by_name = {p.candidate.name: p for p in cli.plan.predictions}
    assert by_name["nf4-dq+lora16+ac-full"].categories["activations"] < by_name["nf4-dq+lora16"].categories["activations"]
    assert cli.plan.chosen is not None and cli.plan.chosen.total <= 1.5 * 2**20
    assert "class_path: lightning_hbm.LoRA" in cli.plan.chosen.candidate.yaml()
    # the console script: nothing fits 10 KiB -> exit status 2 and the closest candidates
    assert main(["plan", *args[:-5], "--budget=10KiB", *args[-4:]]) == 2
    assert "Nothing fits" in capsys.readouterr().out


def test_report_rerenders_a_finished_run(tmp_path: Path, llama_factory: Any, datamodule_factory: Any, trainer_factory: Any, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    trainer = trainer_factory(max_steps=2, callbacks=[HBMProfiler(summary=False)], default_root_dir=run_dir)
    trainer.fit(llama_factory(), datamodule=datamodule_factory())
    written = json.loads((run_dir / "hbm_profile.json").read_text())
    (run_dir / "hbm_profile.csv").unlink()

    main(["report", str(tmp_path)])  # finds the JSON under the directory

    out = capsys.readouterr().out
    assert "HBMProfiler (MiB):" in out and "To shrink it" in out
    csv_lines = (run_dir / "hbm_profile.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + len(written["rows"])  # header + one line per measured step, as written at fit
    assert json.loads((run_dir / "hbm_profile.json").read_text())["rows"] == written["rows"]


def test_report_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"neither a run directory nor an hbm_profile.json file"):
        render_report(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"no hbm_profile\*.json under .*HBMProfiler"):
        render_report(tmp_path)
    bad = tmp_path / "hbm_profile.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=r"holds no complete measured step"):
        render_report(bad)
    bad.write_text("not json")
    with pytest.raises(ValueError, match=r"is not an HBMProfiler report"):
        render_report(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fit", "--trainer.precision", "nf5", "--trainer.fast_dev_run", "true"], r"Unknown trainer.precision 'nf5'\. "),
        # raised in LoRA.__init__, which jsonargparse wraps in its own ValueError listing every type it tried
        (["fit", "--trainer.callbacks+=LoRA", "--trainer.callbacks.r=-1"], r"LoRA r must be a positive rank, got r=-1\. "),
        (["fit", "--trainer.callbacks+=HBMProfiler", "--trainer.callbacks.every_n_steps=0"], r"HBMProfiler: every_n_steps must be >= 1, got 0\.$"),
        (["report", "no/such/run"], r"report: 'no/such/run' is neither a run directory nor an hbm_profile.json file\.$"),
    ],
    ids=["precision", "lora-rank", "profiler-cadence", "report-missing"],
)
def test_console_user_errors_are_one_message(args: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"lightning-hbm: error: " + message, err.strip())


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("trainer: {callbacks: [{class_path: LoRA, init_args: {rank: 16}}]}",
         r"trainer\.callbacks: LoRA has no option 'rank'\. Did you mean 'r' or 'rank_pattern'\? Its options: r, alpha, "),
        ("trainer: {callbacks: [{class_path: HBMProfiler, init_args: {every_n_step: 3}}]}",
         r"trainer\.callbacks: HBMProfiler has no option 'every_n_step'\. Did you mean 'every_n_steps'\?"),
        ("trainer: {max_step: 1}", r"unknown option 'trainer\.max_step'\. Did you mean 'trainer\.max_steps'"),
        ("trainr: {max_steps: 1}", r"unknown option 'trainr\.max_steps'\. Did you mean 'trainer\.max_steps'"),
        ("model: {init_args: {hiden_size: 64}}", r"model: LlamaLM has no option 'hiden_size'\. Did you mean 'hidden_size'\?"),
        ("trainer: {callbacks: [{class_path: LoRAA}]}",
         r"trainer\.callbacks: no class named 'LoRAA'\. Did you mean 'LoRA'\? .*lightning_hbm's: .*HBMProfiler"),
        ("trainer: {precision: nf4dq}", r"Unknown trainer\.precision 'nf4dq'\. Did you mean 'nf4-dq'"),
        ("trainer: {plugins: [{class_path: QuantizedPrecision, init_args: {mode: nf5}}]}",
         r"Unknown lightning_hbm precision mode 'nf5'\. Did you mean 'nf4'\? Valid modes: "),
        ("trainer: {precision: nf4-dq, plugins: [{class_path: QuantizedPrecision, init_args: {mode: nf4}}]}",
         r"trainer\.precision='nf4-dq' and the plugin QuantizedPrecision both set the precision: keep one\. "),
        ("trainer:\n  max_steps: 1\n  callbacks: [{class_path: LoRA, init_args: {r: 4}\nmodel: {}\n",
         r"\S*config\.yaml:4:1: did not find expected ',' or '\}' \(while parsing a flow mapping that starts at line 3, "
         r"column 15\)\. Fix the YAML syntax there\.$"),
        ("trainer:\n  callbacks:\n    - class_path: lightning_hbm.LoRA\n      init_args:\n        r: eight\n",
         r"\S*config\.yaml:5: trainer\.callbacks: LoRA init_args\.r: Expected an int\. Got value: eight$"),
    ],
    ids=["lora-init-arg", "profiler-init-arg", "trainer-key", "top-key", "model-init-arg", "class-name", "precision",
         "plugin-mode", "precision-and-plugin", "yaml-syntax-file-line-column", "init-arg-value-file-line-field"],
)  # fmt: skip
def test_yaml_mistakes_are_one_line_with_close_matches(tmp_path: Path, yaml_text: str, message: str, capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(yaml_text)
    assert main(["fit", "-c", str(config), "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "usage:" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("lightning-hbm: error: ")]
    assert len(lines) == 1 and err.strip().endswith(lines[0]), err
    assert re.match(r"lightning-hbm: error: " + message, lines[0]), lines[0]


def test_wrong_init_arg_value_on_the_command_line_names_the_field(capsys: pytest.CaptureFixture) -> None:
    callbacks = "--trainer.callbacks=[{class_path: lightning_hbm.LoRA, init_args: {r: eight}}]"
    assert main(["fit", callbacks, "--trainer.logger=false"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == "lightning-hbm: error: trainer.callbacks: LoRA init_args.r: Expected an int. Got value: eight", last


def test_parse_errors_raise_config_error_in_process(tmp_path: Path) -> None:
    from lightning_hbm.cli import ConfigError

    with pytest.raises(ConfigError, match=r"unknown option 'trainer\.max_stepz'\. Did you mean 'trainer\.max_steps'"):
        _cli(tmp_path, "--trainer.max_stepz=3")


def test_did_you_mean() -> None:
    from lightning_hbm.naming import did_you_mean

    assert did_you_mean("nf4dq", available_precisions()).startswith(" Did you mean 'nf4-dq'")
    assert did_you_mean("rank", ["r", "alpha", "dropout"]) == " Did you mean 'r'?"
    assert did_you_mean("lora_alpha", ["r", "alpha"]) == " Did you mean 'alpha'?"
    assert did_you_mean("zzz", ["r", "alpha"]) == ""


@pytest.mark.slow
def test_console_script_lora_typo_exit_2_with_short_names(tmp_path: Path) -> None:
    # through the console script (this worktree's code: `python -m lightning_hbm.cli` from the repository root)
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "lightning_hbm.cli", "fit", *TINY, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}",
           "--trainer.max_steps=1", "--trainer.callbacks+=LoRA", "--trainer.callbacks.target_modules=[q_prj]"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "LightningCLI's args parameter" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # distinct short names first (what target_modules takes), full paths only as examples
    assert last.startswith("lightning-hbm: error: target_modules=['q_prj']"), last
    assert "Did you mean 'q_proj'" in last
    assert "Available Linear layers: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head (15 in all, e.g. " in last


def test_help_lists_plan_and_report_without_lightning_warnings(capsys: pytest.CaptureFixture) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # sys.argv holds pytest's own arguments: Lightning would warn here
        for args in (["--help"], ["fit", "--help"]):
            with pytest.raises(SystemExit) as exit_info:
                main(args)
            assert exit_info.value.code == 0
    assert not [w for w in caught if "LightningCLI's args parameter" in str(w.message)]
    out = capsys.readouterr().out
    listing = out[out.index("Available subcommands:"):]
    for name in ("fit", "validate", "test", "predict", "plan", "report"):
        assert re.search(rf"^\s+{name}\s", listing, re.MULTILINE), name


def test_console_callbacks_are_quiet(tmp_path: Path) -> None:
    from lightning_hbm.display import HBMRichModelSummary, HBMRichProgressBar

    cli = _cli(tmp_path, "--trainer.max_steps=3")
    bar = next(c for c in cli.trainer.callbacks if isinstance(c, HBMRichProgressBar))
    bar._trainer = cli.trainer  # what Lightning's ProgressBar.setup does
    cli.trainer.fit_loop.max_epochs = -1  # what Trainer.fit sets when max_steps alone bounds the run
    assert bar._get_train_description(0).strip() == "Epoch 0"  # not "Epoch 0/-2": max_steps bounds the run
    assert any(isinstance(c, HBMRichModelSummary) for c in cli.trainer.callbacks)
    quiet = _cli(tmp_path, "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false")
    assert not any(isinstance(c, (HBMRichModelSummary, HBMRichProgressBar)) for c in quiet.trainer.callbacks)


def test_model_summary_without_flops_hides_them(capsys: pytest.CaptureFixture) -> None:
    from lightning_hbm.display import HBMRichModelSummary

    data = [(" ", ["0"]), ("Name", ["model"]), ("Type", ["Linear"]), ("Params", ["1.0 K"]), ("Mode", ["train"]), ("FLOPs", ["0"])]
    HBMRichModelSummary.summarize(data, 1000, 10, 0.004, {"train": 1, "eval": 0}, total_flops=0)
    out = capsys.readouterr().out
    assert "FLOPs" not in out and "Linear" in out and "10 trainable, 990 frozen, 1.0 K total" in out


def test_name_list_puts_short_names_first() -> None:
    from lightning_hbm.naming import name_list

    paths = [f"model.layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "k_proj")] + ["lm_head"]
    assert name_list(paths) == "q_proj, k_proj, lm_head (9 in all, e.g. model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj, model.layers.1.self_attn.q_proj, ...)"
    assert name_list(["wte", "head"]) == "wte, head"
    assert name_list([f"a.m{i}" for i in range(30)], max_short=2).startswith("m0, m1, ... and 28 more names (30 in all")


def test_model_summary_counts_4bit_weights_unpacked(llama_factory: Any) -> None:
    from lightning_hbm.display import LogicalSummary
    from lightning_hbm.memory.storage import parameter_bytes

    model = llama_factory()
    logical = sum(p.numel() for p in model.parameters())
    lightning_hbm.quantize_model(model, "nf4-dq", dtype="float32", device="cpu")
    assert sum(p.numel() for p in model.parameters()) < logical  # what Lightning's own summary counts: packed
    summary = LogicalSummary(model, max_depth=1)
    assert summary.total_parameters == logical
    assert summary.trainable_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)  # not 4-bit
    assert sum(summary.param_nums) == logical
    assert summary.model_size == pytest.approx(parameter_bytes(model) / 1e6)


def test_plan_plans_the_trainer_section_fit_would_run(tmp_path: Path) -> None:
    """``lightning-hbm plan -c config.yaml`` plans the config's own plugin and callbacks, every option as set."""
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  plugins:\n"
        "    - class_path: lightning_hbm.QuantizedPrecision\n"
        "      init_args: {mode: nf4-dq, dtype: float32, ignore_modules: [model.model.layers.0.mlp]}\n"
        "  callbacks:\n"
        "    - class_path: lightning_hbm.LoRA\n"
        "      init_args: {r: 4, exclude_modules: [down_proj]}\n"
        "    - class_path: lightning_hbm.ActivationCheckpointing\n"
        "    - class_path: lightning_hbm.FusedLoss\n"
    )
    cli = PlanCLI(args=["-c", str(config), *TINY], run=False)
    (prediction,) = cli.plan.predictions
    assert prediction.candidate.name == "nf4-dq+lora4+ac-full+fused-loss (as configured)"
    plugin, callbacks = prediction.candidate.configured
    assert plugin.ignore_modules == ("model.model.layers.0.mlp",) and callbacks[0].exclude_modules is not None
    assert [type(c).__name__ for c in callbacks] == ["LoRA", "ActivationCheckpointing", "FusedLoss"]


@pytest.mark.slow
def test_plan_max_context_prints_the_longest_context_per_budget(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", *TINY, "--trainer.precision=nf4-dq", "--trainer.callbacks+=LoRA", "--max-context",
            "--budget=3MiB,6MiB", "--device=cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "longest context (tokens)" in out and "host RAM (pinned)" in out and "3.00 MiB" in out and "6.00 MiB" in out
    assert "'mlp_chunks'" in out and "predicted by the planner, not measured" in out
    # CUDA offloads the block inputs to pinned host RAM; a host budget of 1 byte turns the offload off
    assert main(["plan", *TINY, "--trainer.precision=nf4-dq", "--max-context", "--budget=774MiB", "--device=cuda",
                 "--host-budget=1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("774.00 MiB"))
    assert row.split()[5:8] == ["0", "B", "no"], row  # host RAM 0 B, offload no
    assert main(["plan", *TINY, "--max-context", "--device=cpu"]) == 2  # no budget: a clear error
    assert "--max-context needs --budget" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "max_context", "match"), [
    (["--max-regenerate=0"], True, r"--max-regenerate 0: must be an int >= 1 .*e\.g\. --max-regenerate 4"),
    (["--max-regenerate=-2", "--host-budget=64GiB"], True, r"--max-regenerate -2: must be an int >= 1"),
    (["--max-regenerate=4"], True, r"--max-regenerate 4 needs --max-context and --host-budget \(e\.g\. --host-budget 64GiB\)"),
    (["--max-regenerate=2", "--host-budget=64GiB"], False, r"--max-regenerate 2 needs --max-context and --host-budget"),
])  # fmt: skip
def test_plan_max_regenerate_refuses_bad_values_before_planning(args: list[str], max_context: bool, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlanCLI(args=[*TINY, "--budget=24GiB", "--device=cuda", *args], max_context=max_context, run=False)


def test_plan_max_context_offload_cell_names_the_inputs_kept_per_budget() -> None:
    # regenerate is chosen per budget (the 8B: 1 up to 24 GiB, 2, 3 and 4 above): said in each row's offload cell
    assert _offload_cell(True, 2) == "yes, 1 in 2 kept" and _offload_cell(True, 1) == "yes"
    assert _offload_cell(3, None) == "first 3 blocks" and _offload_cell(False) == "no"


def test_plan_max_regenerate_bad_value_is_a_one_line_error(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", *TINY, "--max-context", "--budget=24GiB", "--max-regenerate=0"]) == 2
    assert "lightning-hbm: error: lightning-hbm plan --max-regenerate 0: must be an int >= 1" in capsys.readouterr().err


def test_report_never_writes_its_input_even_on_a_full_disk(
    tmp_path: Path, llama_factory: Any, datamodule_factory: Any, trainer_factory: Any, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 55: ``lightning-hbm report DIR`` on a nearly full disk rewrote ``hbm_profile.json`` in place, cut it to
    8,192 B and ended in a traceback."""
    import errno

    run_dir = tmp_path / "run"
    trainer = trainer_factory(max_steps=2, callbacks=[HBMProfiler(summary=False)], default_root_dir=run_dir)
    trainer.fit(llama_factory(), datamodule=datamodule_factory())
    source = run_dir / "hbm_profile.json"
    before, mtime = source.read_bytes(), source.stat().st_mtime_ns
    main(["report", str(run_dir)])
    assert source.read_bytes() == before and source.stat().st_mtime_ns == mtime  # read, never written
    capsys.readouterr()
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert main(["report", str(run_dir)]) == 2
    monkeypatch.setattr(os, "fsync", real_fsync)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "No space left" in err and "is unchanged" in err
    assert source.read_bytes() == before
    assert not [p for p in run_dir.iterdir() if "partial" in p.name]  # no temp file left


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"rows": [{"step": 0, "mode": "light", "total": NaN}]}', r"holds NaN, which is no byte count"),
        ("[" * 200_000 + "]" * 200_000, r"nested too deep to be an HBMProfiler report"),
    ],
    ids=["nan", "deep"],
)
def test_report_bad_input_is_one_line_and_untouched(tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture) -> None:
    """Issue 55: a NaN-filled report, or one nested 200,000 deep: tracebacks (and the input file changed)."""
    source = tmp_path / "hbm_profile.json"
    source.write_text(text)
    with pytest.raises(ValueError, match=message):
        render_report(source)
    assert main(["report", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(source) in err
    assert source.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["hbm_profile.json"]


def test_report_strings_for_numbers_and_huge_files_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_hbm.memory import report as report_module
    from lightning_hbm.memory.categories import CATEGORIES

    row = {"step": 0, "mode": "light", **{c: 0 for c in CATEGORIES}, "total": 0}
    source = tmp_path / "hbm_profile.json"
    source.write_text(json.dumps({"rows": [{**row, "total": "12"}]}))
    with pytest.raises(ValueError, match=r"rows\[0\] field 'total' is '12', not a number of bytes"):
        render_report(source)
    source.write_text(json.dumps({"rows": [row] * 100}))
    monkeypatch.setattr(report_module, "MAX_INPUT_BYTES", 1000)
    with pytest.raises(ValueError, match=r"over the 0 MiB an HBMProfiler report can be"):
        render_report(source)
