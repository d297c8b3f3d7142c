"""Who reads a layer's weight is decided by running the model (``lightning_hbm.layers.readers``), not by its source.

Issue 33: Bloom reads ``self.dense.weight`` only under ``pretraining_tp > 1 and slow_but_exact``, transformers' Mamba
reads ``x_proj``/``out_proj`` weights only in its CUDA kernel branch: a source scan left 29 % / 25 % of those models in
full precision. The probe step sees what the path that trains does; a read on a path it did not take is guarded.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from kind_models import build, build_any, fit_epochs_module
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import base_layer, find_layers, readers, source_readers, stored_in, weight_readers
from lightning_hbm.layers.read_weight import ReadableLinear
from lightning_hbm.surgery import run_surgery

VOCAB, SEQ, BATCH = 128, 16, 2


class Wrapped(pl.LightningModule):
    def __init__(self, model: nn.Module, causal: bool = True) -> None:
        super().__init__()
        self.model, self.causal = model, causal

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.causal:
            loss = self.model(input_ids=batch, labels=batch).loss
        else:
            logits = self.model(batch)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        self.log("loss", loss)  # the probe step runs before the fit loop exists: self.log must not fail it
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def fit(module: pl.LightningModule, tmp_path: Any, steps: int = 2, **lora: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8, **lora)],
    )
    trainer.fit(module, DataLoader([tokens(1), tokens(2)], batch_size=None))
    return trainer


def bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4))


def mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    return MambaForCausalLM(MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, eos_token_id=0, pad_token_id=0))


def quantized(module: nn.Module, name: str) -> bool:
    layer = base_layer(module.get_submodule(name))
    return stored_in(layer) is not None or not layer.weight.is_floating_point()


def served(module: nn.Module, name: str) -> bool:
    """Stored quantized, its weight (read directly) computed from the storage (``read_weight.ReadableLinear``)."""
    return isinstance(base_layer(module.get_submodule(name)), ReadableLinear)


class Reads(nn.Module):
    """Reads ``c`` on the path that trains, ``d`` only on a path that does not run (``exact``), ``e``'s dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.a, self.c, self.d, self.e = (nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, VOCAB)
        self.exact = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).to(self.e.weight.dtype)
        x = self.a(x) + x @ self.c.weight.T
        x = F.linear(x, self.d.weight, self.d.bias) if self.exact else self.d(x)
        return self.head(self.e(x))


def test_the_probe_step_decides_and_the_source_is_only_a_hint() -> None:
    module = Wrapped(Reads(), causal=False)
    hint = {layer: reader for _, reader, layer in source_readers(module)}
    assert hint == {"model.c": "Reads.forward", "model.d": "Reads.forward", "model.e": "Reads.forward"}
    layers = {name: base_layer(layer) for name, layer, _ in find_layers(module)}
    seen = readers.observe(module, tokens(), layers)
    assert seen is not None and seen.ran == "Wrapped.training_step on fake tensors"
    assert set(seen.reads) == {"model.c", "model.e"}  # d: not on this path
    # c: a matmul, never a write: stored quantized, it computes from its storage; e: its dtype only (kept, as before)
    assert seen.served == {"model.c"} and weight_readers(module) == {"model.e": "Reads.forward"}
    # but LoRA alone leaves c as built, whose weight the reader takes without an adapter; e: its dtype only
    assert weight_readers(module, uses_only=True) == {"model.c": "Reads.forward"}


def test_the_probe_changes_nothing() -> None:
    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm, self.head = nn.Embedding(VOCAB, 8), nn.BatchNorm1d(SEQ), nn.Linear(8, VOCAB)
            self.drop = nn.Dropout(0.5)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            if float(tokens.float().mean()) < 0:  # needs a value: the fake run fails, one real sample runs
                raise AssertionError
            return self.head(self.drop(self.norm(self.embed(tokens))))

    module = Wrapped(Normed(), causal=False).train()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    rng = torch.get_rng_state()
    seen = readers.observe(module, tokens(), {"model.head": module.model.head})
    assert seen is not None and seen.ran == "Wrapped.training_step on one real sample"
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # BatchNorm statistics included
    assert torch.equal(rng, torch.get_rng_state())


