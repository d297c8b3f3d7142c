"""``int8-dynamic-smooth``: SmoothQuant-style smoothing folded into int8-dynamic layers (real transformers, real peft)."""

from __future__ import annotations

import copy
import logging
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, quantize_model
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.int8_dynamic import Int8DynamicLinear
from lightning_hbm.precision.sensitivity import predict_parameter_bytes, weight_bytes
from lightning_hbm.precision.smoothing import attached, choose_smoothing
from lightning_hbm.precision.targets import _quantizable_linears
from lightning_hbm.record import input_shift

PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


class TinyBert(nn.Module):
    """A transformers BERT encoder from a config, with outlier channels put into its LayerNorms.

    Pretrained BERTs have a few hidden channels 10-100x larger than the others after LayerNorm (what
    makes per-token INT8 activations lose the other channels); random init has none, so they are injected.
    """

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
        self.bert = BertModel(config, add_pooling_layer=False)
        with torch.no_grad():
            self.bert.embeddings.LayerNorm.weight[[7, 40]] = 60.0
            for layer in self.bert.encoder.layer:
                layer.attention.output.LayerNorm.weight[[3, 17]] = 60.0
            self.bert.encoder.layer[0].output.LayerNorm.weight[5] = 50.0  # not the last: the output stays plain

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids).last_hidden_state


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, _ in _quantizable_linears(model, ())[0]]


def relative_error(model: nn.Module, shifts: dict[str, torch.Tensor], mode: str, x: torch.Tensor) -> float:
    reference = model(x)
    quantized = copy.deepcopy(model)
    with attached(quantized, shifts):
        quantize_model(quantized, mode, "float32")
    return ((quantized(x) - reference).norm() / reference.norm()).item()


def test_fold_is_exact_before_rounding_forward_and_backward() -> None:
    # W = A * 2**-e and x = B * 2**e with integer A, B whose rows reach 127: the stored W * 2**e and the
    # smoothed input x / 2**e are A and B exactly, so rounding is a no-op and only the fold remains.
    gen = torch.Generator().manual_seed(0)
    shift = torch.randint(-3, 4, (32,), generator=gen).to(torch.int8)
    a = torch.randint(-127, 128, (16, 32), generator=gen).float()
    b = torch.randint(-127, 128, (5, 32), generator=gen).float()
    a[:, 0], b[:, 0] = 127.0, 127.0
    factor = torch.exp2(shift.float())
    linear = nn.Linear(32, 16, bias=False)
    linear.weight.data = a / factor
    x = (b * factor).requires_grad_(True)
    layer = Int8DynamicLinear.from_linear(linear, input_shift=shift)
    assert torch.equal(layer.weight.float(), a) and torch.equal(layer.dequantize(), linear.weight)
    out = layer(x)
    assert torch.equal(out, F.linear(x.detach(), linear.weight))  # equal in exact arithmetic, bit for bit
    grad = torch.randn(5, 16, generator=gen)
    out.backward(grad)
    assert torch.equal(x.grad, grad @ linear.weight)  # the gradient w.r.t. the original (unsmoothed) input


def test_smoothing_lowers_the_error_of_outlier_channels_at_exact_bytes() -> None:
    model = TinyBert().eval()
    names = linear_names(model)
    held_out = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        naive = relative_error(model, {}, "int8-dynamic", held_out)
        for alpha in ("auto", 0.5):
            report = choose_smoothing(model, names, alpha, "float32", PROBE)
            smoothed = relative_error(model, report.shifts, "int8-dynamic-smooth", held_out)
            assert smoothed < 0.5 * naive, (alpha, smoothed, naive)  # measured 0.38x (auto), 0.41x (0.5)
            assert report.cosine_after > report.cosine_before
    # deterministic for a fixed probe, and the model as built is left alone
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = (choose_smoothing(model, names, "auto", "float32", PROBE) for _ in range(2))
    assert first.alphas == second.alphas and all(torch.equal(first.shifts[n], second.shifts[n]) for n in names)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(input_shift(p) is not None for p in model.parameters())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_predicted_bytes_of_a_mixed_plan_equal_the_measured_bytes(dtype: str) -> None:
    model = TinyBert()
    names = linear_names(model)
    # one byte per input channel on top of int8-dynamic
    assert weight_bytes("int8-dynamic-smooth", 64, 128, torch.float32) == 64 * 128 + 4 * 128 + 64
    plan = {name: ("int8-dynamic-smooth", "int8-dynamic", "none")[i % 3] for i, name in enumerate(names)}
    predicted = predict_parameter_bytes(model, plan, dtype)
    shifts = choose_smoothing(model, names, 0.5, dtype, PROBE).shifts
    with attached(model, shifts):
        quantize_model(model, "int8-dynamic", dtype, layer_modes=plan)
    assert sum(isinstance(m, Int8DynamicLinear) and m.input_shift is not None for m in model.modules()) == len(names[::3])
    assert parameter_bytes(model) == predicted


