"""``nf4-torchao`` (lightning_hbm/precision/torchao_nf4.py): a format added in one file, asked by every consumer."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchao")

from lightning_hbm import QuantizedPrecision, available_precisions, quantize_model  # noqa: E402
from lightning_hbm.adapters.lora import LoRA  # noqa: E402
from lightning_hbm.layers import report_coverage  # noqa: E402
from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes  # noqa: E402
from lightning_hbm.models import NanoGPT  # noqa: E402
from lightning_hbm.planner import quantized_parameter_bytes  # noqa: E402
from lightning_hbm.precision import format_of, get_format  # noqa: E402
from lightning_hbm.precision.sensitivity import ladder  # noqa: E402
from lightning_hbm.precision.torchao_nf4 import NF4Linear, TorchaoNF4Format, scaler_block_size  # noqa: E402
from lightning_hbm.quality import QuantizationQuality  # noqa: E402

MODE = "nf4-torchao"
TINY_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)


def nf4_layers(model: nn.Module) -> list[NF4Linear]:
    return [m for m in model.modules() if isinstance(m, NF4Linear)]


def expected_weight_bytes(numel: int, dtype: torch.dtype) -> int:
    """torchao's NF4 layout: 4-bit codes, one int8 scale per 64 weights, one factor per scaler block, a mean, a
    16-entry code book (the last three in the weight's dtype). With a single scaler block, torchao's one factor is
    a view that keeps its whole ``[1, scaler block]`` quotient alive: that storage is what memory holds."""
    blocks = numel // 64
    scaler_blocks = blocks // scaler_block_size(numel)
    factors = scaler_block_size(numel) if scaler_blocks == 1 else scaler_blocks
    return numel // 2 + blocks + (factors + 1 + 16) * dtype.itemsize


def test_registered_by_its_file_alone() -> None:
    assert MODE in available_precisions()
    fmt = get_format(MODE)
    assert isinstance(fmt, TorchaoNF4Format) and fmt.peft_kind is None and fmt.dense_forward
    assert ladder(MODE, "auto") == ("int8-dynamic", "none")  # wider modes without bitsandbytes
    assert scaler_block_size(64 * 256) == 256 and scaler_block_size(64 * 192) == 192 and scaler_block_size(64 * 7) == 7


def test_outputs_close_to_the_original_and_exactly_the_dequantized_matmul(gpt_factory: Any) -> None:
    model = gpt_factory()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    with torch.no_grad():
        reference = model(tokens)
        names = quantize_model(model, MODE, dtype="float32", quantize_head=True)
        quantized = model(tokens)
    layers = nf4_layers(model)
    assert len(layers) == len(names) == 9
    # the same algorithm as bitsandbytes' nf4-dq (QLoRA's), so the same error: measured 0.1214 both
    bnb = gpt_factory()
    with torch.no_grad():
        quantize_model(bnb, "nf4-dq", dtype="float32", quantize_head=True)
        bnb_error = ((bnb(tokens) - reference).norm() / reference.norm()).item()
    error = ((quantized - reference).norm() / reference.norm()).item()
    assert 0 < error < 1.05 * bnb_error
    for name in names:
        layer = model.get_submodule(name)
        fmt = format_of(layer)
        assert isinstance(fmt, TorchaoNF4Format) and not layer.weight.requires_grad
        weight = fmt.dequantize(layer)
        assert 0.05 < ((weight - original[name]).norm() / original[name].norm()).item() < 0.12
        x = torch.randn(3, layer.in_features)
        torch.testing.assert_close(layer(x), F.linear(x, weight, layer.bias), rtol=0, atol=0)
    assert all(p.requires_grad for n, p in model.named_parameters() if n.endswith("bias"))
    # the coverage table counts them as quantized (their weight says bfloat16/float32: the format is asked)
    [linear] = [row for row in report_coverage(model, quantizing=True) if row.kind == "Linear"]
    assert linear.quantized == linear.params > 0


def test_deepcopy_copies_the_codes_instead_of_quantizing_again(gpt_factory: Any) -> None:
    model = gpt_factory()
    quantize_model(model, MODE, dtype="float32", quantize_head=True)
    tokens = torch.randint(0, 256, (2, 16))
    twin = copy.deepcopy(model)  # torchao's own clone would re-quantize (and fail on blocks 256 does not divide)
    with torch.no_grad():
        torch.testing.assert_close(twin(tokens), model(tokens), rtol=0, atol=0)
    for mine, theirs in zip(nf4_layers(model), nf4_layers(twin)):
        assert theirs.weight.quantized_data.data_ptr() != mine.weight.quantized_data.data_ptr()
        assert not theirs.weight.requires_grad and (theirs.bias is None or theirs.bias is not mine.bias)


def test_storage_counting_is_exact(gpt_factory: Any) -> None:
    model = gpt_factory()
    unquantized = sum(p.numel() for n, p in model.named_parameters() if not isinstance(model.get_submodule(n.rpartition(".")[0]), nn.Linear) or n.endswith("bias"))
    quantize_model(model, MODE, dtype="bfloat16", quantize_head=True)
    weights = 0
    for layer in nf4_layers(model):
        expected = expected_weight_bytes(layer.weight.numel(), torch.bfloat16)
        assert unique_bytes([layer.weight]) == expected  # the tensor subclass's inner storages
        constants = quantization_tensors(layer)  # what the format lists: counted once with the weight
        assert len(constants) == 4 and unique_bytes([layer.weight, *constants]) == expected
        weights += expected
    assert parameter_bytes(model) == weights + 2 * unquantized  # everything else in bf16


def test_planner_predicts_its_parameter_bytes_exactly() -> None:
    torch.manual_seed(0)
    real = NanoGPT(**TINY_GPT)
    planned = quantized_parameter_bytes(real, MODE, "bfloat16")  # a fake-tensor copy: the format ran on FakeTensors
    quantize_model(real, MODE, "bfloat16")
    assert planned == parameter_bytes(real)
    assert planned < parameter_bytes(NanoGPT(**TINY_GPT)) / 3


def test_lora_trains_and_merges(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=3, plugins=[QuantizedPrecision(MODE, dtype="float32")], callbacks=[LoRA(r=4)])
    trainer.fit(model, datamodule_factory())
    adapted = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_B")]
    assert adapted and all(m.lora_B["default"].weight.abs().sum() > 0 for _, m in adapted)  # trained from zeros
    with pytest.warns(UserWarning, match=r"merged into their DEQUANTIZED base weights"):
        merged = LoRA.merge(model, dtype="float32")
    for name, layer in adapted:
        base = layer.get_base_layer()
        expected = format_of(base).dequantize(base).float() + layer.get_delta_weight("default").float()
        torch.testing.assert_close(merged[f"{name}.weight"], expected)


def test_checkpoint_loads_into_a_fresh_model_and_training_resumes(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    tokens = torch.randint(0, 256, (2, 16))
    model = gpt_factory(seed=0)
    trainer = trainer_factory(max_steps=3, plugins=[QuantizedPrecision(MODE, dtype="float32")])
    trainer.fit(model, datamodule_factory())
    path = tmp_path / "nf4.ckpt"
    trainer.save_checkpoint(path)
    with torch.no_grad():
        expected = model(tokens)
    fresh = gpt_factory(seed=1)  # other weights: only the checkpoint can make the outputs equal
    resumed = trainer_factory(max_steps=5, plugins=[QuantizedPrecision(MODE, dtype="float32")])
    resumed.fit(fresh, datamodule_factory(), ckpt_path=path)
    assert resumed.global_step == 5
    assert nf4_layers(fresh)
    again = gpt_factory(seed=2)
    trainer_factory(max_steps=3, plugins=[QuantizedPrecision(MODE, dtype="float32")]).fit(again, datamodule_factory(), ckpt_path=path)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), expected, rtol=0, atol=0)


def test_quality_callback_dequantizes_it(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    quality = QuantizationQuality()
    plugin = QuantizedPrecision(MODE, dtype="float32", quantize_head=True)  # all 9 Linears, the output head too
    trainer = trainer_factory(max_steps=0, plugins=[plugin], callbacks=[quality])
    trainer.fit(gpt_factory(), datamodule_factory())
    assert len(quality.layer_sqnr) == 9
    assert all(15 < sqnr < 25 for _, sqnr in quality.layer_sqnr)  # 4-bit: ~20 dB (bitsandbytes nf4 alike)


def test_a_layer_that_does_not_fill_its_blocks_is_refused_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 3))
    with pytest.raises(ValueError, match=r"blocks of 64, but 2 has 30 weights \(\(3, 10\)\).*ignore_modules=\['2'\]"):
        quantize_model(model, MODE, dtype="float32", quantize_head=True)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # nothing quantized
    quantize_model(model, MODE, dtype="float32", ignore_modules=["2"])
    assert isinstance(model[0], NF4Linear) and type(model[2]) is nn.Linear


def test_torchao_missing_is_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    with pytest.raises(ModuleNotFoundError, match=r"'nf4-torchao' needs torchao .*pip install torchao"):
        quantize_model(nn.Sequential(nn.Linear(64, 64)), MODE, dtype="float32")