def test_a_step_that_cannot_run_falls_back_to_the_source_with_a_warning() -> None:
    class Broken(Reads):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            raise KeyError("no such input")

    module = Wrapped(Broken(), causal=False)
    with pytest.warns(UserWarning, match=r"could not run one step of Wrapped .*KeyError.*read from its source code"):
        assert readers.observe(module, tokens(), {"model.c": module.model.c}) is None
    assert set(weight_readers(module)) == {"model.c", "model.d", "model.e"}


def test_a_read_on_the_path_that_did_not_run_is_a_clear_error_never_wrong_numbers(tmp_path: Any) -> None:
    module = Wrapped(Reads(), causal=False)
    fit(module, tmp_path, target_modules=["a", "d", "e"])
    assert quantized(module, "model.d") and served(module, "model.c") and not quantized(module, "model.e")
    module.model.exact = True  # the path the probe did not take
    with pytest.raises(readers.UnobservedRead, match=r"Reads.forward read the weight of 'model.d' directly \(linear\) .*"
                       r"QuantizedPrecision\(ignore_modules=\['model.d'\]\)"):
        module.model(tokens())
    module.model.exact = False
    module.model(tokens())  # the guard left no mode behind: the path that trains still runs
    copied = copy.deepcopy(module.model)  # a copy's guards follow the copy's weights
    copied.exact = True
    with pytest.raises(readers.UnobservedRead, match=r"'model.d' directly"):
        copied(tokens())


@pytest.mark.slow
def test_bloom_dense_layers_are_quantized_and_adapted(tmp_path: Any) -> None:
    """Was: ``dense`` and ``dense_4h_to_h`` (29 % of Bloom) neither quantized nor adapted (read under slow_but_exact)."""
    module = Wrapped(bloom())
    assert {layer for _, _, layer in source_readers(module)} >= {"model.transformer.h.0.self_attention.dense"}
    fit(module, tmp_path)
    for name in ("self_attention.dense", "mlp.dense_4h_to_h", "self_attention.query_key_value", "mlp.dense_h_to_4h"):
        layer = module.get_submodule(f"model.transformer.h.0.{name}")
        assert quantized(module, f"model.transformer.h.0.{name}") and hasattr(layer, "lora_A"), name
    rows = {r.kind: r for r in coverage_of(module)}
    assert rows["Linear"].unhandled == 0
    module.model.config.pretraining_tp, module.model.config.slow_but_exact = 2, True
    for block in module.model.transformer.h:
        block.self_attention.pretraining_tp = block.self_attention.slow_but_exact = block.mlp.pretraining_tp = 2
        block.self_attention.slow_but_exact = block.mlp.slow_but_exact = True
    with pytest.raises(readers.UnobservedRead, match=r"BloomAttention.forward read the weight of 'model.transformer.h.0.self_attention.dense'"):
        module.model(input_ids=tokens())


@pytest.mark.slow
def test_mamba_x_proj_and_out_proj_are_quantized_where_the_kernel_branch_does_not_run(tmp_path: Any) -> None:
    """Was: ``x_proj``/``out_proj`` (25 % of Mamba) left in full precision: read only in the CUDA kernel branch."""
    module = Wrapped(mamba())
    fit(module, tmp_path)
    mixer = "model.backbone.layers.0.mixer"
    for name in ("x_proj", "out_proj", "in_proj"):
        assert quantized(module, f"{mixer}.{name}"), name
    # dt_proj's weight is read by `self.dt_proj.weight @ time_step` on the path that trains: stored quantized, the
    # matmul computed from the storage (was: left alone, named)
    assert served(module, f"{mixer}.dt_proj")
    row = {r.kind: r for r in coverage_of(module)}["Linear"]
    assert row.undeliberate == [] and any("read directly by MambaMixer.forward" in why for why in row.reasons)


