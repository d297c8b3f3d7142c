"""Models of libraries other than transformers (issue 24, round two; issue 25's planner check).

torchvision ViT, Swin and ResNet18, timm ConvNeXt, LitGPT's ``GPT`` and a torchtune llama3 component model,
each built from its library's own classes and a small config (no download), each with ``nf4-dq`` + ``LoRA`` +
``ActivationCheckpointing`` (+ ``FusedLoss`` for the language models) through a real Trainer: it fits, the loss
falls, every adapter gets a gradient, the adapter-only checkpoint resumes bit-exact and the coverage table is right.

None of the four libraries is a test extra (benchmarks/README.md, "Models of other libraries", says where these
tests ran): each test skips, with the reason, where its library does not import.
"""

from __future__ import annotations

import importlib
import math
import warnings
from functools import partial
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import base_layer, find_layers
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.planner import Candidate, plan
from lightning_hbm.planner.reference import memtracker_peak

TORCHVISION = (
    "torchvision from PyPI does not import beside torch 2.13.0 ('operator torchvision::nms does not exist'); "
    "run in a torch 2.14.1 + torchvision 0.29.1 venv, see benchmarks/README.md"
)
WHY_ABSENT = {
    "torchvision": TORCHVISION,
    "timm": "timm needs torchvision: " + TORCHVISION,
    "litgpt": "litgpt 0.5.13 pins huggingface_hub<1.4 (transformers 5 needs >=1.31): install it with --no-deps, "
              "see benchmarks/README.md",
    "torchtune": "torchtune 0.6.1 imports torchao.dtypes.nf4tensor, gone in torchao 0.18: run beside torchao 0.17, "
                 "see benchmarks/README.md",
}


def library(name: str) -> Any:
    """The library, or a skip naming why it is missing (torchvision fails with a RuntimeError, not an ImportError)."""
    try:
        return importlib.import_module(name)
    except (ImportError, RuntimeError) as err:
        pytest.skip(f"{name} does not import here ({type(err).__name__}: {str(err)[:120]}); {WHY_ABSENT[name]}")


IMAGE, CLASSES, BATCH = 32, 10, 4
VOCAB, SEQ = 128, 16


# ---------------------------------------------------------------------------------------------- models


def vit() -> nn.Module:
    tv = library("torchvision")
    return tv.models.VisionTransformer(
        image_size=IMAGE, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128, num_classes=CLASSES
    )


def swin() -> nn.Module:
    tv = library("torchvision")
    return tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        stochastic_depth_prob=0.0, num_classes=CLASSES,
    )


def resnet18() -> nn.Module:
    return library("torchvision").models.resnet18(num_classes=CLASSES)


def convnext() -> nn.Module:
    timm = library("timm")
    return timm.models.convnext.ConvNeXt(depths=(2, 2, 2, 2), dims=(16, 32, 64, 128), num_classes=CLASSES)


def litgpt_gpt() -> nn.Module:
    library("litgpt")
    from litgpt.config import Config
    from litgpt.model import GPT

    config = Config(
        block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_head=4, n_query_groups=2, n_embd=64,
        rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=128,
    )
    return GPT(config)


def torchtune_llama3() -> nn.Module:
    library("torchtune")
    from torchtune.models.llama3 import llama3

    return llama3(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=SEQ, intermediate_dim=128)


