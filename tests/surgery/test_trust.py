"""A surgery you can trust: strict loading, checks before the first change, verified checkpoints.

Each test is a mistake a user makes (or a fault a disk makes); each asserts the error and its
message, and that the model, the checkpoint file and the optimizer were left as they were.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import (
    ActivationCheckpointing,
    LoRA,
    MemoryEfficientOptimizer,
    QuantizationQuality,
    QuantizedPrecision,
    applied_transforms,
    resume,
)
from lightning_hbm.surgery import pending_checkpoint

F32 = dict(dtype="float32")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _untouched(model: pl.LightningModule) -> None:
    """Nothing was quantized, adapted or wrapped."""
    assert applied_transforms(model) == []
    assert all(type(m) is nn.Linear for n, m in model.named_modules() if n.endswith(("c_attn", "c_fc", "c_proj")))
    assert not any("lora" in n for n, _ in model.named_parameters())


class _Flat(pl.LightningModule):
    """No repeated blocks; a BatchNorm with running statistics (buffers)."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


# ------------------------------------------------------------------------ 1. strict loading


def test_a_plain_trainer_loads_strictly_as_lightning_does(trainer_factory: Callable, tmp_path: Path) -> None:
    trainer = trainer_factory(max_steps=1)
    trainer.fit(_Flat())
    path = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert "lightning_hbm" not in checkpoint  # a Trainer without lightning_hbm writes Lightning's format
    del checkpoint["state_dict"]["net.1.running_mean"]
    torch.save(checkpoint, path)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"net.1.running_mean\""):
        trainer_factory(max_steps=2).fit(_Flat(), ckpt_path=path)


def test_a_lightning_hbm_checkpoint_is_strict_about_every_key_it_did_not_leave_out_on_purpose(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=[LoRA(r=2)])
    trainer.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "lora.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    meta = checkpoint["lightning_hbm"]
    # adapter-only: the frozen base is left out on purpose (and fingerprinted); the LayerNorms and the
    # embedding are frozen too, so they are omitted as well
    assert "model.h.0.attn.c_attn.weight" in meta["omitted"] and "model.h.0.attn.c_attn.weight" in meta["fingerprints"]
    del meta["state_dict"]["model.h.0.attn.c_attn.lora_A.default.weight"]
    resume.seal(checkpoint)  # a consistent file (checksums, digest) that lacks the tensor
    torch.save(checkpoint, path)
    model = gpt_factory()
    other = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=r"does not hold these tensors.*c_attn.lora_A.default.weight"):
        other.fit(model, datamodule_factory(), ckpt_path=path)
    assert other.global_step == 0


# ------------------------------------------------------------- 2. every check before the first change


@pytest.mark.parametrize(
    ("callbacks", "match"),
    [
        ([LoRA(r=2), ActivationCheckpointing(blocks=["NoSuchBlock"])], r"\['NoSuchBlock'\] name no submodule path"),
        ([LoRA(r=2), LoRA(r=4)], r"2 LoRA callbacks.*keep one instance"),
        ([LoRA(r=2048)], r"r=2048 is larger than the width of .* target layer"),
        ([LoRA(r=2), MemoryEfficientOptimizer()], None),  # accepted: the control case
    ],
    ids=["NoSuchBlock", "two-LoRA", "r-wider-than-layer", "control"],
)
def test_checks_run_before_the_first_change(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, callbacks: list, match: Any
) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=callbacks)
    if match is None:
        trainer.fit(model, datamodule_factory())
        assert applied_transforms(model)[:2] == ["QuantizedPrecision(nf4)", "LoRA"]
        return
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, datamodule_factory())
    _untouched(model)
    assert trainer.optimizers == []


def test_a_model_without_repeated_blocks_is_refused_before_quantization(trainer_factory: Callable) -> None:
    model = _Flat()
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=[ActivationCheckpointing()])
    with pytest.raises(ValueError, match=r"found no repeated blocks in _Flat.*Pass blocks=\[...\]"):
        trainer.fit(model)
    assert applied_transforms(model) == [] and type(model.net[0]) is nn.Linear