def test_the_planner_decides_on_the_same_probe(tmp_path: Any) -> None:
    """The engine's probe runs inside the planner's trace too (fake tensors): same layers quantized as the run."""
    module = Wrapped(Reads(), causal=False)
    run_surgery(module, QuantizedPrecision("nf4-dq", dtype="float32"), [LoRA(r=4, target_modules=["a", "d"])], batch=tokens())
    assert quantized(module, "model.d") and served(module, "model.c")


def test_a_one_pass_iterator_loses_no_batch(tmp_path: Any) -> None:
    """A generator given to fit cannot be read twice: the probe's batch is the loop's first (tests/test_probe_batch.py)."""
    module = Wrapped(Reads(), causal=False)
    seen: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
            seen.append(batch_idx)

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["a"]), Count()],
    )  # fmt: skip
    trainer.fit(module, (tokens(i) for i in range(3)))
    assert seen == [0, 1, 2] and readers.observation(module) is not None


# -------- layers of real models whose weight the parent reads


@pytest.mark.parametrize(("name", "read", "reader", "adapted"), [
    # on the path that trains (no CUDA kernels) Mamba reads only dt_proj's weight (`self.dt_proj.weight @ x`): x_proj
    # and out_proj, read only by the kernel branch, are quantized (issue 33); dt_proj (4 inputs) is narrower than r
    ("mamba", ["model.backbone.layers.0.mixer.dt_proj", "model.backbone.layers.1.mixer.dt_proj"], "MambaMixer.forward", False),
    ("swin_like", ["model.layers.0.0.qkv", "model.layers.1.0.qkv"], "SwinLikeAttention.forward", True),
])
def test_layers_whose_weight_is_read_directly_are_stored_quantized_and_named(name: str, read: list[str], reader: str, adapted: bool, tmp_path: Any) -> None:
    """Was: a low-level dtype error in the parent's matmul (transformers Mamba, torchvision Swin); then kept in the
    compute dtype, named (issue 53: 27 % of a small Swin). Now stored quantized, the reads computed from the storage."""
    module = build_any(name)
    recorder = fit_epochs_module(module, 3, tmp_path)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    for layer in read:
        assert served(module, layer) and hasattr(module.get_submodule(layer), "lora_A") == adapted
    rows = {r.kind: r for r in coverage_of(module)}
    assert rows["Linear"].unhandled == 0 and rows["Linear"].undeliberate == []
    assert any(f"read directly by {reader}, computes from the storage" in why for why in rows["Linear"].reasons)



def test_weight_readers_ignore_init_code_and_device_reads() -> None:
    from lightning_hbm.layers import weight_readers

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            nn.init.zeros_(self.a.weight)  # initialisation is not a reader

        def reset_parameters(self) -> None:
            nn.init.ones_(self.b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.to(self.a.weight.device).to(self.d.weight.dtype)  # .device: harmless; .dtype: wrong once quantized
            return self.a(x) + self.b(x) + x @ self.c.weight.T + self.d(x)

    assert weight_readers(nn.Sequential(Reads())) == {"0.c": "Reads.forward", "0.d": "Reads.forward"}
    assert weight_readers(nn.Sequential(Reads()), uses_only=True) == {"0.c": "Reads.forward"}  # an adapter on d works
    for name in ("gpt2", "mixtral", "bert", "transformer_encoder"):  # they call their layers
        assert weight_readers(build(name)) == {}, name



# -------- issue 53, item 1: a quantized convolution's own forward is not a direct read (two regressions)


class PatchEmbed(nn.Module):
    """timm's ``PatchEmbed`` pattern: ``set_input_size`` (a utility never called in training) reads ``proj.weight``;
    ``forward`` only calls ``self.proj(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, 32, 4, stride=4)

    def set_input_size(self) -> torch.Tensor:
        return self.proj.weight.data.clone()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)


class ConvViT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
        self.head = nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def conv_quantized(module: nn.Module, name: str) -> bool:
    from lightning_hbm.layers.kinds import stored_in

    return stored_in(base_layer(module.get_submodule(name))) is not None


def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 16, 16, generator=generator), torch.randint(0, 10, (2,), generator=generator)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "quantized-only"])
def test_a_quantized_convs_own_forward_under_checkpointing_is_no_direct_read(tmp_path: Any, lora: bool) -> None:
    """Was: ``UnobservedRead`` ("PatchEmbed.set_input_size read the weight of 'patch_embed.proj' directly (data)") at
    the first step of every timm ViT: the guard took the convolution's own dequantization for a direct read."""
    from lightning_hbm import ActivationCheckpointing

    torch.manual_seed(0)
    module = ConvViT()
    assert {layer for _, _, layer in source_readers(module)} == {"patch_embed.proj"}  # the hint is there
    callbacks: list[Any] = [ActivationCheckpointing()] + ([LoRA(r=4, alpha=8)] if lora else [])
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, DataLoader([images(1), images(2)], batch_size=None))
    assert trainer.global_step == 2
    assert conv_quantized(module, "patch_embed.proj")
    module.patch_embed(images(3)[0]).sum().backward()  # again, outside the fit: still no refusal
    assert module.patch_embed.set_input_size().dtype == torch.float32  # the utility itself reads the dequantized weight