class Classifier(pl.LightningModule):
    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = factory()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images).float(), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class LanguageModel(Classifier):
    """Next-token loss written as users write it (FusedLoss recognises it: the logits are never built)."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


# name: (factory, LightningModule, batch maker, compute dtype, modules_to_save, FusedLoss heads or None). The
# classifier heads are new layers, trained in full (peft's recipe); ResNet runs in bf16 (its BatchNorm in fp32).
MODELS: dict[str, tuple[Callable[[], nn.Module], type, Callable[[int], Any], str, list[str], Any]] = {
    "vit": (vit, Classifier, images, "float32", ["model.heads.head"], None),
    "swin": (swin, Classifier, images, "float32", ["model.head"], None),
    "resnet18": (resnet18, Classifier, images, "bfloat16", ["model.fc"], None),
    "convnext": (convnext, Classifier, images, "float32", ["model.head.fc"], None),
    "litgpt": (litgpt_gpt, LanguageModel, tokens, "float32", [], ["model.lm_head"]),
    "torchtune": (torchtune_llama3, LanguageModel, tokens, "float32", [], ["model.output"]),
}


def build(name: str) -> Classifier:
    torch.manual_seed(0)
    factory, cls = MODELS[name][:2]
    return cls(factory)


def trainer_parts(name: str) -> tuple[QuantizedPrecision, list[pl.Callback]]:
    """The plugin and callbacks as the model runs: fresh instances every time."""
    _, _, _, dtype, saved, heads = MODELS[name]
    callbacks: list[pl.Callback] = [LoRA(r=8, alpha=16, modules_to_save=saved or None), ActivationCheckpointing()]
    if heads is not None:
        callbacks.append(FusedLoss(heads=heads))
    return QuantizedPrecision("nf4-dq", dtype=dtype), callbacks


def trained_in_full(name: str, key: str) -> bool:
    return any(key.startswith(f"{m}.") for m in MODELS[name][4])


class Recorder(pl.Callback):
    """Losses of every step; the LoRA parameters without a gradient after some backward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.no_grad: set[str] = set()
        self.callbacks: list[pl.Callback] = []

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.callbacks = list(trainer.callbacks)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.no_grad |= {n for n, p in pl_module.named_parameters() if ".lora_" in n and p.grad is None}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(name: str, epochs: int, root: Any, ckpt_path: Any = None, save: Any = None) -> tuple[Classifier, Recorder]:
    """Whole epochs of the same 2 batches (a resumed run replays them): a fresh model, plugin and callbacks."""
    module, recorder = build(name), Recorder()
    plugin, callbacks = trainer_parts(name)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        plugins=[plugin], callbacks=[*callbacks, recorder],
    )
    batches = MODELS[name][2]
    trainer.fit(module, DataLoader([batches(1), batches(2)], batch_size=None), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return module, recorder


EPOCHS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Classifier, Recorder, list[str]]]:
    """One straight fit per model, shared by the tests of this file, with the warnings it raised."""
    done: dict[str, tuple[Classifier, Recorder, list[str]]] = {}

    def run(name: str) -> tuple[Classifier, Recorder, list[str]]:
        if name not in done:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module, recorder = fit(name, EPOCHS, tmp_path_factory.mktemp(name))
            done[name] = (module, recorder, [str(w.message) for w in caught])
        return done[name]

    return run


def rows(module: nn.Module) -> dict[str, Any]:
    return {r.kind: r for r in coverage_of(module)}