@pytest.mark.slow
def test_planner_bytes_equal_the_plugin_s_smoothed_model(llama_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.planner import Candidate, predict
    from lightning_hbm.planner.api import quantized_parameter_bytes

    # the planner's fake-tensor model: the plugin measures nothing there (the exponents change no byte)
    planned = quantized_parameter_bytes(llama_factory(), "int8-dynamic-smooth", "float32")
    # the embeddings kept (quantize_embeddings=False), as quantize_model keeps them: the smoothed Linears' bytes compared
    prediction = predict(partial(llama_factory), synthetic_batch(2, 16), Candidate("int8-dynamic-smooth", dtype="float32", quantize_embeddings=False))
    model = llama_factory()
    trainer_factory(max_steps=1, plugins=[QuantizedPrecision("int8-dynamic-smooth", dtype="float32", probe_batch=PROBE, quantize_embeddings=False)]).fit(
        model, datamodule_factory()
    )
    assert planned == prediction.categories["parameters"] == parameter_bytes(model)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "int8-dynamic", "smoothing": 0.5}, r"smoothing applies to layers stored in 'int8-dynamic-smooth'"),
        ({"mode": "int8-dynamic-smooth", "smoothing": 1.5}, r"smoothing=1.5\): pass the SmoothQuant migration strength"),
        ({"mode": "int8-dynamic-smooth", "smoothing": "best"}, r"smoothing='best'\): pass .* or 'auto'"),
        ({"mode": "int8-dynamic-smooth", "smoothing": True}, r"smoothing=True\): a bool, and True/False is not a number here"),
    ],
)
def test_bad_smoothing_arguments_are_errors_at_construction(kwargs: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        QuantizedPrecision(**kwargs)


def test_auto_never_ends_worse_than_unsmoothed_on_the_probe(llama_factory: Any) -> None:
    # a random-weight Llama has no outlier channels: whatever "auto" keeps must not lower the probe cosine
    model = llama_factory().eval()
    names = linear_names(model)
    report = choose_smoothing(model, names, "auto", "float32", PROBE)
    if report.reverted:
        assert all(a is None for a in report.alphas.values()) and all(not s.any() for s in report.shifts.values())
        assert "no layer smoothed" in report.summary("auto")
    else:
        assert report.cosine_after >= report.cosine_before
    for name, alpha in report.alphas.items():  # smoothed layers are clear per-layer gains
        errors = report.layer_errors[name]
        assert alpha is None or errors[alpha] < 0.9 * errors[None]


def test_default_is_auto_and_it_is_a_resume_setting() -> None:
    assert QuantizedPrecision("int8-dynamic-smooth").resume_config()["smoothing"] == "auto"
    assert QuantizedPrecision("nf4-dq", sensitive_mode="int8-dynamic-smooth", max_bytes_per_param=0.8).smoothing == "auto"
    assert "smoothing" not in QuantizedPrecision("int8-dynamic").resume_config()
    # was: a list of sensitive modes holding int8-dynamic-smooth turned smoothing off (zero exponents, 1 byte per
    # input channel for nothing) and refused smoothing=0.5
    listed = ["nf4-dq-b32", "int8-dynamic-smooth"]
    assert QuantizedPrecision("nf4-dq", sensitive_mode=listed, max_bytes_per_param=0.8).smoothing == "auto"
    assert QuantizedPrecision("nf4-dq", sensitive_mode=listed, max_bytes_per_param=0.8, smoothing=0.5).smoothing == 0.5


def quantized_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("weight_scale", "input_shift")) or ".weight" in k and v.dtype == torch.int8}