def test_a_quantized_conv_model_plans_and_runs_surgery() -> None:
    from lightning_hbm.planner import Candidate, plan

    torch.manual_seed(0)
    module = ConvViT()
    run_surgery(module, QuantizedPrecision("nf4-dq", dtype="float32"), [LoRA(r=4, alpha=8)], batch=images(1))
    assert conv_quantized(module, "patch_embed.proj")
    module.training_step(images(2), 0).backward()  # the plain surgery, then a step: no refusal
    prediction = plan(ConvViT, images(1), candidates=[Candidate("nf4-dq", lora_r=4, checkpointing="full")])
    assert prediction.predictions[0].total > 0


def test_recurrent_gemma_trains_with_its_conv_quantized(tmp_path: Any) -> None:
    """Was: refused at the first step (``conv_1d.weight`` is read only on the decoding path; training calls it)."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        lru_width=64, attention_window_size=16, conv1d_width=4, block_types=["recurrent", "attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    module = Wrapped(transformers.RecurrentGemmaForCausalLM(config))
    trainer = fit(module, tmp_path)
    assert trainer.global_step == 2
    assert conv_quantized(module, "model.model.layers.0.temporal_block.conv_1d")


def test_a_true_direct_read_of_a_quantized_conv_is_still_refused(tmp_path: Any) -> None:
    """The guard stays for a real read on a path the probe did not take (the adapter would be skipped)."""

    class Exact(PatchEmbed):
        exact = False

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            if self.exact:
                return F.conv2d(images, self.proj.weight, stride=4).flatten(2).transpose(1, 2)
            return super().forward(images)

    torch.manual_seed(0)
    module = ConvViT()
    module.patch_embed = Exact()
    run_surgery(module, QuantizedPrecision("nf4-dq", dtype="float32"), [LoRA(r=4, alpha=8)], batch=images(1))
    module.patch_embed(images(2)[0])  # the path that trains
    module.patch_embed.exact = True
    with pytest.raises(readers.UnobservedRead, match=r"Exact.forward read the weight of 'patch_embed.proj' directly"):
        module.patch_embed(images(2)[0])


# -------- issue 55, item 3: the probe step leaves the user's run as it was


class Recording(Wrapped):
    """A training_step that draws from Python's and NumPy's RNGs, and a user attribute named ``log``."""

    def __init__(self) -> None:
        super().__init__(Reads(), causal=False)
        self.steps: list[str] = []
        self.draws: list[tuple[float, float]] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        import random

        import numpy as np

        self.draws.append((random.random(), float(np.random.rand())))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.steps.append("validation_step")
        self.model(batch)


def _draws(lora: bool, tmp_path: Any) -> list[tuple[float, float]]:
    import random

    import numpy as np

    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    module = Recording()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        **(dict(plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)]) if lora else {}),
    )  # fmt: skip
    trainer.fit(module, DataLoader([tokens(1), tokens(2)], batch_size=None))
    return module.draws[-2:]  # the two training steps (the probe step, which draws too, came first)


def test_the_probe_step_leaves_python_and_numpy_rngs_as_they_were(tmp_path: Any) -> None:
    """Was: the same seed trained on other draws of Python's and NumPy's RNGs with lightning_hbm than without (a
    plain Trainer: no probe step)."""
    assert _draws(True, tmp_path / "lora") == _draws(False, tmp_path / "plain")


def test_a_user_attribute_named_log_survives_the_probe() -> None:
    module = Wrapped(Reads(), causal=False)
    mine = module.__dict__["log"] = lambda *args, **kwargs: None  # the user's own self.log = ...
    readers.observe(module, tokens(), {"model.c": module.model.c})
    assert module.__dict__["log"] is mine
    plain = Wrapped(Reads(), causal=False)
    readers.observe(plain, tokens(), {"model.c": plain.model.c})
    assert "log" not in plain.__dict__ and "log_dict" not in plain.__dict__


def test_validate_probes_its_own_step_never_training_step(tmp_path: Any) -> None:
    """Was: ``trainer.validate`` / ``trainer.predict`` called the user's ``training_step`` before anything ran."""
    module = Recording()
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)],
    )  # fmt: skip
    trainer.validate(module, DataLoader([tokens(1)], batch_size=None))
    assert module.draws == []  # training_step never ran
    seen = readers.observation(module)
    assert seen is not None and seen.ran.startswith("Recording.validation_step")


