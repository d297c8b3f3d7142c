"""Sensitivity-aware mixed precision: the plan, its bytes, its errors and its resume (real bitsandbytes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizationQuality, QuantizedPrecision, quantize_model
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.sensitivity import choose_layer_modes, predict_parameter_bytes, upgrade_moves, weight_bytes
from lightning_hbm.precision.targets import _quantizable_linears

PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, _ in _quantizable_linears(model, ())[0]]


def plan_of(model: nn.Module, **targets: Any) -> Any:
    return choose_layer_modes(model, linear_names(model), "nf4-dq", "int8", "float32", PROBE, **targets)


def test_plan_is_deterministic_meets_the_budget_and_leaves_the_model_alone(gpt_factory: Any) -> None:
    model = gpt_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = plan_of(model, max_bytes_per_param=0.75)
    second = plan_of(model, max_bytes_per_param=0.75)
    assert first.modes == second.modes and first.cosine == second.cosine
    kept = [name for name, mode in first.modes.items() if mode == "int8"]
    assert kept and len(kept) < len(first.modes)
    assert first.uniform_bytes_per_param < first.bytes_per_param <= 0.75
    assert first.cosine > first.uniform_cosine  # what the budget bought, on the probe
    assert all(type(model.get_submodule(name)) is nn.Linear for name in first.modes)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_bf16_plan_on_an_fp32_model_leaves_it_fp32(gpt_factory: Any) -> None:
    model = gpt_factory(bias=True)
    report = choose_layer_modes(model, linear_names(model), "nf4-dq", "int8", "bfloat16", PROBE, max_bytes_per_param=0.75)
    assert "int8" in report.modes.values() and report.cosine > report.uniform_cosine
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # bitsandbytes casts biases in place: not ours


def test_min_cosine_stops_as_soon_as_it_is_reached(gpt_factory: Any) -> None:
    model = gpt_factory()
    uniform = plan_of(model, max_bytes_per_param=0.61)  # too small for any int8 layer here: the uniform figure
    target = uniform.uniform_cosine + (1 - uniform.uniform_cosine) / 2
    report = plan_of(model, min_cosine=target)
    assert report.cosine >= target
    assert report.bytes_per_param < plan_of(model, max_bytes_per_param=1.2).bytes_per_param


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_predicted_bytes_of_a_mixed_plan_equal_the_measured_parameter_bytes(gpt_factory: Any, dtype: str) -> None:
    model = gpt_factory()
    names = linear_names(model)
    modes = ["nf4-dq", "int8", "none", "int8-dynamic", "nf4"]
    plan = {name: modes[i % len(modes)] for i, name in enumerate(names)}
    predicted = predict_parameter_bytes(model, plan, dtype)
    quantize_model(model, "nf4-dq", dtype, layer_modes=plan)
    model(PROBE.clone())  # LLM.int8 moves its row scales into layer.state at the first forward
    assert predicted == parameter_bytes(model)
    assert type(model.get_submodule(names[2])) is nn.Linear and not model.get_submodule(names[2]).weight.requires_grad
    assert weight_bytes("none", 64, 32, torch.bfloat16) == 64 * 32 * 2


def test_impossible_byte_budget_is_an_error_before_training_naming_the_best_figure(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any
) -> None:
    model = gpt_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = trainer_factory(plugins=[QuantizedPrecision("nf4-dq", dtype="float32", max_bytes_per_param=0.4)])
    # 0.6048 (was 0.6016 while the untied lm_head counted among the quantizable Linears: it is the output head now)
    with pytest.raises(ValueError, match=r"max_bytes_per_param=0.4 cannot be met: .*'nf4-dq' already takes 0\.6048 bytes"):
        trainer.fit(model, datamodule_factory())
    assert trainer.global_step == 0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_unreachable_cosine_names_the_best_reachable_one(gpt_factory: Any) -> None:
    with pytest.raises(ValueError, match=r"min_cosine=1.0 cannot be met: the best probe output cosine reachable within "
                       r"max_bytes_per_param=0.7 is 0\.\d+ at 0\.\d+ bytes per parameter"):
        plan_of(gpt_factory(), min_cosine=1.0, max_bytes_per_param=0.7)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(max_bytes_per_param=float("nan")), ValueError, r"max_bytes_per_param=nan\): pass a finite number"),
        (dict(max_bytes_per_param=0), ValueError, r"max_bytes_per_param=0\): must be > 0"),
        (dict(min_cosine=1.5), ValueError, r"min_cosine=1.5\): must be in \(-1, 1\]"),
        (dict(min_cosine=0.9, sensitive_mode="int4"), ValueError, r"Unknown lightning_hbm precision mode 'int4'"),
        (dict(min_cosine=0.9, sensitive_mode="nf4-dq"), ValueError, r"sensitive layers need a wider mode"),
        (dict(min_cosine=0.9, sensitive_mode=["int8", "nf4-dq"]), ValueError, r"sensitive layers need a wider mode"),
        (dict(min_cosine=0.9, sensitive_mode=[]), ValueError, r"sensitive_mode=\[\]\): pass 'auto', a mode name or a non-empty"),
        (dict(min_cosine=0.9, sensitive_mode=8), TypeError, r"sensitive_mode=8\): wrong type int; pass a str or a list of strs"),
        (dict(min_cosine=0.9, sensitive_mode=["nf4-dq-b32", "int3"]), ValueError, r"Unknown lightning_hbm precision mode 'int3'"),
        (dict(min_cosine=0.9, probe_batch=3), TypeError, r"probe_batch=...\) must be a tensor"),
        (dict(min_cosine=0.9, layer_modes={"a": "int8"}), ValueError, r"either layer_modes .* or a target"),
        (dict(layer_modes={"a": "int3"}), ValueError, r"Unknown lightning_hbm precision mode 'int3'"),
    ],
)
def test_bad_arguments_are_errors_at_construction(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        QuantizedPrecision("nf4-dq", **kwargs)


def test_a_plan_naming_unknown_layers_is_an_error_before_any_change(gpt_factory: Any) -> None:
    model = gpt_factory()
    with pytest.raises(ValueError, match=r"layer_modes names \['blocks.9.mlp'\], which are not quantizable Linear"):
        quantize_model(model, "nf4-dq", "float32", layer_modes={"blocks.9.mlp": "int8"})
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n in linear_names(gpt_factory()))


def test_plan_is_logged_saved_and_rebuilt_on_resume(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    def plugin(**overrides: Any) -> QuantizedPrecision:
        return QuantizedPrecision("nf4-dq", dtype="float32", **{"max_bytes_per_param": 0.75, "probe_batch": PROBE, **overrides})

    quality = QuantizationQuality(probe_batch=PROBE, weight_sqnr=False, on_validation=False)
    first = plugin()
    trainer = trainer_factory(max_steps=2, plugins=[first], callbacks=[quality])
    trainer.fit(gpt_factory(), datamodule_factory())
    plan = first.quantization.layer_modes  # the Linears' plan, saved; the embeddings' int8 is the setting's (session 30)
    assert plan is not None and "int8" in plan.values()
    listed = first.layer_modes
    assert listed == {"model.wte": "int8", "model.wpe": "int8", **plan}  # plugin.layer_modes lists both
    # QuantizationQuality reports the metric the plan optimized, before (uniform) and after (the plan)
    assert quality.metrics["quant/layer_modes_cosine_similarity"] > quality.metrics["quant/uniform_cosine_similarity"]
    assert quality.metrics["quant/layer_modes_bytes_per_param"] <= 0.75
    path = tmp_path / "mixed.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["lightning_hbm"]["configs"]["QuantizedPrecision"]["layer_modes"] == plan

    # a fresh model with another init resumes with the saved plan (not one measured on its own weights)
    again = plugin()
    resumed = trainer_factory(max_steps=3, plugins=[again])
    resumed.fit(gpt_factory(seed=1), datamodule_factory(), ckpt_path=path)
    assert again.layer_modes == listed and resumed.global_step == 3
    # another plan (or another budget) is a resume error listing the difference
    other = {name: "nf4-dq" for name in plan}
    with pytest.raises(ValueError, match=r"other lightning_hbm settings(.|\n)*layer_modes"):
        trainer_factory(max_steps=3, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", layer_modes=other)]).fit(
            gpt_factory(), datamodule_factory(), ckpt_path=path
        )
    with pytest.raises(ValueError, match=r"other lightning_hbm settings(.|\n)*max_bytes_per_param"):
        trainer_factory(max_steps=3, plugins=[plugin(max_bytes_per_param=0.9)]).fit(
            gpt_factory(), datamodule_factory(), ckpt_path=path
        )


def test_lora_trains_on_a_mixed_base(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    import bitsandbytes as bnb
    from peft.tuners.lora import Linear4bit as LoraLinear4bit
    from peft.tuners.lora import Linear8bitLt as LoraLinear8bit

    from lightning_hbm import LoRA

    model = gpt_factory()
    names = linear_names(model)
    plan = {names[0]: "int8", names[1]: "none", names[3]: "nf4-dq-b32"}
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", layer_modes=plan)],
                              callbacks=[LoRA(r=4, target_modules="all-linear")])
    trainer.fit(model, datamodule_factory())
    # peft's quantization-aware layers for each kind (mergeable), a plain LoRA layer on the unquantized one
    assert isinstance(model.get_submodule(names[0]), LoraLinear8bit)
    assert isinstance(model.get_submodule(names[2]), LoraLinear4bit)
    assert isinstance(model.get_submodule(names[1]).get_base_layer(), nn.Linear)
    assert not isinstance(model.get_submodule(names[1]).get_base_layer(), (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    assert model.get_submodule(names[3]).get_base_layer().weight.quant_state.blocksize == 32
    for name in names[:4]:  # every kind of base passed gradients to its adapter (lora_B starts at zero)
        assert model.get_submodule(name).lora_B["default"].weight.abs().sum() > 0


def test_upgrade_moves_climb_each_layers_convex_hull_best_per_byte_first() -> None:
    cost = {"a": {"nf4": 100, "b32": 110, "int8": 200}, "b": {"nf4": 100, "b32": 110, "int8": 200}}
    error = {"a": {"nf4": 1.0, "b32": 0.7, "int8": 0.0}, "b": {"nf4": 0.5, "b32": 0.49, "int8": 0.0}}
    # a: 0.03/byte to b32, then 0.0078/byte to int8; b: its b32 point lies above the hull (0.001/byte < 0.005/byte)
    assert upgrade_moves(error, cost) == [("a", "b32", 10), ("a", "int8", 90), ("b", "int8", 100)]
    error["b"]["b32"] = 0.6  # more error for more bytes: never a move
    assert ("b", "b32", 10) not in upgrade_moves(error, cost)


def test_blocks_of_32_cut_the_error_for_exactly_the_predicted_bytes(gpt_factory: Any) -> None:
    from lightning_hbm.planner import quantized_parameter_bytes

    torch.manual_seed(0)
    linear = nn.Linear(256, 64, bias=False)
    x = torch.randn(16, 256)
    errors = {}
    for mode in ("nf4-dq", "nf4-dq-b32", "nf4", "nf4-b32"):
        layer = nn.Sequential(nn.Linear(256, 64, bias=False))
        layer[0].weight.data.copy_(linear.weight.data)
        quantize_model(layer, mode, "float32")
        with torch.no_grad():
            errors[mode] = float((layer(x) - linear(x)).norm() / linear(x).norm())
        assert parameter_bytes(layer) == weight_bytes(mode, 256, 64, torch.float32)
        # the planner's fake-tensor layers: the same bytes, without quantizing anything
        model = gpt_factory()
        quantize_model(model, mode, "float32")
        assert quantized_parameter_bytes(gpt_factory(), mode, "float32") == parameter_bytes(model)
    assert errors["nf4-dq-b32"] < errors["nf4-dq"] and errors["nf4-b32"] < errors["nf4"]
    # 4 bits a weight plus one absmax per block: fp32 per 32 weights, or 8 bits and nested constants with -dq
    assert weight_bytes("nf4-b32", 256, 64, torch.float32) - weight_bytes("nf4", 256, 64, torch.float32) == 256 * 64 // 64 * 4
    assert weight_bytes("nf4-dq", 256, 64, torch.float32) < weight_bytes("nf4-dq-b32", 256, 64, torch.float32) < weight_bytes("nf4-b32", 256, 64, torch.float32)


def test_auto_ladder_mixes_smaller_blocks_and_int8_within_the_budget(gpt_factory: Any) -> None:
    model = gpt_factory()
    report = choose_layer_modes(model, linear_names(model), "nf4-dq", "auto", "float32", PROBE, max_bytes_per_param=0.75)
    assert set(report.modes.values()) <= {"nf4-dq", "nf4-dq-b32", "int8"}
    assert report.uniform_bytes_per_param < report.bytes_per_param <= 0.75
    assert report.cosine > report.uniform_cosine
    assert report.bytes_per_param == pytest.approx(predict_parameter_bytes_per_param(model, report.modes), abs=1e-12)
    # the smallest step first: with a budget one b32 step wide, blocks of 32 and no int8 layer
    tight = choose_layer_modes(model, linear_names(model), "nf4-dq", "auto", "float32", PROBE,
                        max_bytes_per_param=report.uniform_bytes_per_param + 0.02)
    assert "nf4-dq-b32" in tight.modes.values() and "int8" not in tight.modes.values()


def predict_parameter_bytes_per_param(model: nn.Module, plan: dict[str, str]) -> float:
    """Bytes of the planned Linear weights per planned parameter (what SensitivityReport reports)."""
    layers = [model.get_submodule(name) for name in plan]
    nbytes = sum(weight_bytes(mode, layer.in_features, layer.out_features, torch.float32) for mode, layer in zip(plan.values(), layers))
    return nbytes / sum(layer.in_features * layer.out_features for layer in layers)


def test_a_budget_unreachable_because_the_layers_are_tiny_says_so() -> None:
    # session 39 (h6): a conv net whose only quantizable layer is a 32 x 5 head was told to raise the budget to 7.37
    # bytes per parameter with no cause given; the message now names the few weights as the cause
    from lightning_hbm.precision.sensitivity import _check_budget

    with pytest.raises(ValueError, match=r"cannot be met: storing every quantizable layer in 'nf4-dq' already takes "
                       r"7\.3688 .* These 1 layers hold only 160 weights, so each layer's fixed constants dominate"):
        _check_budget(0.6, 7.3688, 8.0, "nf4-dq", ["int8"], 160, 1)
    with pytest.raises(ValueError, match=r"0\.6048 bytes per parameter.*\)\. Raise max_bytes_per_param") as err:
        _check_budget(0.4, 0.6048, 1.0, "nf4-dq", ["int8"], 10**6, 8)
    assert "fixed constants" not in str(err.value)
