"""GPTQ rounding of bitsandbytes' 4-bit layers: same format and bytes, less error, resumable (real bitsandbytes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, quantize_model
from lightning_hbm.quality import compare_outputs, probe_output
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.gptq import input_hessians, pack_indices
from lightning_hbm.precision.targets import _quantizable_linears

PROBE = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
HELD_OUT = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))


def names_of(model: nn.Module) -> list[str]:
    return [name for name, _ in _quantizable_linears(model, ())[0]]


def test_packing_is_bitsandbytes_own_layout() -> None:
    import bitsandbytes.functional as F

    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    # bitsandbytes rounds with the exact block absmax, then quantizes the absmax itself (double quantization)
    blocks = weight.reshape(-1, 64)
    nearest = ((blocks / blocks.abs().amax(1, keepdim=True)).reshape(-1, 1) - state.code[None]).abs().argmin(1)
    assert torch.equal(pack_indices(nearest.reshape(16, 64)), packed)


@pytest.mark.parametrize("mode", ["nf4-dq", "nf4-dq-b32", "fp4", "nf4-torchao"])
def test_gptq_rounding_lowers_the_output_error_at_the_same_bytes(gpt_factory: Any, mode: str) -> None:
    reference_model = gpt_factory()
    with torch.no_grad():
        reference, held_out = probe_output(reference_model, PROBE), probe_output(reference_model, HELD_OUT)
    hessians = input_hessians(reference_model, names_of(reference_model), PROBE)
    errors, sizes = {}, {}
    for rounding in ("nearest", "gptq"):
        model = gpt_factory()
        quantize_model(model, mode, "float32", hessians=hessians if rounding == "gptq" else None)
        with torch.no_grad():
            errors[rounding] = (
                compare_outputs(probe_output(model, PROBE), reference, lm=True)["quant/relative_error"],
                compare_outputs(probe_output(model, HELD_OUT), held_out, lm=True)["quant/relative_error"],
            )
        sizes[rounding] = parameter_bytes(model)
    assert sizes["gptq"] == sizes["nearest"]
    assert errors["gptq"][0] < 0.8 * errors["nearest"][0]  # on the probe it was fitted to
    assert errors["gptq"][1] < errors["nearest"][1]  # and on other inputs


@pytest.mark.slow
def test_blocks_spanning_two_rows_and_odd_sizes_are_rounded_in_place() -> None:
    # 63 inputs: bitsandbytes' blocks of 64 run over the flattened weight, across rows; 315 weights: odd
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(63, 5), nn.GELU(), nn.Linear(5, 3))
    probe = torch.randn(64, 63)
    hessians = input_hessians(reference, ["0", "2"], probe)
    errors = {}
    for rounding in ("nearest", "gptq"):
        model = nn.Sequential(nn.Linear(63, 5), nn.GELU(), nn.Linear(5, 3))
        model.load_state_dict(reference.state_dict())
        quantize_model(model, "nf4-dq", "float32", hessians=hessians if rounding == "gptq" else None)
        with torch.no_grad():
            errors[rounding] = float((model(probe) - reference(probe)).norm())
    assert errors["gptq"] < errors["nearest"]


def test_layers_reading_one_input_share_one_hessian(llama_factory: Any, gpt_factory: Any, caplog: Any) -> None:
    model = llama_factory()
    names = names_of(model)
    hessians = input_hessians(model, names, PROBE)
    assert set(hessians) == set(names)
    q, k, v, o = (next(n for n in names if n.endswith(f"layers.0.self_attn.{p}_proj")) for p in "qkvo")
    assert hessians[q] is hessians[k] is hessians[v]  # one input, one matrix
    assert hessians[o] is not hessians[q] and hessians[o].shape == (model.get_submodule(o).in_features,) * 2
    torch.testing.assert_close(hessians[q], hessians[q].t())
    gpt = gpt_factory()
    caplog.clear()  # the Llama's 128 probe tokens were short for its 172-input down_proj
    with caplog.at_level("WARNING", logger="lightning_hbm"):
        input_hessians(gpt, names_of(gpt), torch.cat([PROBE, HELD_OUT]))
    assert "fewer probe rows" not in caplog.text  # 256 tokens for inputs of at most 256
    with caplog.at_level("WARNING", logger="lightning_hbm"):
        input_hessians(gpt, names_of(gpt), PROBE[:1, :8])
    assert "GPTQ / correction statistics from fewer probe rows (tokens) than inputs" in caplog.text and "at least 256 tokens" in caplog.text


@pytest.mark.slow
def test_gptq_plugin_trains_lora_and_resumes_bit_exact(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any, caplog: Any
) -> None:
    def plugin(**overrides: Any) -> QuantizedPrecision:
        return QuantizedPrecision("nf4-dq", dtype="float32", rounding="gptq", **{"probe_batch": PROBE, **overrides})

    first = plugin()
    trainer = trainer_factory(max_steps=2, plugins=[first], callbacks=[LoRA(r=4, target_modules="all-linear")])
    with caplog.at_level("INFO", logger="lightning_hbm"):
        trainer.fit(gpt_factory(), datamodule_factory())
    assert "GPTQ rounding of" in caplog.text and first.rounding_digest is not None
    path = tmp_path / "gptq.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["lightning_hbm"]["gptq_digest"] == first.rounding_digest
    assert checkpoint["lightning_hbm"]["configs"]["QuantizedPrecision"]["rounding"] == "gptq"
    assert checkpoint["lightning_hbm"]["omitted"]  # adapter-only: the base is rebuilt, rounding included

    again = plugin()
    resumed = trainer_factory(max_steps=3, plugins=[again], callbacks=[LoRA(r=4, target_modules="all-linear")])
    resumed.fit(gpt_factory(), datamodule_factory(), ckpt_path=path)
    assert again.rounding_digest == first.rounding_digest and resumed.global_step == 3

    # another probe rounds the base differently: an error naming the fix, before any step
    other = plugin(probe_batch=HELD_OUT)
    failing = trainer_factory(max_steps=3, plugins=[other], callbacks=[LoRA(r=4, target_modules="all-linear")])
    with pytest.raises(ValueError, match=r"GPTQ rounding rebuilt for this resume .* differs .* same probe_batch"):
        failing.fit(gpt_factory(), datamodule_factory(), ckpt_path=path)
    assert failing.global_step == 0
    # nearest rounding against a GPTQ checkpoint: a settings difference
    with pytest.raises(ValueError, match=r"other lightning_hbm settings(.|\n)*rounding"):
        trainer_factory(max_steps=3, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                        callbacks=[LoRA(r=4, target_modules="all-linear")]).fit(gpt_factory(), datamodule_factory(), ckpt_path=path)


@pytest.mark.slow
def test_gptq_measures_the_plan_on_rounded_layers(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", rounding="gptq", probe_batch=PROBE, max_bytes_per_param=0.7)
    trainer_factory(max_steps=1, plugins=[plugin]).fit(gpt_factory(), datamodule_factory())
    nearest = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=PROBE, max_bytes_per_param=0.7)
    trainer_factory(max_steps=1, plugins=[nearest]).fit(gpt_factory(), datamodule_factory())
    assert plugin.plan_report.uniform_cosine > nearest.plan_report.uniform_cosine


def test_unknown_rounding_is_an_error_at_construction() -> None:
    with pytest.raises(ValueError, match=r"rounding='gptqq'\): use one of \['nearest', 'gptq'\]"):
        QuantizedPrecision("nf4-dq", rounding="gptqq")


@pytest.mark.gpu
def test_cuda_gptq_rounding_matches_cpu_and_keeps_its_gain(gpt_factory: Any) -> None:
    # not yet run on GPU (no GPU in the session that wrote it): rounding where the weights live, on CUDA
    reference_model = gpt_factory()
    hessians = input_hessians(reference_model, names_of(reference_model), torch.cat([PROBE, HELD_OUT]))
    with torch.no_grad():
        reference = probe_output(reference_model, HELD_OUT)
    models = {}
    for device, rounding in (("cpu", "gptq"), ("cuda", "gptq"), ("cuda", "nearest")):
        model = gpt_factory()
        quantize_model(model, "nf4-dq", "float32", device=device, hessians=hessians if rounding == "gptq" else None)
        models[device, rounding] = model.to(device)
    names = [n for n in names_of(reference_model)]
    same = [
        float((models["cpu", "gptq"].get_submodule(n).weight.data == models["cuda", "gptq"].get_submodule(n).weight.data.cpu()).float().mean())
        for n in names
    ]
    assert min(same) > 0.99  # the same rounding up to ties in float arithmetic
    with torch.no_grad():
        errors = {key: compare_outputs(probe_output(model, HELD_OUT.to(key[0])).cpu(), reference, lm=True)["quant/relative_error"]
                  for key, model in models.items()}
    assert errors["cuda", "gptq"] < errors["cuda", "nearest"]


def test_a_format_without_a_code_grid_keeps_nearest_rounding_and_is_named(gpt_factory: Any, caplog: Any) -> None:
    from lightning_hbm.precision.gptq import gptq_round_, grid_of

    model = gpt_factory()
    names = names_of(model)
    weight = model.get_submodule(names[0]).weight.detach().clone()
    plugin = QuantizedPrecision("int8", dtype="float32", rounding="gptq", probe_batch=PROBE)
    with caplog.at_level("INFO", logger="lightning_hbm"):
        plugin.convert_module(model)
    layer = model.get_submodule(names[0])
    assert grid_of(layer) is None and plugin.rounding_digest == f"{0:08x}"
    assert "GPTQ rounding of 0 4-bit layers" in caplog.text and f"'{names[0]}': 'int8'" in caplog.text
    with pytest.raises(TypeError, match=r"GPTQ rounding: Linear8bitLt has no code grid"):
        gptq_round_(layer, weight, torch.eye(weight.shape[1]))
