"""GPTQ rounding of bitsandbytes' 4-bit layers: same format and bytes, less error, resumable (real bitsandbytes)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, quantize_model
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.gptq import input_hessians, pack_indices
from lightning_hbm.precision.targets import _quantizable_linears
from lightning_hbm.quality import compare_outputs, probe_output

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
    assert plugin.sensitivity_report.uniform_cosine > nearest.sensitivity_report.uniform_cosine


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
    with caplog.at_level("INFO", logger="lightning_hbm"), pytest.warns(
        UserWarning, match=rf"rounding='gptq'\): {len(names)} quantized layer\(s\) keep nearest rounding .*: .*"
        r"its mode \(int8\) has no GPTQ code grid and rounds to nearest \(fix: GPTQ rounds bitsandbytes' 4-bit modes"
    ):
        plugin.convert_module(model)
    layer = model.get_submodule(names[0])
    assert grid_of(layer) is None and plugin.rounding_digest == f"{0:08x}"
    assert "GPTQ rounding of 0 4-bit layers" in caplog.text
    with pytest.raises(TypeError, match=r"GPTQ rounding: Linear8bitLt has no code grid"):
        gptq_round_(layer, weight, torch.eye(weight.shape[1]))


class Mixed(nn.Module):
    """A transposed convolution, a Linear the forward never calls, one the plan stores in int8, one GPTQ rounds."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.a, self.b, self.unused = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.up(x).flatten(2)))


def test_the_layers_gptq_leaves_at_nearest_rounding_are_named_at_the_surgery_with_the_reason_and_the_fix() -> None:
    """Was: one log line (and a transposed convolution got its input's last dimension as statistics: a shape error
    in the rounding). Each reason, its layers by name and count, and what to do."""
    from lightning_hbm.precision.gptq import grid_of

    torch.manual_seed(0)
    model = Mixed()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", rounding="gptq", probe_batch=torch.randn(32, 4, 4, 4),
                                quantize_head=True, layer_modes={"b": "int8"})  # fmt: skip
    with pytest.warns(UserWarning, match=r"rounding='gptq'\): 3 quantized layer\(s\) keep nearest rounding") as seen:
        plugin.convert_module(model)
    said = next(str(w.message) for w in seen if "keep nearest rounding" in str(w.message))
    assert "): up: a transposed convolution, whose stored matrix is no linear map of its input patches (fix: keep them" in said
    assert "; b: its mode (int8) has no GPTQ code grid" in said
    assert "; unused: the probe forward never ran it (no input statistics) (fix: pass a probe_batch whose forward" in said
    assert " a:" not in said and grid_of(model.a) is not None  # rounded: not named



class Reads(nn.Module):
    """Weights multiplied by the model's code: ``x @ W.T``, ``W @ y`` (Mamba's dt_proj), and a layer both called and read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.a.weight.T
        z = (self.b.weight @ y.transpose(1, 2)).transpose(1, 2)
        return self.c(z) + torch.nn.functional.linear(z, self.c.weight.to(torch.float32))


def test_the_inputs_a_read_weight_is_multiplied_with_are_its_statistics() -> None:
    from lightning_hbm.layers import find_layers, readers
    from lightning_hbm.precision.gptq import input_statistics

    torch.manual_seed(0)
    model, x = Reads(), torch.randn(3, 5, 8)
    readers.observe(model, x, {name: layer for name, layer, _ in find_layers(model)})  # the probe step marks them
    hessians, rows = input_statistics(model, ["a", "b", "c"], x)
    with torch.no_grad():
        y = x @ model.a.weight.T
        z = (model.b.weight @ y.transpose(1, 2)).transpose(1, 2)
    assert rows == {"a": 15, "b": 15, "c": 30}  # c: its call and its read
    for name, inputs in (("a", x), ("b", y), ("c", z)):
        flat = inputs.reshape(-1, 8)
        torch.testing.assert_close(hessians[name], 2 * flat.t() @ flat / 15, rtol=1e-5, atol=1e-6, msg=name)


def _ranks_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64), nn.GELU(), nn.Linear(64, 32))


# each rank's 48 rows are fewer than a layer's 64 or 96 inputs: its own H is singular, its rounding far from the pooled one
RANKS_PROBE = torch.randn(96, 64, generator=torch.Generator().manual_seed(3))


def _rounded(rank: int, world: int) -> dict[str, torch.Tensor]:
    """The packed 4-bit weights of :func:`_ranks_model` GPTQ-rounded on rank ``rank``'s share of the probe (rows
    ``rank::world``): the statistics a rank's own batches give, pooled by :func:`input_statistics` under a group."""
    from lightning_hbm.layers import stored_in
    from lightning_hbm.precision.gptq import input_statistics

    model = _ranks_model()
    names = ["0", "2", "4"]
    hessians, _ = input_statistics(model, names, RANKS_PROBE[rank::world])
    quantize_model(model, "nf4-dq", "float32", quantize_head=True, hessians=hessians)
    return {name: (stored_in(model.get_submodule(name)) or model.get_submodule(name)).weight.detach().clone() for name in names}


def _rank_main(rank: int, port: int, out: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(_rounded(rank, 2), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_round_as_one_process_on_the_pooled_probe(tmp_path: Path) -> None:
    """Was (issue 52): each rank GPTQ-rounded from the Hessian of its own probe rows, so the two ranks' copies of a
    weight differed, and neither was the one-process rounding (here 49 % of the first layer's packed bytes differed
    from it on rank 0, 59 % between the ranks). Pooled, both ranks store the one-process rounding of all the rows, bit
    for bit (the pooled matrices equal to float rounding; no index fell on a tie)."""
    import lightning_hbm

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(lightning_hbm.__file__).resolve().parents[1]), env.get("PYTHONPATH")) if p)
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(rank), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]  # fmt: skip
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(o[-3000:] for o in outputs)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for name, packed in _rounded(0, 1).items():
        assert torch.equal(ranks[0][name], packed) and torch.equal(ranks[1][name], packed), name


if __name__ == "__main__" and sys.argv[1] == "rank":
    _rank_main(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
