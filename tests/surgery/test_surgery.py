"""The surgery spine: one place, fixed order, lazy models, before the optimizer, any precision."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from lightning_hbm import QuantizedPrecision, Stage, SurgeryCallback, applied_transforms, resume


class Recorder(SurgeryCallback):
    """Records when it ran and what the model looked like then."""

    def __init__(self, stage: Stage, log: list[tuple[str, Any]]) -> None:
        self.stage = stage
        self.events = log

    def transform_model(self, module: pl.LightningModule) -> None:
        quantized = any(isinstance(m, bnb.nn.Linear4bit) for m in module.modules())
        self.events.append((self.stage.name, quantized))


def _recorders(log: list[tuple[str, Any]]) -> list[SurgeryCallback]:
    # deliberately out of order: the spine sorts by stage
    stages = [Stage.KERNELS, Stage.OBSERVE, Stage.CHECKPOINTING, Stage.ADAPTERS]
    return [type(f"Recorder{s.name.title()}", (Recorder,), {})(s, log) for s in stages]


def test_fixed_order_around_quantization(lazy_gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    log: list[tuple[str, Any]] = []
    model = lazy_gpt_factory()  # built in configure_model: the spine must still see it
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=_recorders(log))
    trainer.fit(model, datamodule_factory())
    assert log == [("OBSERVE", False), ("ADAPTERS", True), ("CHECKPOINTING", True), ("KERNELS", True)]
    assert applied_transforms(model) == [
        "RecorderObserve",
        "QuantizedPrecision(nf4)",
        "RecorderAdapters",
        "RecorderCheckpointing",
        "RecorderKernels",
    ]


def test_applied_once_across_fit_and_validate(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    log: list[tuple[str, Any]] = []
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, limit_val_batches=1, callbacks=_recorders(log))
    trainer.fit(model, datamodule_factory())
    trainer.validate(model, datamodule_factory())
    assert len(log) == 4


def test_a_model_quantized_elsewhere_is_kept_off_the_cpu_repack(gpt_factory: Any, trainer_factory: Any,
                                                                  datamodule_factory: Any, caplog: Any) -> None:
    """4-bit layers made before lightning_hbm (transformers' BitsAndBytesConfig, the user's code) get the repack
    switch turned off too: on an AVX512-BF16 CPU the sanity check (eval, no grad) would repack them, and the
    adapters upstream of a 4-bit layer would then train on no gradient."""
    from lightning_hbm import LoRA, quantize_model

    model = gpt_factory(bias=False)
    quantize_model(model, "nf4", dtype="float32", quantize_head=True)  # before the Trainer sees the model
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = True  # as bitsandbytes builds them on such a CPU
    lora = LoRA(r=4, target_modules=["c_attn"])
    trainer = trainer_factory(max_steps=1, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[lora])
    trainer.fit(model, datamodule_factory())
    assert layers and all(layer.support_avx512bf16_for_cpu is False for layer in layers)
    # the first block's adapter sits upstream of every 4-bit layer: it trained
    assert model.model.h[0].attn.c_attn.lora_B["default"].weight.abs().sum() > 0


class FreezeAllButFinalNorm(SurgeryCallback):
    stage = Stage.ADAPTERS

    def transform_model(self, module: pl.LightningModule) -> None:
        for name, param in module.named_parameters():
            param.requires_grad = name.startswith("model.ln_f")
        module.model.extra = nn.Parameter(torch.zeros(3, dtype=module.model.ln_f.weight.dtype))


class SwapToSGD(SurgeryCallback):
    stage = Stage.OPTIMIZER

    def __init__(self) -> None:
        self.seen: list[Optimizer] = []

    def transform_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any]) -> list[Optimizer]:
        self.seen = list(optimizers)
        return [torch.optim.SGD(group["params"], lr=0.1) for opt in optimizers for group in opt.param_groups]


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_changes_happen_before_the_optimizer_with_lightning_precision(
    lazy_gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, precision: str
) -> None:
    """No lightning_hbm plugin: Lightning's own precision, a lazily built model, unchanged configure_optimizers."""
    model = lazy_gpt_factory()
    swap = SwapToSGD()
    trainer = trainer_factory(max_steps=1, precision=precision, callbacks=[FreezeAllButFinalNorm(), swap])
    trainer.fit(model, datamodule_factory())
    # the user's AdamW(self.parameters()) was built after the change: it holds the new parameter,
    # and the spine pruned the frozen ones
    (adamw,) = swap.seen
    assert isinstance(adamw, torch.optim.AdamW)
    params = {id(p) for g in adamw.param_groups for p in g["params"]}
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    assert params == expected and id(model.model.extra) in params and len(params) == 3
    assert isinstance(trainer.optimizers[0], torch.optim.SGD)
    if precision == "bf16-true":
        assert model.model.extra.dtype == torch.bfloat16  # ran after Lightning's own convert_module


def test_resume_with_foreign_keys_is_a_clear_error(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", dtype="float32")])
    trainer.fit(model, datamodule_factory())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["lightning_hbm"]["state_dict"]["model.h.0.attn.c_attn.lora_A.default.weight"] = torch.zeros(2, 2)
    resume.seal(checkpoint)  # a consistent file (checksums, digest) with a foreign tensor
    torch.save(checkpoint, path)
    other = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4", dtype="float32")])
    with pytest.raises(ValueError, match=r"fit neither the model as built nor the model after lightning_hbm's changes.*lora_A"):
        other.fit(gpt_factory(seed=1), datamodule_factory(), ckpt_path=path)
    assert other.global_step == 0


def test_resume_into_another_precision_mode_is_a_clear_error(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")])
    trainer.fit(model, datamodule_factory())
    path = tmp_path / "b.ckpt"
    trainer.save_checkpoint(path)
    other = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("int8", dtype="float32")])
    with pytest.raises(ValueError, match=r"(?s)other lightning_hbm settings.*QuantizedPrecision.mode: checkpoint .nf4-dq., this run .int8."):
        other.fit(gpt_factory(seed=1), datamodule_factory(), ckpt_path=path)


def test_a_plugin_reused_by_a_second_trainer_follows_that_trainer(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any
) -> None:
    plugin = QuantizedPrecision("nf4", dtype="float32")
    first = gpt_factory()
    trainer_factory(max_steps=1, plugins=[plugin]).fit(first, datamodule_factory())
    log: list[tuple[str, Any]] = []
    second = gpt_factory(seed=1)
    trainer_factory(max_steps=1, plugins=[plugin], callbacks=_recorders(log)).fit(second, datamodule_factory())
    assert [stage for stage, _ in log] == ["OBSERVE", "ADAPTERS", "CHECKPOINTING", "KERNELS"]
    assert applied_transforms(second)[1] == "QuantizedPrecision(nf4)"