def test_drawing_the_probe_batch_leaves_the_loaders_generator_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: a DataLoader's own generator was advanced by the probe's draw, so epoch 0 trained in another order."""
    from lightning_hbm.surgery import engine

    generator = torch.Generator().manual_seed(7)
    loader = DataLoader([tokens(i) for i in range(6)], batch_size=None, shuffle=True, generator=generator)
    state = generator.get_state()

    class Stage:
        fn = "fit"

    class FakeTrainer:  # only what _stage_batch reads: the stage's dataloader
        state = Stage()

    import lightning_hbm._compat.lightning as lightning_compat

    monkeypatch.setattr(lightning_compat, "stage_dataloader", lambda trainer: loader)
    assert engine._stage_batch(FakeTrainer()) is not None  # type: ignore[arg-type]
    assert torch.equal(generator.get_state(), state)


def test_a_manual_optimization_module_is_not_told_to_fix_its_step() -> None:
    """Was: "Make training_step run on the first training batch" for a valid manual-optimization module (its step
    calls self.optimizers(), which do not exist when the probe runs). Session 37: a step with one optimizer runs in
    the probe (stand-ins for the optimizer and manual_backward) and is observed. Session 38: one indexing two runs too
    (``self.optimizers()[1]``), and (s38 h8) one reading ``.optimizer.param_groups``, (s39 h5) ``.optimizer.state_dict()``;
    one calling what the stand-ins do not give (a SAM optimizer's own ``.optimizer.first_step()``) still cannot run,
    and is told there is nothing to fix."""

    class Manual(Wrapped):
        def __init__(self, optimizers: int) -> None:
            super().__init__(Reads(), causal=False)
            self.automatic_optimization, self.count = False, optimizers

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            optimizer = self.optimizers() if self.count == 1 else self.optimizers()[1]
            optimizer.optimizer.param_groups[0]["lr"] = 1e-3
            assert not optimizer.optimizer.state_dict()["state"]
            if self.count == 0:
                optimizer.optimizer.first_step(zero_grad=True)  # a SAM optimizer's own method
            loss = super().training_step(batch, batch_idx)
            self.manual_backward(loss)
            optimizer.step()

    for count in (1, 2):
        module = Manual(count)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert readers.observe(module, tokens(), {"model.c": module.model.c}) is not None
        assert "optimizers" not in vars(module) and "manual_backward" not in vars(module)  # the stand-ins are gone
    module = Manual(0)
    with pytest.warns(UserWarning, match=r"uses manual optimization, which needs the optimizers.*nothing to fix in your code") as caught:
        assert readers.observe(module, tokens(), {"model.c": module.model.c}) is None
    assert not any("Make training_step" in str(w.message) for w in caught)


def test_transformers_dtype_lookup_is_no_read_of_a_weight() -> None:
    """Issue 53: a VLM calling ``self.dtype`` (``PreTrainedModel.dtype``: the first parameter whose
    ``is_floating_point()`` is true, so a packed weight is skipped) kept its patch-embedding conv unquantized, with the
    false reason "weight read directly by ...forward"."""
    from transformers import PretrainedConfig, PreTrainedModel

    class Config(PretrainedConfig):
        model_type = "lightning_hbm_tiny_vision"

    class Vision(PreTrainedModel):
        config_class = Config

        def __init__(self, config: Config) -> None:
            super().__init__(config)
            self.patch = nn.Conv2d(3, 32, 4, stride=4)  # the first parameter: the one .dtype looks at
            self.proj = nn.Linear(32, 10)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.proj(self.patch(pixel_values.type(self.dtype)).flatten(2).mean(-1))

    torch.manual_seed(0)
    model = Vision(Config())
    images = torch.randn(2, 3, 16, 16)
    run_surgery(model, QuantizedPrecision("nf4-dq", dtype="float32"), [], batch=images)
    assert conv_quantized(model, "patch")
    seen = readers.observation(model)
    assert seen is not None and "patch" not in seen.reads
    assert model(images).dtype == torch.float32  # .dtype now answers from the next floating parameter


def test_the_probe_step_is_said_at_fit_start(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO):
        fit(Wrapped(Reads(), causal=False), tmp_path)
    said = [r.getMessage() for r in caplog.records if "once before changing the model" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("lightning_hbm: ran Wrapped.training_step on fake tensors once")


def test_the_probe_step_can_be_turned_off(tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """``LIGHTNING_HBM_PROBE_STEP=0`` (issue 55): the user's step runs only for training; the source scan decides, so
    every layer whose weight the model's code reads (``c``, ``d``, ``e``) is kept in the compute dtype."""
    import logging

    calls: list[int] = []

    class Counting(Wrapped):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            calls.append(batch_idx)
            return super().training_step(batch, batch_idx)

    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", "0")
    module = Counting(Reads(), causal=False)
    with caplog.at_level(logging.INFO):
        fit(module, tmp_path, steps=2)
    assert calls == [0, 1]  # the two training steps, no probe call
    assert any("LIGHTNING_HBM_PROBE_STEP=0: training_step was not run" in r.getMessage() for r in caplog.records)
    assert not any("once before changing the model" in r.getMessage() for r in caplog.records)
    kept = {name for name in ("c", "d", "e") if module.model.get_submodule(name).weight.is_floating_point()}
    assert kept == {"c", "d", "e"} and not module.model.a.base_layer.weight.is_floating_point()


class OwnLoaders(Wrapped):
    """A module with its own dataloader hooks, counting their calls."""

    def __init__(self) -> None:
        super().__init__(Reads(), causal=False)
        self.requested: list[str] = []
        self.trained: list[torch.Tensor] = []

    def train_dataloader(self) -> DataLoader:
        self.requested.append("train")
        return DataLoader([tokens(1), tokens(2)], batch_size=None)

    def val_dataloader(self) -> DataLoader:
        self.requested.append("val")
        return DataLoader([tokens(3)], batch_size=None)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.trained.append(batch)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.model(batch)


def _trainer(tmp_path: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, alpha=8)], **kwargs,
    )  # fmt: skip