def test_sgd_with_the_8bit_optimizer_is_refused_before_quantization(trainer_factory: Callable) -> None:
    model = _Flat(optimizer="sgd")
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=[MemoryEfficientOptimizer()])
    with pytest.raises(TypeError, match=r"can only replace torch.optim.Adam or torch.optim.AdamW.*torch.optim.sgd.SGD"):
        trainer.fit(model)
    assert applied_transforms(model) == [] and type(model.net[0]) is nn.Linear
    assert trainer.optimizers == []


def test_lora_on_a_model_that_already_carries_peft_adapters(gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable) -> None:
    import peft

    model = gpt_factory()
    peft.inject_adapter_in_model(peft.LoraConfig(r=2, target_modules=["c_attn"]), model)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=r"already carries peft adapters .*c_attn.*drop get_peft_model"):
        trainer.fit(model, datamodule_factory())
    assert applied_transforms(model) == []
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [math.nan, math.inf])
def test_lora_alpha_must_be_finite(alpha: float) -> None:
    with pytest.raises(ValueError, match=r"alpha must be a positive number, got alpha=(nan|inf)"):
        LoRA(alpha=alpha)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"min_cosine_similarity": math.nan}, ValueError, r"must be a finite number"),
        ({"max_relative_error": math.nan}, ValueError, r"must be a finite number"),
        ({"max_kl_divergence": "0.1"}, TypeError, r"max_kl_divergence='0.1'\): wrong type str; pass a number or None"),
    ],
)
def test_quality_thresholds_are_numbers(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        QuantizationQuality(**kwargs)


# ------------------------------------------------------ 3. resume must not train the wrong thing


def _adapter_run(gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, path: Path, mode: str = "nf4-dq", **lora: Any) -> None:
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision(mode, **F32)], callbacks=[LoRA(r=2, **lora)])
    trainer.fit(gpt_factory(), datamodule_factory())
    trainer.save_checkpoint(path)


def _scaled(model: pl.LightningModule) -> pl.LightningModule:
    with torch.no_grad():
        model.model.h[1].mlp.c_fc.weight.mul_(0.5)
    return model


