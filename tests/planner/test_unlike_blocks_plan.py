"""Issue 33: the planner on blocks that change shape (timm EfficientNet's stages) and on trainable layers the loss never
reaches (LLaVA's last vision layer under ``vision_feature_layer=-2``), against torch's MemTracker.

Was: stage ``Sequential``s and their blocks both checkpointed (nested), then the cut to 3 blocks gave the head 16
channels instead of 80 (crash); every trainable parameter got a gradient and Adam state in the first step (+8 %).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.reference import memtracker_peak
from lightning_hbm.planner.tracing import _block_list


class InvertedResidual(nn.Module):
    """timm's MBConv shape: expand 1x1, depthwise 3x3, project 1x1; residual only when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int = 1, expand: int = 4) -> None:
        super().__init__()
        mid = cin * expand
        self.conv_pw = nn.Conv2d(cin, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid)
        self.conv_dw = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False)
        self.bn2 = nn.BatchNorm2d(mid)
        self.conv_pwl = nn.Conv2d(mid, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn3(self.conv_pwl(F.silu(self.bn2(self.conv_dw(F.silu(self.bn1(self.conv_pw(x))))))))
        return x + out if self.residual else out


def efficientnet_like(depths: tuple[int, ...] = (1, 2, 9), widths: tuple[int, ...] = (8, 16, 24)) -> nn.Module:
    """``blocks``: a Sequential of stage Sequentials; each stage's first block changes channels and stride (timm)."""
    stages, cin = [], 8
    for depth, width in zip(depths, widths):
        stages.append(nn.Sequential(*(InvertedResidual(cin if i == 0 else width, width, 2 if i == 0 else 1) for i in range(depth))))
        cin = width
    model = nn.Module()
    model.conv_stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    model.blocks = nn.Sequential(*stages)
    model.conv_head = nn.Conv2d(cin, 32, 1)
    model.classifier = nn.Linear(32, 10)
    return model


class Classifier(pl.LightningModule):
    def __init__(self, net: Any) -> None:
        super().__init__()
        self.net = net() if callable(net) else net

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        net = self.net
        if hasattr(net, "forward_features"):  # timm
            return net(images)
        x = net.conv_head(net.blocks(net.conv_stem(images)))
        return net.classifier(x.mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


IMAGES = (torch.randn(2, 3, 64, 64), torch.tensor([1, 3]))


def test_find_blocks_never_nests_stage_sequentials_and_their_blocks() -> None:
    """Was: blocks.1 (a stage) and blocks.1.0, blocks.1.1 (its blocks) all found: nested recompute."""
    names = [name for name, _ in find_blocks(efficientnet_like())]
    # the first stage holds one block: it gives way to it too, one level of blocks everywhere (issue 53)
    assert names == ["blocks.0.0", "blocks.1.0", "blocks.1.1", *(f"blocks.2.{i}" for i in range(9))], names
    assert not [n for n in names if any(n.startswith(o + ".") for o in names)]


def test_only_lists_of_alike_blocks_are_cut() -> None:
    # blocks.2: its first block changes channels; from index 2 on all alike: cut and extended
    assert _block_list(efficientnet_like()) == ("blocks.2", 9)
    # a list whose blocks keep changing shape is never cut (it is traced whole)
    unlike = nn.Module()
    unlike.blocks = nn.Sequential(*(InvertedResidual(8 * (i + 1), 8 * (i + 2)) for i in range(8)))
    assert _block_list(unlike) == ("", 0)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_efficientnet_like_plan_runs_and_is_within_3_percent_of_memtracker(checkpointing: str) -> None:
    factory = partial(Classifier, efficientnet_like)
    candidate = Candidate("32-true", checkpointing=checkpointing)
    fast = predict(factory, IMAGES, candidate, extrapolate=True)  # blocks.2 cut to 3 and 4, extended to 9
    full = predict(factory, IMAGES, candidate, extrapolate=False)
    measured = memtracker_peak(factory, IMAGES, candidate)
    print(f"{checkpointing}: extrapolated {fast.peak:,} B, whole {full.peak:,} B, MemTracker {measured:,} B")
    assert full.peak == pytest.approx(measured, rel=0.03)
    assert fast.peak == pytest.approx(measured, rel=0.03)


def test_unlike_blocks_are_traced_whole_instead_of_crashing() -> None:
    """8 stages of one block each, every one changing channels: the old cut to 3 fed conv_head the wrong width."""
    factory = partial(Classifier, partial(efficientnet_like, depths=(1,) * 8, widths=tuple(8 + 4 * i for i in range(8))))
    candidate = Candidate("32-true", checkpointing="full")
    planned = predict(factory, IMAGES, candidate, extrapolate=True)
    assert planned.peak == pytest.approx(memtracker_peak(factory, IMAGES, candidate), rel=0.03)


@pytest.mark.slow
def test_real_timm_efficientnet_one_level_of_blocks_and_plan_within_3_percent() -> None:
    timm = pytest.importorskip("timm")
    factory = partial(Classifier, partial(timm.create_model, "efficientnet_b0", pretrained=False, num_classes=10, drop_path_rate=0.0))
    names = [name for name, _ in find_blocks(factory())]
    assert names and not [n for n in names if any(n.startswith(o + ".") for o in names)], names
    candidate = Candidate("32-true", checkpointing="full")
    images = (torch.randn(2, 3, 64, 64), torch.tensor([1, 3]))
    planned = predict(factory, images, candidate)
    measured = memtracker_peak(factory, images, candidate)
    print(f"timm efficientnet_b0: planned {planned.peak:,} B, MemTracker {measured:,} B")
    assert planned.peak == pytest.approx(measured, rel=0.03)


# ------------------------------------------------------------------ trainable parameters that get no gradient


class UnusedTail(pl.LightningModule):
    """A stack whose last layer's output the loss never uses (as LLaVA's ``vision_feature_layer=-2``)."""

    def __init__(self, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.head = nn.Linear(width, 8)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, labels = batch
        hidden = [x]
        for layer in self.layers:
            hidden.append(torch.relu(layer(hidden[-1])))
        return F.cross_entropy(self.head(hidden[-2]), labels)  # the last layer runs, its output is dropped

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_first_step_state_counts_only_parameters_the_loss_reaches() -> None:
    batch = (torch.randn(4, 256), torch.tensor([0, 1, 2, 3]))
    candidate = Candidate("32-true", checkpointing="none")
    planned = predict(UnusedTail, batch, candidate, extrapolate=False)
    measured = memtracker_peak(UnusedTail, batch, candidate)
    # was: the unused layer's gradient and two Adam states counted (3 x 257 KiB, +18 % here)
    assert planned.peak == pytest.approx(measured, rel=0.01), (planned.peak, measured)
    width = 256
    # exp_avg and exp_avg_sq of the 3 reached layers and the head, plus one 4-byte step count per parameter (8)
    assert planned.categories["optimizer_states"] == 2 * 4 * (3 * (width * width + width) + 8 * width + 8) + 8 * 4


class TinyLlava(pl.LightningModule):
    """transformers LlavaForConditionalGeneration as released (``vision_feature_layer=-2``), tiny CLIP + Llama."""

    def __init__(self) -> None:
        super().__init__()
        vision = transformers_module().CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        )  # fmt: skip
        text = transformers_module().LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=128,
        )  # fmt: skip
        config = transformers_module().LlavaConfig(vision_config=vision, text_config=text, image_token_index=255, vision_feature_layer=-2)
        self.model = transformers_module().LlavaForConditionalGeneration(config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, pixel_values = batch
        return self.model(input_ids=input_ids, pixel_values=pixel_values, labels=input_ids, use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def transformers_module() -> Any:
    return pytest.importorskip("transformers")


def test_llava_first_step_state_within_1_percent_of_memtracker() -> None:
    tokens = torch.randint(0, 200, (2, 40))
    tokens[:, 1:17] = 255  # (16 / 4) ** 2 image patches
    batch = (tokens, torch.randn(2, 3, 16, 16))
    candidate = Candidate("32-true", checkpointing="none")  # full training: the last vision layer is trainable
    planned = predict(TinyLlava, batch, candidate, extrapolate=False)
    measured = memtracker_peak(TinyLlava, batch, candidate)
    print(f"llava: planned {planned.peak:,} B, MemTracker {measured:,} B ({100 * (planned.peak / measured - 1):+.2f} %)")
    assert planned.peak == pytest.approx(measured, rel=0.01)
