"""peft's LoRA variants through ``LoRA``: DoRA, rsLoRA, init, bias, rank/alpha patterns (real peft, bitsandbytes, CPU)."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, applied_transforms, quantize_model
from lightning_hbm.data import synthetic_batch

NF4DQ = "nf4-dq"


def _plugins(quant: Optional[str]) -> list[Any]:
    return [QuantizedPrecision(quant, dtype="float32")] if quant else []


def _perturb_trainables(model: nn.Module, seed: int = 1) -> None:
    """As if trained: every trainable tensor (A, B, DoRA magnitude) moved off its init."""
    torch.manual_seed(seed)
    for param in model.parameters():
        if param.requires_grad:
            param.data.add_(torch.randn_like(param) * 0.02)


# --------------------------------------------------------------------------- each option reaches peft, and trains


def test_variants_reach_peft_and_train_on_an_nf4_dq_base(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    model = llama_factory(lr=1e-2)
    lora = LoRA(r=4, alpha=8.0, dropout=0.1, use_dora=True, use_rslora=True, init_lora_weights="gaussian",
                rank_pattern={"v_proj": 8}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 32.0})  # fmt: skip
    trainer = trainer_factory(max_steps=4, plugins=_plugins(NF4DQ), callbacks=[lora])
    trainer.fit(model, datamodule_factory())
    assert applied_transforms(model) == ["QuantizedPrecision(nf4-dq)", "LoRA"]
    layers = model.model.model.layers
    q0, q1, v0 = layers[0].self_attn.q_proj, layers[1].self_attn.q_proj, layers[0].self_attn.v_proj
    # peft's bitsandbytes 4-bit layer with DoRA on top: QDoRA
    assert type(q0).__module__ == "peft.tuners.lora.bnb" and type(q0).__name__ == "Linear4bit"
    assert q0.lora_magnitude_vector["default"].weight.shape == (64,)
    assert q0.use_dora["default"] and q0.use_rslora["default"] and q0.lora_dropout["default"].p == 0.1
    # rsLoRA: alpha / sqrt(r), per layer with the patterns
    assert q0.scaling["default"] == pytest.approx(8.0 / math.sqrt(4))
    assert q1.scaling["default"] == pytest.approx(32.0 / math.sqrt(4))
    assert v0.r["default"] == 8 and v0.lora_A["default"].weight.shape == (8, 64)
    assert v0.scaling["default"] == pytest.approx(8.0 / math.sqrt(8))
    # trained: the optimizer holds A, B and the magnitudes, and every one of them moved
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    magnitudes = [n for n in trainable if ".lora_magnitude_vector." in n]
    assert len(magnitudes) == 7 * 2 and all(p.dtype == torch.float32 for p in trainable.values())
    state = trainer.optimizers[0].state
    assert {id(p) for p in state} == {id(p) for p in trainable.values()}
    assert all(state[p]["step"] == 4 and state[p]["exp_avg"].abs().sum() > 0 for p in trainable.values())


def test_bias_lora_only_trains_the_adapted_layers_biases(gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable) -> None:
    model = gpt_factory(bias=True)
    trainer_factory(max_steps=2, plugins=_plugins(NF4DQ), callbacks=[LoRA(r=4, target_modules=["c_fc"], bias="lora_only")]).fit(
        model, datamodule_factory()
    )
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n)
    assert trainable == [f"model.h.{i}.mlp.c_fc.base_layer.bias" for i in range(len(model.model.h))]


# --------------------------------------------------------------------------- export: plain peft reloads it


@pytest.mark.parametrize(
    "variant",
    [dict(use_dora=True), dict(use_rslora=True, alpha=12.0), dict(rank_pattern={"v_proj": 8}, alpha_pattern={"q_proj": 4.0})],
    ids=["dora", "rslora", "rank_pattern"],
)
def test_save_adapter_reloads_in_plain_peft_with_equal_outputs_and_merges(
    llama_factory: Callable, tmp_path: Path, variant: dict[str, Any]
) -> None:
    from peft import PeftModel

    model = llama_factory()
    quantize_model(model, NF4DQ, dtype="float32")
    LoRA(r=4, target_modules=["q_proj", "v_proj", "up_proj"], **variant).transform_model(model)
    _perturb_trainables(model)
    model.eval()
    idx, _ = synthetic_batch(2, 16, seed=1)
    with torch.no_grad():
        want = model(idx)

    path = LoRA.save_adapter(model, tmp_path / "adapter")
    config = json.loads((path / "adapter_config.json").read_text())
    for key in ("use_dora", "use_rslora"):
        assert config[key] == variant.get(key, False)
    if "rank_pattern" in variant:  # one exact entry per differing layer, relative to the exported HF model
        assert config["rank_pattern"] == {rf"model\.layers\.{i}\.self_attn\.v_proj": 8 for i in range(2)}
        assert config["alpha_pattern"] == {rf"model\.layers\.{i}\.self_attn\.q_proj": 4.0 for i in range(2)}
    base = llama_factory().model
    quantize_model(base, NF4DQ, dtype="float32")
    peft_model = PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        got = peft_model(input_ids=idx, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    # merge folds DoRA's magnitude too: the plain model reproduces the adapted one (fp32 summation order apart)
    plain = llama_factory()
    plain.load_state_dict(LoRA.merge(model, dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(idx), want, rtol=1e-4, atol=1e-4)


def test_dora_on_quantized_convolutions_and_plain_layers_merges_exactly() -> None:
    """A quantized convolution reads its weight back dequantized: peft's DoRA Conv norm is right on it."""
    torch.manual_seed(0)
    model = nn.Module()
    model.conv, model.proj = nn.Conv2d(8, 16, 3, padding=1), nn.Linear(16, 16)
    quantize_model(model, NF4DQ, dtype="float32")
    assert type(model.conv).__name__ == "QuantizedConv2d"
    x = torch.randn(2, 8, 5, 5)
    run = lambda m: m.proj(m.conv(x).mean((2, 3)))  # noqa: E731
    with torch.no_grad():
        before = run(model)
    LoRA(r=4, use_dora=True).transform_model(model)
    assert model.conv.lora_magnitude_vector["default"].weight.numel() == 16  # one per output channel
    with torch.no_grad():
        torch.testing.assert_close(run(model), before, rtol=0, atol=1e-6)  # B = 0: DoRA starts at the base
    _perturb_trainables(model)
    run(model).sum().backward()
    assert model.conv.lora_magnitude_vector["default"].weight.grad.abs().sum() > 0
    merged = LoRA.merge(model, dtype="float32")
    plain = nn.Module()
    plain.conv, plain.proj = nn.Conv2d(8, 16, 3, padding=1), nn.Linear(16, 16)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(run(plain), run(model), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_pissa_and_olora_on_a_full_precision_base(llama_factory: Callable, init: str) -> None:
    model = llama_factory()
    original = {k: v.clone() for k, v in model.model.state_dict().items()}
    idx, _ = synthetic_batch(2, 16, seed=1)
    with torch.no_grad():
        before = model(idx)
    LoRA(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init).transform_model(model)
    q = model.model.model.layers[0].self_attn.q_proj
    assert q.lora_B["default"].weight.abs().sum() > 0  # A, B from the weight, not B = 0
    with torch.no_grad():  # the residual base plus the adapter is the original layer
        torch.testing.assert_close(model(idx), before, rtol=1e-4, atol=1e-4)
    _perturb_trainables(model)
    with torch.no_grad():
        want = model(idx)
    plain = llama_factory()
    plain.load_state_dict(LoRA.merge(model, dtype="float32"))  # onto the residual the model holds
    with torch.no_grad():
        torch.testing.assert_close(plain(idx), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=rf"init_lora_weights='{init}', which rewrote the base to W - B0 A0 .*without base_state_dict"):
        LoRA.merge(model, base_state_dict=original)


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(init_lora_weights="eva"), ValueError, r"init_lora_weights='eva'\): EVA initialises .* before Lightning has drawn any batch\. Not supported: use init_lora_weights=True"),
        (dict(init_lora_weights="loftq"), ValueError, r"init_lora_weights='loftq'\): peft's LoftQ quantizes the full-precision weight itself .*benchmarks/loftq\.py"),
        (dict(init_lora_weights="corda"), ValueError, r"init_lora_weights must be True, False, 'gaussian', 'pissa' or 'olora', got 'corda'"),
        (dict(bias="some"), ValueError, r"bias must be 'none', 'all' or 'lora_only' \(peft's values\), got 'some'"),
        (dict(use_dora="yes"), TypeError, r"LoRA\(use_dora='yes'\): a str, and any non-empty str is true .*pass True or False"),
        (dict(rank_pattern={"v_proj": 0}), ValueError, r"rank_pattern=\{'v_proj': 0\}\): the value of 'v_proj' must be a positive int \(a rank\), got 0"),
        (dict(rank_pattern={"v_proj": 2.5}), TypeError, r"LoRA\(rank_pattern=\{'v_proj': 2\.5\}\): wrong type"),
        (dict(alpha_pattern={"v_proj(": 8.0}), ValueError, r"alpha_pattern=\{'v_proj\(': 8\.0\}\): the key 'v_proj\(' is not a valid regex"),
        (dict(alpha_pattern={"v_proj": -1.0}), ValueError, r"the value of 'v_proj' must be a positive number \(an alpha\), got -1\.0"),
    ],
)
def test_bad_variant_arguments(kwargs: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LoRA(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "quant", "match"),
    [
        (dict(rank_pattern={"q_prj": 8}), None, r"rank_pattern=\{'q_prj': 8\}\): the key 'q_prj' matches none of the \d+ adapted layers, so it would change nothing"),
        (dict(alpha_pattern={"c_fc": 8.0}, target_modules=["c_attn"]), None, r"alpha_pattern=\{'c_fc': 8\.0\}\): the key 'c_fc' matches none"),
        (dict(rank_pattern={"c_fc": 512}), None, r"LoRA r=8 is larger than the width .*c_fc \(64, rank_pattern r=512\)"),
        (dict(use_dora=True), "int8-dynamic", r"use_dora=True on int8-dynamic: peft's DoRA reads the raw int8 weight without its per-row scales"),
        (dict(use_dora=True), "nf4-torchao", r"use_dora=True on nf4-torchao: peft's DoRA calls the torchao weight's dequantize\(\)"),
        (dict(use_dora=True), "int8", r"use_dora=True on int8 \(bitsandbytes Linear8bitLt\) on CPU: .*use nf4/nf4-dq \(QDoRA\)"),
        (dict(init_lora_weights="pissa"), NF4DQ, r"init_lora_weights='pissa' rewrites the base weight to W - B A .*quantized \(nf4-dq\).*Leave those layers out"),
        (dict(init_lora_weights="olora"), "int8-dynamic", r"init_lora_weights='olora' rewrites the base weight .*quantized \(int8-dynamic\)"),
    ],
)
def test_variants_a_layer_cannot_take_are_refused_before_any_change(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, kwargs: dict[str, Any], quant: Optional[str], match: str
) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, plugins=_plugins(quant), callbacks=[LoRA(**kwargs)])
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, datamodule_factory())
    assert applied_transforms(model) == [] and type(model.model.h[0].mlp.c_fc) is nn.Linear  # quantization included