def test_lora_trains_on_a_smoothed_base_logged_and_resumed_exactly(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any, caplog: Any
) -> None:
    from lightning_hbm import QuantizationQuality

    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE)
    model = llama_factory()
    quality = QuantizationQuality(probe_batch=PROBE, weight_sqnr=False, on_validation=False)
    trainer = trainer_factory(max_steps=2, plugins=[plugin], callbacks=[LoRA(r=4, target_modules="all-linear"), quality])
    with caplog.at_level(logging.INFO, logger="lightning_hbm"):
        trainer.fit(model, datamodule_factory())
    assert "Linear layers smoothed" in caplog.text and "probe output cosine" in caplog.text
    # QuantizationQuality reports the figure the smoothing optimized, before and after
    assert quality.metrics["quant/smoothed_cosine_similarity"] == pytest.approx(plugin.smoothing_report.cosine_after)
    assert quality.metrics["quant/unsmoothed_cosine_similarity"] == pytest.approx(plugin.smoothing_report.cosine_before)
    smoothed = [m for m in model.modules() if isinstance(m, Int8DynamicLinear) and m.input_shift is not None]
    assert smoothed and any(m.input_shift.abs().sum() > 0 for m in smoothed)
    # LoRA sees the unsmoothed input: the adapters got gradients (lora_B starts at zero)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)
    path = tmp_path / "smooth.ckpt"
    trainer.save_checkpoint(path)
    saved = quantized_state(model)

    # another probe: re-measured factors would differ; the checkpoint's come back instead
    other_probe = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))
    again = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=other_probe)
    resumed_model = llama_factory()
    resumed = trainer_factory(max_steps=2, plugins=[again], callbacks=[LoRA(r=4, target_modules="all-linear")])
    resumed.fit(resumed_model, datamodule_factory(), ckpt_path=path)
    assert again.smoothing_report is None  # nothing measured
    restored = quantized_state(resumed_model)
    assert restored.keys() == saved.keys() and all(torch.equal(restored[k], saved[k]) for k in saved)

    with pytest.raises(ValueError, match=r"other lightning_hbm settings(.|\n)*smoothing: checkpoint 0.5, this run 'auto'"):
        trainer_factory(max_steps=3, plugins=[QuantizedPrecision("int8-dynamic-smooth", dtype="float32", probe_batch=PROBE)],
                        callbacks=[LoRA(r=4, target_modules="all-linear")]).fit(llama_factory(), datamodule_factory(), ckpt_path=path)


def test_plugin_alone_resumes_bit_exact(llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any) -> None:
    first = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE)])
    model = llama_factory()
    first.fit(model, datamodule_factory())
    path = tmp_path / "plain.ckpt"
    first.save_checkpoint(path)
    resumed_model = llama_factory(seed=1)  # another init: everything must come from the checkpoint
    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE)
    trainer_factory(max_steps=2, plugins=[plugin]).fit(resumed_model, datamodule_factory(), ckpt_path=path)
    assert plugin.smoothing_report is None
    saved, restored = quantized_state(model), quantized_state(resumed_model)
    assert saved and all(torch.equal(restored[k], saved[k]) for k in saved)
    with torch.no_grad():
        torch.testing.assert_close(resumed_model(PROBE), model(PROBE), rtol=0, atol=0)