def test_the_dataloader_hook_runs_once_per_run(tmp_path: Any) -> None:
    """Was: the probe step called ``train_dataloader()`` (``val_dataloader()`` for validate) to draw its batch, and
    the loop called it again (a stream opened twice, workers started twice). Now the loop gets the loader the probe
    requested."""
    module = OwnLoaders()
    _trainer(tmp_path, max_steps=2, limit_val_batches=0).fit(module)
    assert module.requested == ["train"] and len(module.trained) - 1 == 2  # the probe step's call, then two steps
    assert readers.observation(module) is not None
    validated = OwnLoaders()
    _trainer(tmp_path).validate(validated)
    assert validated.requested == ["val"]


def test_a_run_that_stopped_before_its_loop_hands_nothing_to_the_next(tmp_path: Any) -> None:
    """The loader the probe requested is for its own run's loop: a fit that stopped in ``on_fit_start`` leaves no
    loader for the next fit, which calls the hook again as Lightning would."""

    class StopsOnce(OwnLoaders):
        stopped = False

        def on_fit_start(self) -> None:
            if not StopsOnce.stopped:
                StopsOnce.stopped = True
                raise RuntimeError("stopped in on_fit_start")

    module = StopsOnce()
    trainer = _trainer(tmp_path, max_steps=1, limit_val_batches=0)
    with pytest.raises(RuntimeError, match="stopped in on_fit_start"):
        trainer.fit(module)
    assert module.requested == ["train"] and trainer.global_step == 0
    trainer.fit(module)
    assert module.requested == ["train", "train"] and trainer.global_step == 1


