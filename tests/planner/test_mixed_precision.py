"""The planner and a fixed mixed-precision plan (``Candidate(layer_modes=...)``, ``QuantizedPrecision(layer_modes=...)``).

The planner's parameter bytes for a plan equal ``predict_parameter_bytes`` (computed on the unquantized model)
and what a real ``Trainer.fit`` with the plan holds, on a transformers Llama and a GPT-2 (``Conv1D`` layers).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
import pytest
import torch
import yaml
from planner_families import FAMILIES
from torch.utils.data import DataLoader

from lightning_hbm import AutoFit, QuantizedPrecision
from lightning_hbm.cli import HBMCLI
from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory import parameter_bytes, quantization_tensors, tensor_bytes
from lightning_hbm.models import NanoGPT
from lightning_hbm.planner import (
    Candidate,
    default_candidates,
    predict,
    quantization_constant_bytes,
    quantized_parameter_bytes,
)
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.sensitivity import predict_parameter_bytes
from lightning_hbm.profiling.profiler import HBMProfiler

BATCH, SEQ = 2, 16

# pytest's own argv is in sys.argv while the CLI test hands LightningCLI its args: Lightning warns about both
pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter:UserWarning")


def _plan(factory: Callable[[], pl.LightningModule]) -> tuple[dict[str, str], list[str]]:
    """A mixed plan over the model's quantizable layers (2 in int8, 1 kept unquantized), and their names."""
    names = quantize_model(factory(), "nf4-dq")  # the layers QuantizedPrecision handles, by module name
    return {names[0]: "int8", names[-1]: "int8", names[1]: "none"}, names


def _fit(factory: Callable[[], pl.LightningModule], candidate: Candidate, tmp_path: Path) -> tuple[pl.LightningModule, dict]:
    """Two real steps with the candidate configured as a user would; the profiler measures step 1 in detail."""
    torch.manual_seed(0)
    model = factory()
    profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[candidate.precision_plugin()], callbacks=[*candidate.callbacks(), profiler],
    )  # fmt: skip
    batch = synthetic_batch(BATCH, SEQ)
    trainer.fit(model, DataLoader([tuple(t[i] for t in batch) for i in range(BATCH)] * 2, batch_size=BATCH))
    return model, profiler.rows[-1]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.slow
def test_mixed_plan_bytes_equal_predicted_and_measured(family: str, tmp_path: Path) -> None:
    factory = FAMILIES[family]
    plan, names = _plan(factory)
    candidate = Candidate("nf4-dq", lora_r=4, layer_modes=plan, quantize_embeddings=False)  # as quantize_model's bytes
    full_plan = {name: plan.get(name, "nf4-dq") for name in names}

    predicted = predict(factory, synthetic_batch(BATCH, SEQ), candidate)
    expected = predict_parameter_bytes(factory(), full_plan, "bfloat16")  # from the unquantized model's shapes
    assert quantized_parameter_bytes(factory, "nf4-dq", layer_modes=plan) == expected  # fake build, no LoRA

    model, measured = _fit(factory, candidate, tmp_path)
    assert model.trainer.precision_plugin.layer_modes == plan  # the plugin trained the planned plan
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    assert adapters > 0 and parameter_bytes(model) - adapters == expected  # the base, after a real fit
    for category in ("parameters", "gradients", "optimizer_states"):
        assert predicted.categories[category] == measured[category], category
    # the whole-step peak, with the tolerance of the planner/profiler consistency tests (tests/planner/test_api.py)
    assert predicted.peak == pytest.approx(measured["tracked_peak"], rel=0.10)
    assert predicted.peak == pytest.approx(measured["tracked_peak"], rel=0.01)  # what we reach (0.08 % on CPU, Nov 30)