def test_adapter_only_checkpoint_of_an_int8_dynamic_base_resumes(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    # the base's buffers beside the weight (weight_scale) are rebuilt from the fingerprinted base, not missing keys
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")], callbacks=[LoRA(r=4)])
    trainer.fit(llama_factory(), datamodule_factory())
    trainer.save_checkpoint(tmp_path / "a.ckpt")
    resumed = trainer_factory(max_steps=3, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")], callbacks=[LoRA(r=4)])
    resumed.fit(llama_factory(), datamodule_factory(), ckpt_path=tmp_path / "a.ckpt")
    assert resumed.global_step == 3


def test_the_sensitivity_plan_measures_the_smoothed_layers_and_its_bytes_are_exact() -> None:
    plugin = QuantizedPrecision(
        "int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE, min_cosine=0.99, sensitive_mode="none",
        quantize_embeddings=False,  # the Linears' plan and bytes alone
    )
    model = TinyBert().eval()
    plugin.check_model(model)
    # the plan's "every layer in the base mode" is the smoothed model: the same probe cosine as the smoothing's own
    assert plugin.sensitivity_report.uniform_cosine == pytest.approx(plugin.smoothing_report.cosine_after, abs=1e-7)
    assert plugin.smoothing_report.cosine_after != plugin.smoothing_report.cosine_before
    plugin.convert_base(model)
    smoothed = [m for m in model.modules() if isinstance(m, Int8DynamicLinear) and m.input_shift is not None]
    assert len(smoothed) == len(plugin.layer_modes) and all(m.input_shift.any() for m in smoothed)
    assert parameter_bytes(model) == predict_parameter_bytes(TinyBert(), plugin.layer_modes, "float32")


@pytest.mark.gpu
def test_cuda_smoothed_layer_matches_cpu() -> None:
    # not yet run on GPU (no GPU in the session that wrote it): the integer kernel path with smoothing
    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    shift = torch.randint(-4, 5, (256,)).to(torch.int8)
    cpu = Int8DynamicLinear.from_linear(linear, input_shift=shift)
    cuda = Int8DynamicLinear.from_linear(linear, device=torch.device("cuda"), input_shift=shift)
    x = torch.randn(64, 256)
    x_cuda = x.cuda().requires_grad_(True)
    out = cuda(x_cuda)
    torch.testing.assert_close(out.cpu(), cpu(x), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    x_cpu = x.clone().requires_grad_(True)
    cpu(x_cpu).sum().backward()
    torch.testing.assert_close(x_cuda.grad.cpu(), x_cpu.grad, rtol=1e-4, atol=1e-4)


def _smoothed_checkpoint(llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, path: Any, callbacks: list) -> dict:
    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE)
    trainer = trainer_factory(max_steps=1, plugins=[plugin], callbacks=callbacks)
    trainer.fit(llama_factory(), datamodule_factory())
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


RESEALS = {
    # an editor that rewrote the checksums and digests: only a check of the values themselves sees it
    "exponent 120": (lambda s: next(iter(s.values())).__setitem__(0, 120), r"lie outside \+-24 for layer '.*' \(largest 120\)"),
    "unknown layer": (lambda s: s.update({"model.no_such_layer": torch.zeros(4, dtype=torch.int8)}),
                      r"name 1 layer\(s\) this model does not smooth \(\['model.no_such_layer'\]\)"),
    "wrong width": (lambda s: s.update({k: v[:-1] for k, v in list(s.items())[:1]}), r"do not fit layer '.*': torch.int8 of shape"),
    "float exponents": (lambda s: s.update({k: v.float() for k, v in list(s.items())[:1]}), r"do not fit layer .*: torch.float32 of shape"),
}


@pytest.mark.parametrize("edit", list(RESEALS))
@pytest.mark.parametrize("with_lora", [True, False], ids=["lora", "plugin-alone"])
def test_resealed_exponents_out_of_range_or_of_unknown_layers_are_refused(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any, snapshot: Any, edit: str, with_lora: bool
) -> None:
    from lightning_hbm import resume

    lora = lambda: [LoRA(r=4, target_modules="all-linear")] if with_lora else []  # noqa: E731
    path = tmp_path / "smooth.ckpt"
    checkpoint = _smoothed_checkpoint(llama_factory, trainer_factory, datamodule_factory, path, lora())
    change, match = RESEALS[edit]
    change(checkpoint["lightning_hbm"]["input_shifts"])
    resume.seal(checkpoint)
    torch.save(checkpoint, path)
    model = llama_factory()
    before = snapshot(model)
    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, probe_batch=PROBE)
    trainer = trainer_factory(max_steps=2, plugins=[plugin], callbacks=lora())
    with pytest.raises(ValueError, match=rf"Checkpoint .*smooth.ckpt holds smoothing exponents \(int8-dynamic-smooth\) that {match}"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 0 and not any(isinstance(m, Int8DynamicLinear) for m in model.modules())
    if with_lora:  # refused by the checkpoint IO, before Lightning copies a tensor
        assert snapshot(model) == before