@pytest.mark.parametrize(
    ("make", "plugins", "lora", "match"),
    [
        (lambda f: f(seed=1), "nf4-dq", {}, r"adapters trained on another frozen base.*allow_base_change=True"),
        (lambda f: _scaled(f()), "nf4-dq", {}, r"adapters trained on another frozen base.*h.1.mlp.c_fc.weight"),
        (lambda f: f(), "nf4-dq", {"alpha": 32.0}, r"LoRA.alpha: checkpoint 16.0, this run 32.0"),
        (lambda f: f(), "int8", {}, r"QuantizedPrecision.mode: checkpoint 'nf4-dq', this run 'int8'"),
        (lambda f: f(), None, {}, r"QuantizedPrecision was used by the run that saved it but is not in this run"),
        (lambda f: f(), "fp4", {}, r"QuantizedPrecision.mode: checkpoint 'nf4-dq', this run 'fp4'"),
        (lambda f: f(), "nf4", {}, r"QuantizedPrecision.mode: checkpoint 'nf4-dq', this run 'nf4'"),
    ],
    ids=["other-seed", "layer-scaled", "changed-alpha", "int8-base", "fp32-base", "fp4", "nf4"],
)
def test_resume_onto_something_else_is_an_error_before_any_change(
    gpt_factory: Callable,
    trainer_factory: Callable,
    datamodule_factory: Callable,
    tmp_path: Path,
    make: Callable,
    plugins: Any,
    lora: dict,
    match: str,
    snapshot: Callable,
) -> None:
    path = tmp_path / "adapter.ckpt"
    _adapter_run(gpt_factory, trainer_factory, datamodule_factory, path)
    digest = _digest(path)
    model = make(gpt_factory)
    model.model.h[0].eval()  # a submodule the user froze in eval mode stays so
    before = snapshot(model)
    plugin = [QuantizedPrecision(plugins, **F32)] if plugins else []
    trainer = trainer_factory(max_steps=2, plugins=plugin, callbacks=[LoRA(r=2, **lora)])
    with pytest.raises(ValueError, match=rf"(?s){match}"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    _untouched(model)
    assert snapshot(model) == before
    assert trainer.global_step == 0 and trainer.optimizers == []
    assert _digest(path) == digest


def test_a_deliberate_base_change_is_allowed_explicitly(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    path = tmp_path / "adapter.ckpt"
    _adapter_run(gpt_factory, trainer_factory, datamodule_factory, path)
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2, allow_base_change=True)])
    trainer.fit(gpt_factory(seed=1), datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 2


@pytest.mark.parametrize("plugins", [[], ["nf4-dq"]], ids=["lora", "qlora"])
def test_a_full_checkpoint_resumed_into_a_lora_run_says_so(
    trainer_factory: Callable, gpt_factory: Callable, datamodule_factory: Callable, tmp_path: Path, snapshot: Callable, plugins: list
) -> None:
    trainer = trainer_factory(max_steps=1)
    trainer.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "full.ckpt"
    trainer.save_checkpoint(path)
    model = gpt_factory()
    before = snapshot(model)
    other = trainer_factory(max_steps=2, plugins=[QuantizedPrecision(p, **F32) for p in plugins], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=r"saved without lightning_hbm's changes, but this run applies \[.*'LoRA'.*\].*without ckpt_path"):
        other.fit(model, datamodule_factory(), ckpt_path=path)
    assert snapshot(model) == before  # its trained weights were not copied in before the refusal


# ------------------------------------------------------------------ 4. damaged checkpoint files


def test_flipped_bytes_inside_an_adapter_tensor_are_found(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, snapshot: Callable
) -> None:
    path = tmp_path / "adapter.ckpt"
    _adapter_run(gpt_factory, trainer_factory, datamodule_factory, path)
    checkpoint = torch.load(path, weights_only=False)
    target = checkpoint["lightning_hbm"]["state_dict"]["model.h.0.mlp.c_fc.lora_B.default.weight"]
    raw = bytearray(path.read_bytes())
    needle = target.contiguous().view(torch.uint8).numpy().tobytes()[:64]
    start = raw.find(needle)
    assert start > 0 and needle.count(0) < 64  # lora_B is trained after one step: not all zeros
    raw[start : start + 64] = bytes(b ^ 0xFF for b in raw[start : start + 64])
    path.write_bytes(bytes(raw))
    digest = _digest(path)
    model = gpt_factory()
    before = snapshot(model)
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=r"adapter.ckpt is damaged: tensor 'model.h.0.mlp.c_fc.lora_B.default.weight'"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    _untouched(model)
    assert snapshot(model) == before
    assert _digest(path) == digest and trainer.global_step == 0


def test_quantized_precision_alone_refuses_a_damaged_file_before_the_model_holds_it(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    """Was: a precision plugin gets no hook before Lightning loads the weights, so the model already held the file's
    tensors when the refusal came. lightning_hbm's callbacks_factory entry point now gives such a Trainer the checks
    (``PluginAttach``), which run before Lightning's restore."""
    first = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", **F32)])
    first.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    # a flipped value under an unchanged CRC (the head: a real tensor; the int8 embedding's "model.wte.weight" is
    # a placeholder beside its packed table)
    checkpoint["state_dict"]["model.lm_head.weight"].view(-1)[0] += 1
    torch.save(checkpoint, path)
    model = gpt_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)])
    assert [type(cb).__name__ for cb in trainer.callbacks].count("PluginAttach") == 1
    with pytest.raises(ValueError, match=r"(?s)is damaged: tensor 'model.lm_head.weight'.*nothing was loaded"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model never held the file


@pytest.mark.parametrize("callbacks", [True, False], ids=["lora", "quantized-alone"])
def test_a_flipped_loop_counter_is_refused_before_training(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, callbacks: bool
) -> None:
    """Was: only tensors carried checksums, so a flipped batch counter resumed 2 steps off without a word."""
    lora = lambda: [LoRA(r=2)] if callbacks else []  # noqa: E731
    first = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=lora())
    first.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] = 0  # 2 -> 0: 4 more steps
    torch.save(checkpoint, path)
    model = gpt_factory()
    trainer = trainer_factory(max_steps=4, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=lora())
    with pytest.raises(ValueError, match=r"(?s)q.ckpt is damaged: the values of its entry 'loops'.*do not match.*nothing was loaded"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 0
    _untouched(model)


@pytest.mark.parametrize(("cut", "match"), [(0, r"is empty \(0 bytes\)"), (0.6, r"is not a complete torch checkpoint.*cut short")])
def test_empty_and_truncated_files_are_named(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, cut: float, match: str
) -> None:
    path = tmp_path / "adapter.ckpt"
    _adapter_run(gpt_factory, trainer_factory, datamodule_factory, path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    model = gpt_factory()
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2)])
    with pytest.raises(ValueError, match=rf"Checkpoint .*adapter.ckpt {match}"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    _untouched(model)


# ----------------------------------------------------------------------- resume that must work


def test_quantized_precision_alone_resumes_exactly(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, loss_recorder: Callable, tmp_path: Path
) -> None:
    """No lightning_hbm callback: the plugin alone writes and reads its checkpoints."""
    # whole epochs of 2 batches: the resumed run replays the same batches (no mid-epoch resume)
    epochs = dict(max_steps=-1, limit_train_batches=2)
    straight_losses = loss_recorder()
    trainer_factory(max_epochs=2, **epochs, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[straight_losses]).fit(
        gpt_factory(), datamodule_factory()
    )
    first = trainer_factory(max_epochs=1, **epochs, plugins=[QuantizedPrecision("nf4-dq", **F32)])
    first.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    # the as-built weight of a quantized Linear is a 4-byte NaN placeholder; its packed form travels aside
    placeholder = saved["state_dict"]["model.h.0.attn.c_attn.weight"]
    assert placeholder.stride() == (0, 0) and placeholder.isnan().all()
    assert "model.h.0.attn.c_attn.weight.absmax" in saved["lightning_hbm"]["state_dict"]
    resumed_losses = loss_recorder()
    trainer = trainer_factory(max_epochs=2, **epochs, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[resumed_losses])
    trainer.fit(gpt_factory(seed=3), datamodule_factory(), ckpt_path=path)
    assert trainer.global_step == 4
    assert resumed_losses.losses == straight_losses.losses[2:]  # bit-identical continuation


def test_test_after_fit_reads_the_checkpoint_into_the_changed_model(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=1, limit_val_batches=1, plugins=[QuantizedPrecision("nf4", **F32)])
    trainer.fit(model, datamodule_factory())
    path = tmp_path / "q.ckpt"
    trainer.save_checkpoint(path)
    before = model.model.h[0].attn.c_attn.weight.clone()
    trainer.validate(model, datamodule_factory(), ckpt_path=path)
    torch.testing.assert_close(model.model.h[0].attn.c_attn.weight, before, rtol=0, atol=0)


def test_lightning_still_keeps_the_loaded_checkpoint_where_the_spine_reads_it(trainer_factory: Callable) -> None:
    """The one private Lightning attribute lightning_hbm reads: fail here, loudly, if Lightning renames it."""
    trainer = trainer_factory()
    assert hasattr(trainer._checkpoint_connector, "_loaded_checkpoint")
    trainer._checkpoint_connector._loaded_checkpoint = {"lightning_hbm": {}}
    assert pending_checkpoint(trainer) == {"lightning_hbm": {}}


def test_a_quantized_checkpoint_loaded_without_lightning_hbm_computes_nan_not_wrong_weights(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", **F32)])
    trainer.fit(gpt_factory(), datamodule_factory())
    path = tmp_path / "q.ckpt"
    trainer.save_checkpoint(path)
    plain = gpt_factory()
    plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"])  # strict, and weights_only works
    assert plain.model.h[0].attn.c_attn.weight.isnan().all()
    assert plain(torch.randint(0, 256, (1, 8))).isnan().all()


def test_a_base_change_onto_other_layer_sizes_is_refused_before_any_change(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, snapshot: Callable
) -> None:
    path = tmp_path / "adapter.ckpt"
    _adapter_run(gpt_factory, trainer_factory, datamodule_factory, path)
    model = gpt_factory(n_embd=32)  # narrower: every adapted layer has other sizes
    before = snapshot(model)
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2, allow_base_change=True)])
    with pytest.raises(ValueError, match=r"(?s)adapters that do not fit this model's layers: \['model.h.0.attn.c_attn: adapters for \d+ -> \d+, layer"):
        trainer.fit(model, datamodule_factory(), ckpt_path=path)
    assert snapshot(model) == before and trainer.global_step == 0