# ------------------------------------------------------------------------ every model: fit, gradients, resume


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_fits_the_loss_falls_and_every_adapter_gets_a_gradient(name: str, runs: Any) -> None:
    module, recorder, _ = runs(name)
    losses = recorder.losses
    assert len(losses) == 2 * EPOCHS and all(math.isfinite(x) for x in losses), losses
    assert losses[-2] + losses[-1] < losses[0] + losses[1], losses  # every epoch sees the same 2 batches
    assert any(".lora_" in n for n, _ in module.named_parameters())
    assert not recorder.no_grad, f"adapters without gradient: {sorted(recorder.no_grad)[:6]}"
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in module.named_parameters() if ".lora_" in n or trained_in_full(name, n)}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_adapter_only_checkpoint_resumes_bit_exact(name: str, runs: Any, tmp_path: Any) -> None:
    straight, _, _ = runs(name)
    fit(name, 1, tmp_path, save=tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=False)["lightning_hbm"]["state_dict"]
    # adapters, the heads trained in full and BatchNorm statistics; no frozen base weight
    frozen = {n for n, p in straight.named_parameters() if not p.requires_grad}
    assert any(".lora_" in k for k in saved) and not frozen & set(saved), sorted(frozen & set(saved))[:6]
    resumed, _ = fit(name, EPOCHS, tmp_path, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    statistics = dict(straight.named_buffers())  # ResNet's BatchNorm running statistics are restored too
    for key, buffer in resumed.named_buffers():
        if "running_" in key:
            torch.testing.assert_close(buffer, statistics[key], rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------------------- the coverage table, per model


def linears(module: nn.Module, suffixes: tuple[str, ...]) -> list[str]:
    return [n for n, m in module.named_modules() if n.endswith(suffixes) and hasattr(base_layer(m), "in_features")]


@pytest.mark.slow
def test_vit_attention_is_quantized_and_adapted_patch_conv_adapted(runs: Any) -> None:
    module, _, warned = runs("vit")
    table = rows(module)
    attention = table["MultiheadAttention"]  # nn.MultiheadAttention, replaced by four Linear projections
    assert attention.quantized == attention.adapted == attention.checkpointed == attention.params > 0
    mlp = linears(module, (".mlp.0", ".mlp.3"))
    assert len(mlp) == 4 and all(not base_layer(module.get_submodule(n)).weight.is_floating_point() for n in mlp)
    conv = table["Conv"]  # the patch embedding: adapted, kept in the compute dtype, named
    assert conv.adapted == conv.params > 0 and conv.quantized == 0 and conv.undeliberate == ["model.conv_proj"]
    assert any("Conv layers not quantized: ['model.conv_proj']" in w for w in warned)
    assert table["Linear"].reasons == {"LoRA modules_to_save: trained in full precision": 64 * CLASSES + CLASSES}


@pytest.mark.slow
def test_swin_qkv_and_proj_read_directly_are_stored_quantized_and_adapted(runs: Any) -> None:
    """Was (issue 53 item 3): kept in the compute dtype, "weight read directly" (27 % of this Swin). Now stored in the
    mode as ``ReadableLinear``: the weight torchvision passes to ``shifted_window_attention`` computes from the storage
    and runs the adapter. Written in session 22 without torchvision (it does not import beside torch 2.13): not run yet."""
    from lightning_hbm.layers.read_weight import ReadableLinear

    module, _, warned = runs("swin")
    read = linears(module, (".attn.qkv", ".attn.proj"))
    assert len(read) == 8  # 2 stages x 2 blocks x (qkv, proj): torchvision passes their weights to a function
    for name in read:
        layer = module.get_submodule(name)
        assert isinstance(base_layer(layer), ReadableLinear) and hasattr(layer, "lora_A")  # the recorder saw its gradient
    table = rows(module)
    assert any("read directly by ShiftedWindowAttention.forward, computes from the storage" in why for why in table["Linear"].reasons)
    assert not set(read) & set(table["Linear"].undeliberate)
    assert not any("Linear layers left as they were" in w and read[0] in w for w in warned)
    mlp = linears(module, (".mlp.0", ".mlp.3", ".reduction"))
    assert len(mlp) == 9 and all(not base_layer(module.get_submodule(n)).weight.is_floating_point() for n in mlp)
    linear = table["Linear"]  # everything else: quantized and adapted (the head: modules_to_save)
    assert linear.quantized == linear.adapted == linear.params - linear.left_alone > 0


@pytest.mark.slow
def test_resnet18_batchnorm_stays_fp32_under_bf16_and_every_convolution_is_adapted(runs: Any) -> None:
    module, _, warned = runs("resnet18")
    norms = [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 20 and all(m.weight.dtype == m.running_mean.dtype == torch.float32 for m in norms)
    convs = [m for n, m in module.named_modules() if isinstance(m, nn.Conv2d) and ".lora_" not in n]  # adapters are Conv2d too
    assert len(convs) == 20 and all(m.weight.dtype == torch.bfloat16 and not m.weight.requires_grad for m in convs)
    table = rows(module)
    assert table["Conv"].adapted == table["Conv"].params > 0.95 * sum(r.params for r in table.values() if not r.kind.startswith("LoRA"))
    assert table["Conv"].quantized == 0 and len(table["Conv"].undeliberate) == 20
    assert any("97.4% of the parameters are Conv layers not quantized" in w for w in warned)
    # the 8 BasicBlocks are checkpointed; the stem convolution sits outside them
    assert table["Conv"].checkpointed == table["Conv"].params - module.model.conv1.base_layer.weight.numel()


@pytest.mark.slow
def test_convnext_mlps_quantized_depthwise_convolutions_named(runs: Any) -> None:
    module, _, warned = runs("convnext")
    table = rows(module)
    linear = table["Linear"]  # timm's Mlp fc1/fc2 in every block
    assert linear.quantized == linear.adapted == linear.checkpointed == linear.params - linear.left_alone > 0
    depthwise = [n for n, m in module.named_modules() if n.endswith("conv_dw")]
    assert len(depthwise) == 8 and not any(hasattr(module.get_submodule(n), "lora_A") for n in depthwise)
    conv = table["Conv"]  # stem and downsampling convolutions adapted; depthwise ones (grouped) left, named
    assert conv.left_alone == sum(module.get_submodule(n).weight.numel() + module.get_submodule(n).bias.numel() for n in depthwise)
    assert set(depthwise) <= set(conv.undeliberate) and any("Conv layers not quantized" in w for w in warned)
    # and why: not only "not quantized" but LoRA's skip of grouped convolutions, with the fix
    assert [n for r, n in conv.reasons.items() if "LoRA skips grouped/depthwise convolutions" in r] == [conv.left_alone]
    assert any("LoRA skips grouped/depthwise" in w and "modules_to_save" in w for w in warned)
    assert [n for n, _ in find_blocks(module)] == [f"model.stages.{s}.blocks.{b}" for s in range(4) for b in range(2)]


@pytest.mark.parametrize("name", ["litgpt", "torchtune"])
@pytest.mark.slow
def test_language_model_blocks_quantized_adapted_checkpointed_loss_fused(name: str, runs: Any) -> None:
    module, recorder, _ = runs(name)
    table = rows(module)
    head = MODELS[name][5][0]
    blocks = [n for n, _, _ in find_layers(module) if n != head]
    assert len(blocks) == 2 * (5 if name == "litgpt" else 7)  # litgpt's fused qkv; torchtune's q, k, v
    for layer in blocks:
        assert not base_layer(module.get_submodule(layer)).weight.is_floating_point() and hasattr(module.get_submodule(layer), "lora_A")
    assert table["Linear"].checkpointed == table["Linear"].params - VOCAB * 64  # all but the head
    fused = next(c for c in recorder.callbacks if isinstance(c, FusedLoss))
    assert fused.applied_heads == [head]


@pytest.mark.parametrize("name", ["litgpt", "torchtune"])
@pytest.mark.slow
def test_language_model_output_head_stays_in_full_precision_and_is_named(name: str, runs: Any) -> None:
    """As transformers' output heads: kept in the compute dtype, no adapter, the coverage table says why."""
    module, _, _ = runs(name)
    head = module.get_submodule(MODELS[name][5][0])
    assert type(head) is nn.Linear and head.weight.dtype == torch.float32
    assert any(why.startswith("output head kept in full precision") for why in rows(module)["Linear"].reasons)


# ------------------------------------------------- issue 25: plan() as they run, against torch's MemTracker


@pytest.mark.parametrize("name", ["swin", "torchtune"])
@pytest.mark.slow
def test_plan_as_configured_within_3_percent_of_memtracker(name: str) -> None:
    """Swin with its directly read qkv/proj stored quantized and its head trained in full; torchtune's llama3 with its
    ``output`` head fused (FusedLoss(heads=['model.output'])). Measured: benchmarks/README.md."""
    plugin, callbacks = trainer_parts(name)
    candidate = Candidate.from_trainer(plugin, callbacks)
    factory, batch = partial(build, name), MODELS[name][2](1)
    predicted = plan(factory, batch, candidates=[candidate]).find(candidate)
    measured = memtracker_peak(factory, batch, candidate)
    assert predicted.peak == pytest.approx(measured, rel=0.03)
    assert abs(predicted.peak - measured) <= 8  # equal to the byte on both (Dec 1)
    assert not predicted.fallbacks  # traced with fake tensors throughout