@pytest.mark.slow
def test_mixed_plan_lies_between_uniform_int8_and_nf4() -> None:
    factory = FAMILIES["llama"]
    plan, _ = _plan(factory)
    mixed = quantized_parameter_bytes(factory, "nf4-dq", layer_modes=plan)
    assert quantized_parameter_bytes(factory, "nf4-dq") < mixed < quantized_parameter_bytes(factory, "int8")
    # the constants FSDP2 keeps whole on every rank, for the same plan: as in the real quantized model
    real = factory()
    quantize_model(real, "nf4-dq", layer_modes=plan)
    real_constants = tensor_bytes(t for m in real.modules() for t in quantization_tensors(m))
    assert quantization_constant_bytes(factory, "nf4-dq", layer_modes=plan, quantize_embeddings=False) == real_constants
    # int8-dynamic has no fake-tensor variant of its own: the plan's bitsandbytes layers must still be built fake
    dynamic = quantized_parameter_bytes(factory, "int8-dynamic", layer_modes={name: "nf4-dq" for name in plan})
    assert quantized_parameter_bytes(factory, "nf4-dq") < dynamic < quantized_parameter_bytes(factory, "int8-dynamic")


def test_candidate_names_costs_and_normalises_a_plan() -> None:
    plan = {"b.down": "int8", "a.up": "none", "a.q": "int8", "a.k": "nf4-dq"}
    candidate = Candidate("nf4-dq", lora_r=8, layer_modes=plan)
    assert candidate.name == "nf4-dq[mixed:2 int8,1 none]+lora8"
    assert candidate.layer_modes == tuple(sorted(plan.items()))  # hashable, order-free
    assert candidate == Candidate("nf4-dq", lora_r=8, layer_modes=dict(reversed(list(plan.items()))))
    assert hash(candidate) == hash(Candidate("nf4-dq", lora_r=8, layer_modes=candidate.layer_modes))
    # a plan costs what its slowest mode costs: int8 layers make a 4-bit base as slow as int8
    assert candidate.relative_cost() == Candidate("int8", lora_r=8).relative_cost()
    assert Candidate("nf4-dq", layer_modes={"a": "none"}).relative_cost() == Candidate("nf4-dq").relative_cost()
    assert Candidate("nf4-dq", layer_modes={}) == Candidate("nf4-dq")  # an empty plan is the uniform mode
    assert Candidate("nf4-dq", layer_modes={"a": "nf4-dq"}).name == "nf4-dq[mixed:all nf4-dq]"
    plugin = candidate.precision_plugin()
    assert isinstance(plugin, QuantizedPrecision) and plugin.layer_modes == plan and plugin.mode.name == "nf4-dq"
    grid = default_candidates(precisions=("bf16-true", "nf4-dq"), lora_ranks=(8,), checkpointing=("none",),
                              optimizers=("user",), layer_modes=plan)  # fmt: skip
    assert [c.name for c in grid] == ["bf16-true+lora8", "nf4-dq[mixed:2 int8,1 none]+lora8"]


def test_mixed_candidate_yaml_configures_the_plan_in_the_cli(tmp_path: Path) -> None:
    plan = {"model.model.layers.0.mlp.down_proj": "int8", "model.model.layers.1.self_attn.q_proj": "none"}
    snippet = Candidate("nf4-dq", lora_r=4, layer_modes=plan).yaml()
    config = tmp_path / "config.yaml"
    config.write_text(snippet)
    tiny = ["--model.init_args.hidden_size=64", "--model.init_args.intermediate_size=172",
            "--model.init_args.num_hidden_layers=2", "--data.init_args.seq_len=16", "--data.init_args.max_bytes=20000"]  # fmt: skip
    base = ["--trainer.accelerator=cpu", "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    cli = HBMCLI(args=["-c", str(config), *base, *tiny], run=False)
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, QuantizedPrecision) and plugin.mode.name == "nf4-dq" and plugin.layer_modes == plan
    # names a YAML reader would otherwise turn into numbers stay strings
    odd = yaml.safe_load(Candidate("int8", layer_modes={"0": "none", "1.2": "nf4"}).yaml())
    assert odd["trainer"]["plugins"][0]["init_args"]["layer_modes"] == {"0": "none", "1.2": "nf4"}