def test_pissa_on_a_convolution_is_refused() -> None:
    model = nn.Module()
    model.conv, model.proj = nn.Conv1d(8, 16, 3), nn.Linear(16, 16)
    with pytest.raises(ValueError, match=r"conv: init_lora_weights='pissa' is not implemented by peft for convolutions"):
        LoRA(r=4, init_lora_weights="pissa").transform_model(model)
    assert type(model.conv) is nn.Conv1d


# --------------------------------------------------------------------------- resume, CLI, planner


def test_resume_with_other_variant_settings_is_refused(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, tmp_path: Path
) -> None:
    kwargs = dict(r=4, target_modules=["q_proj", "v_proj"], use_dora=True, rank_pattern={"v_proj": 8})
    first = llama_factory()
    trainer = trainer_factory(max_steps=-1, max_epochs=1, limit_train_batches=1, plugins=_plugins(NF4DQ), callbacks=[LoRA(**kwargs)])
    trainer.fit(first, datamodule_factory())
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    for change, diff in [(dict(use_dora=False), r"use_dora"), (dict(rank_pattern={"v_proj": 4}), r"rank_pattern"), (dict(use_rslora=True), r"use_rslora")]:
        resumed = trainer_factory(max_steps=-1, max_epochs=2, limit_train_batches=1, plugins=_plugins(NF4DQ), callbacks=[LoRA(**{**kwargs, **change})])
        with pytest.raises(ValueError, match=rf"saved with other lightning_hbm settings than this run has:\n(.|\n)*{diff}"):
            resumed.fit(llama_factory(), datamodule_factory(), ckpt_path=tmp_path / "run.ckpt")
    resumed_model = llama_factory()  # seeds the global RNG too (the data order): right before each fit
    same = trainer_factory(max_steps=-1, max_epochs=2, limit_train_batches=1, plugins=_plugins(NF4DQ), callbacks=[LoRA(**kwargs)])
    same.fit(resumed_model, datamodule_factory(), ckpt_path=tmp_path / "run.ckpt")
    assert same.global_step == 2
    # the same settings resume exactly, DoRA magnitudes included
    straight = llama_factory()
    trainer_factory(max_steps=-1, max_epochs=2, limit_train_batches=1, plugins=_plugins(NF4DQ), callbacks=[LoRA(**kwargs)]).fit(
        straight, datamodule_factory()
    )
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed_model)
    assert set(want) == set(got) and any(".lora_magnitude_vector." in k for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_cli_parses_the_variant_arguments() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(LoRA, "lora")
    cfg = parser.parse_args(["--lora.use_dora=true", "--lora.use_rslora=true", "--lora.init_lora_weights=gaussian",
                             "--lora.bias=lora_only", "--lora.rank_pattern={v_proj: 16}", "--lora.alpha_pattern={q_proj: 32}"])  # fmt: skip
    lora = parser.instantiate_classes(cfg).lora
    assert (lora.use_dora, lora.use_rslora, lora.init_lora_weights, lora.bias) == (True, True, "gaussian", "lora_only")
    assert lora.rank_pattern == {"v_proj": 16} and lora.alpha_pattern == {"q_proj": 32.0}
    assert parser.instantiate_classes(parser.parse_args(["--lora.init_lora_weights=false"])).lora.init_lora_weights is False
    for bad in ["--lora.bias=some", "--lora.init_lora_weights=corda"]:
        with pytest.raises(SystemExit):
            parser.parse_args([bad])


def test_planner_counts_dora_magnitudes_as_they_are_built(tmp_path: Path) -> None:
    from lightning_hbm.memory.storage import parameter_bytes
    from lightning_hbm.models import LlamaLM
    from lightning_hbm.planner import Candidate, predict
    from lightning_hbm.surgery import run_surgery

    factory = partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    batch = synthetic_batch(4, 32)
    lora, dora = (Candidate.from_trainer(None, [LoRA(r=8, use_dora=d)]) for d in (False, True))
    planned_lora, planned_dora = predict(factory, batch, lora), predict(factory, batch, dora)
    module = factory()
    run_surgery(module, dora.precision_plugin(), dora.callbacks())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    magnitudes = sum(p.numel() for n, p in module.named_parameters() if ".lora_magnitude_vector." in n)
    assert magnitudes == 2 * (64 + 32 + 32 + 64 + 172 + 172 + 64)  # one per output channel of the 7 Linears per layer
    assert planned_dora.trainable_params == trainable == planned_lora.trainable_params + magnitudes
    assert planned_dora.categories["parameters"] == parameter_bytes(module)
    # two fp32 AdamW states per magnitude element, and one step counter per magnitude vector
    states = planned_dora.categories["optimizer_states"] - planned_lora.categories["optimizer_states"]
    assert states == 8 * magnitudes + 4 * 14
    # the step as it runs (HBMProfiler's tracked live storage): DoRA's forward also holds W + BA and its norm
    measured = _profiled_peak(factory, dora, tuple(t.contiguous() for t in batch), tmp_path)
    assert planned_dora.peak > planned_lora.peak
    assert planned_dora.categories["parameters"] == measured["parameters"]
    assert planned_dora.categories["optimizer_states"] == measured["optimizer_states"]
    assert planned_dora.peak == pytest.approx(measured["tracked_peak"], rel=0.01)


def _profiled_peak(factory: Callable, candidate: Any, batch: tuple, tmp_path: Path) -> dict:
    """tests/planner/test_api.py's measurement: 2 steps, the profiler's detailed row of step 1."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hbm.profiling.profiler import HBMProfiler

    torch.manual_seed(0)
    profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[*candidate.callbacks(), profiler], precision=candidate.precision)  # fmt: skip
    samples = [tuple(t[i] for t in batch) for i in range(batch[0].shape[0])] * 2
    trainer.fit(factory(), DataLoader(samples, batch_size=batch[0].shape[0]))
    return profiler.rows[-1]


def test_planner_refuses_dora_on_a_bitsandbytes_base_with_the_reason() -> None:
    from lightning_hbm.models import LlamaLM
    from lightning_hbm.planner import plan

    factory = partial(LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"use_dora=True on nf4 in the planner's trace: .*Plan with use_dora=False and add one"):
        plan(factory, synthetic_batch(2, 16), plugin=QuantizedPrecision(NF4DQ, dtype="float32"), callbacks=[LoRA(r=4, use_dora=True)])