def test_a_probe_step_waiting_for_on_fit_start_is_said(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: a ``training_step`` waiting for something started in ``on_fit_start`` hung with no word (the probe step
    runs before that hook: the model must be changed before the optimizers exist). It still waits, and the user is
    told why and the two ways out."""
    import threading

    from lightning_hbm.surgery import probe_step

    class Waits(Wrapped):
        def __init__(self) -> None:
            super().__init__(Reads(), causal=False)
            self.started = threading.Event()

        def on_fit_start(self) -> None:
            self.started.set()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.started.wait(timeout=3)  # a real one would wait forever
            return super().training_step(batch, batch_idx)

    monkeypatch.setattr(probe_step, "PROBE_PATIENCE_S", 0.5)  # read where the probe step lives
    with pytest.warns(UserWarning, match=r"Waits\.training_step has been running for 0 s in the probe step.*before on_fit_start.*setup\(\).*LIGHTNING_HBM_PROBE_STEP=0"):
        fit(Waits(), tmp_path, steps=1)


def test_drawing_the_probe_batch_leaves_no_pass_in_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop trains on the loader the probe drew from: a persistent-workers pass begun for the probe batch would
    be reset, not rebuilt, by the loop's first ``iter`` (its index sampler kept: a ResumableDataLoader's skip of the
    restored batches lost), and a ResumableDataLoader's pass counter would say one batch was trained."""
    import lightning_hbm._compat.lightning as lightning_compat
    from lightning_hbm.data import ResumableDataLoader
    from lightning_hbm.surgery import engine

    class Stage:
        fn = "fit"

    class FakeTrainer:  # only what _stage_batch reads: the stage's dataloader
        state = Stage()

    persistent = DataLoader([tokens(i) for i in range(4)], batch_size=None, num_workers=1, persistent_workers=True)
    resumable = ResumableDataLoader([tokens(i) for i in range(4)], batch_size=2)
    for loader in (persistent, resumable):
        before = dict(vars(loader))
        monkeypatch.setattr(lightning_compat, "stage_dataloader", lambda trainer: loader)  # noqa: B023 - called in this iteration only
        assert engine._stage_batch(FakeTrainer()) is not None  # type: ignore[arg-type]
        assert vars(loader) == before
    assert persistent._iterator is None and resumable.state_dict()["batches"] == 0


def test_the_advice_names_the_stage_step_that_could_not_run() -> None:
    """A validate run whose ``validation_step`` cannot run in the probe was told to "Make training_step (or forward) run
    on the first training batch" (session 38): the advice names the stage's own step and batch."""

    class Failing(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            raise RuntimeError("needs the validation service")

    module = Failing()
    with pytest.warns(UserWarning, match=r"Make validation_step \(or forward\) run on the first validation batch"):
        assert readers.observe(module, torch.zeros(2, 4), {"layer": module.layer}, step="validation_step") is None