def test_bad_plans_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"precision 'bf16-true' quantizes nothing\. Use a lightning_hbm mode"):
        Candidate("bf16-true", layer_modes={"a": "int8"})
    with pytest.raises(ValueError, match=r"layer_modes\['a'\] = 'int4' is not a mode\. Use one of \[.*'int8'.*'none'\]"):
        Candidate("nf4-dq", layer_modes={"a": "int4"})
    with pytest.raises(TypeError, match=r"layer_modes must be a dict \{layer name: mode name\}, got str"):
        Candidate("nf4-dq", layer_modes="model.layers.0=int8")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"keys must be layer names \(non-empty strings\), got 3"):
        Candidate("nf4-dq", layer_modes={3: "int8"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"precisions=\['bf16-true'\] holds no quantized mode"):
        default_candidates(precisions=("bf16-true",), layer_modes={"a": "int8"})
    # a layer the model does not have: the plugin's own check, before anything is traced
    with pytest.raises(ValueError, match=r"layer_modes names \['model\.nope'\], which are not quantizable"):
        predict(FAMILIES["llama"], synthetic_batch(BATCH, SEQ), Candidate("nf4-dq", layer_modes={"model.nope": "int8"}))


@pytest.mark.slow
def test_autofit_plans_the_trainers_pinned_plan(tmp_path: Path) -> None:
    factory = FAMILIES["llama"]
    plan, _ = _plan(factory)
    autofit = AutoFit(budget="1GiB", precisions=[], lora_ranks=[4], checkpointing=["none"], optimizers=["user"], fused_loss=[False])
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", layer_modes=plan)],
        callbacks=[autofit],
    )  # fmt: skip
    batch = synthetic_batch(BATCH, SEQ)
    model = factory()
    trainer.fit(model, DataLoader([tuple(t[i] for t in batch) for i in range(BATCH)], batch_size=BATCH))
    assert autofit.chosen is not None and dict(autofit.chosen.candidate.layer_modes or ()) == plan
    assert autofit.chosen.categories["parameters"] == parameter_bytes(model)


@pytest.mark.slow
def test_plan_command_takes_a_plan(tmp_path: Path) -> None:
    from lightning_hbm.cli import PlanCLI

    plan = '{"model.model.layers.0.mlp.down_proj": "int8"}'  # e.g. "$(cat plan.json)" in a shell
    args = ["--model.init_args.hidden_size=64", "--model.init_args.intermediate_size=172",
            "--model.init_args.num_hidden_layers=2", "--data.init_args.seq_len=16", "--data.init_args.batch_size=2",
            "--data.init_args.max_bytes=20000", "--candidates.precisions=[nf4-dq]", "--candidates.lora_ranks=[4]",
            "--candidates.checkpointing=[none]", "--candidates.optimizers=[user]", f"--candidates.layer_modes={plan}"]  # fmt: skip
    cli = PlanCLI(args=args, run=False)
    assert [p.candidate.name for p in cli.plan.predictions] == ["nf4-dq[mixed:1 int8]+lora4"]


@pytest.mark.slow
def test_deep_model_with_a_plan_is_traced_whole() -> None:
    # 8 blocks would be traced cut to 3 and 4 and extended by a line; a plan differs block by block (here in the last)
    factory = partial(NanoGPT, n_layer=8, n_head=2, n_embd=32, block_size=32)
    names = quantize_model(factory(), "nf4-dq")
    plan = {"model.h.7.mlp.c_fc": "int8", names[0]: "none"}
    predicted = predict(factory, synthetic_batch(2, 8), Candidate("nf4-dq", layer_modes=plan, quantize_embeddings=False))
    assert predicted.categories["parameters"] == quantized_parameter_bytes(factory, "nf4-dq", layer_modes=plan)
