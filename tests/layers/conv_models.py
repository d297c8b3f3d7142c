"""Convolutional networks at their real layouts and sizes, hand-written (torchvision and timm do not import beside
the CPU torch this project tests with): torchvision's resnet18, timm's EfficientNet-B0 blocks in miniature."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)) if stride != 1 or cin != cout else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18's layers and parameter count (11,689,512)."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)
        widths, layers, cin = (64, 128, 256, 512), [], 64
        for i, width in enumerate(widths):
            layers.append(nn.Sequential(BasicBlock(cin, width, 1 if i == 0 else 2), BasicBlock(width, width, 1)))
            cin = width
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(x.mean((2, 3)))


class InvertedResidual(nn.Module):
    """timm's EfficientNet block: 1x1 expand, depthwise kxk, squeeze-excite (1x1 convs), 1x1 project."""

    def __init__(self, cin: int, cout: int, expand: int, kernel: int, stride: int) -> None:
        super().__init__()
        mid = cin * expand
        self.conv_pw, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv_dw, self.bn2 = nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False), nn.BatchNorm2d(mid)
        self.se_reduce, self.se_expand = nn.Conv2d(mid, max(1, cin // 4), 1), nn.Conv2d(max(1, cin // 4), mid, 1)
        self.conv_pwl, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.silu(self.bn2(self.conv_dw(F.silu(self.bn1(self.conv_pw(x))))))
        y = y * torch.sigmoid(self.se_expand(F.silu(self.se_reduce(y.mean((2, 3), keepdim=True)))))
        y = self.bn3(self.conv_pwl(y))
        return x + y if self.residual else y


class EfficientNetB0(nn.Module):
    """EfficientNet-B0's stages (timm ``efficientnet_b0``: 5.3 M parameters), each a Sequential of blocks."""

    STAGES = ((1, 16, 1, 3, 1), (6, 24, 2, 3, 2), (6, 40, 2, 5, 2), (6, 80, 3, 3, 2), (6, 112, 3, 5, 1), (6, 192, 4, 5, 2), (6, 320, 1, 3, 1))

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv_stem, self.bn1 = nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32)
        stages, cin = [], 32
        for expand, cout, repeats, kernel, stride in self.STAGES:
            stages.append(nn.Sequential(*(InvertedResidual(cin if i == 0 else cout, cout, expand, kernel, stride if i == 0 else 1) for i in range(repeats))))
            cin = cout
        self.blocks = nn.Sequential(*stages)
        self.conv_head, self.bn2 = nn.Conv2d(320, 1280, 1, bias=False), nn.BatchNorm2d(1280)
        self.classifier = nn.Linear(1280, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.silu(self.bn1(self.conv_stem(x))))
        return self.classifier(F.silu(self.bn2(self.conv_head(x))).mean((2, 3)))


class ConvBNAct(nn.Module):
    """Conv-BN-activation, the unit of YOLO-style detectors (SiLU) and MobileNetV3 (hardswish / ReLU)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn, self.act = nn.BatchNorm2d(cout), act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class CSP(nn.Module):
    """YOLOv8's C2f: a 1x1 conv split in two, bottlenecks (two 3x3 convs, residual) on one half, all concatenated."""

    def __init__(self, cin: int, cout: int, repeats: int, shortcut: bool = True) -> None:
        super().__init__()
        self.half = cout // 2
        self.cv1, self.cv2 = ConvBNAct(cin, 2 * self.half), ConvBNAct((2 + repeats) * self.half, cout)
        self.blocks = nn.ModuleList(nn.Sequential(ConvBNAct(self.half, self.half, 3), ConvBNAct(self.half, self.half, 3)) for _ in range(repeats))
        self.shortcut = shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.cv1(x).chunk(2, 1))
        for block in self.blocks:
            parts.append(parts[-1] + block(parts[-1]) if self.shortcut else block(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class YoloDetector(nn.Module):
    """A YOLOv8n-style detector: CSP backbone, SPPF, FPN/PAN neck, three heads (box 64 + 80 classes per cell)."""

    def __init__(self, classes: int = 80) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, 16, 3, 2), ConvBNAct(16, 32, 3, 2), CSP(32, 32, 1))
        self.p3 = nn.Sequential(ConvBNAct(32, 64, 3, 2), CSP(64, 64, 2))
        self.p4 = nn.Sequential(ConvBNAct(64, 128, 3, 2), CSP(128, 128, 2))
        self.p5 = nn.Sequential(ConvBNAct(128, 256, 3, 2), CSP(256, 256, 1))
        self.sppf_in, self.sppf_out = ConvBNAct(256, 128), ConvBNAct(512, 256)
        self.up4, self.up3 = CSP(384, 128, 1, False), CSP(192, 64, 1, False)
        self.down3, self.pan4 = ConvBNAct(64, 64, 3, 2), CSP(192, 128, 1, False)
        self.down4, self.pan5 = ConvBNAct(128, 128, 3, 2), CSP(384, 256, 1, False)
        self.heads = nn.ModuleList(
            nn.Sequential(ConvBNAct(c, 64, 3), ConvBNAct(64, 64, 3), nn.Conv2d(64, 64 + classes, 1)) for c in (64, 128, 256)
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c3 = self.p3(self.stem(x))
        c4 = self.p4(c3)
        y = self.sppf_in(self.p5(c4))
        pools = [y]
        for _ in range(3):
            pools.append(F.max_pool2d(pools[-1], 5, 1, 2))
        c5 = self.sppf_out(torch.cat(pools, 1))
        n4 = self.up4(torch.cat([F.interpolate(c5, scale_factor=2.0), c4], 1))
        n3 = self.up3(torch.cat([F.interpolate(n4, scale_factor=2.0), c3], 1))
        m4 = self.pan4(torch.cat([self.down3(n3), n4], 1))
        m5 = self.pan5(torch.cat([self.down4(m4), c5], 1))
        return [head(level) for head, level in zip(self.heads, (n3, m4, m5))]


class MobileBlock(nn.Module):
    """MobileNetV3's inverted residual: 1x1 expand, depthwise kxk, optional squeeze-excite, 1x1 project."""

    def __init__(self, cin: int, mid: int, cout: int, kernel: int, stride: int, se: bool, act: type[nn.Module]) -> None:
        super().__init__()
        self.expand = ConvBNAct(cin, mid, act=act) if mid != cin else nn.Identity()
        self.dw = ConvBNAct(mid, mid, kernel, stride, groups=mid, act=act)
        self.se = nn.Sequential(nn.Conv2d(mid, max(8, mid // 4), 1), nn.ReLU(), nn.Conv2d(max(8, mid // 4), mid, 1), nn.Hardsigmoid()) if se else None
        self.project = nn.Sequential(nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dw(self.expand(x))
        if self.se is not None:
            y = y * self.se(y.mean((2, 3), keepdim=True))
        y = self.project(y)
        return x + y if self.residual else y


class MobileNetV3FPN(nn.Module):
    """torchvision's fasterrcnn_mobilenet_v3_large_fpn backbone: MobileNetV3-Large features, a 2-level FPN (256)."""

    # (kernel, expanded, out, squeeze-excite, hardswish, stride): MobileNetV3-Large
    CONFIG = (
        (3, 16, 16, False, False, 1), (3, 64, 24, False, False, 2), (3, 72, 24, False, False, 1),
        (5, 72, 40, True, False, 2), (5, 120, 40, True, False, 1), (5, 120, 40, True, False, 1),
        (3, 240, 80, False, True, 2), (3, 200, 80, False, True, 1), (3, 184, 80, False, True, 1),
        (3, 184, 80, False, True, 1), (3, 480, 112, True, True, 1), (3, 672, 112, True, True, 1),
        (5, 672, 160, True, True, 2), (5, 960, 160, True, True, 1), (5, 960, 160, True, True, 1),
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvBNAct(3, 16, 3, 2, act=nn.Hardswish)]
        cin = 16
        for kernel, mid, cout, se, hs, stride in self.CONFIG:
            layers.append(MobileBlock(cin, mid, cout, kernel, stride, se, nn.Hardswish if hs else nn.ReLU))
            cin = cout
        self.body = nn.Sequential(*layers)
        self.last = ConvBNAct(160, 960, act=nn.Hardswish)
        self.inner = nn.ModuleList([nn.Conv2d(160, 256, 1), nn.Conv2d(960, 256, 1)])
        self.outer = nn.ModuleList([nn.Conv2d(256, 256, 3, padding=1), nn.Conv2d(256, 256, 3, padding=1)])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c4 = self.body(x)
        c5 = self.last(c4)
        top = self.inner[1](c5)
        low = self.inner[0](c4) + F.interpolate(top, size=c4.shape[-2:])
        return [self.outer[0](low), self.outer[1](top)]


class Pixels(nn.Module):
    """A transformers image classifier called on a tensor (its forward takes ``pixel_values=``), giving its logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        return self.model(pixel_values=x).logits


def lightning_net(model: nn.Module) -> Any:
    """``model`` in a LightningModule fitted through the Trainer: its step's loss the mean square of the outputs (a list
    of them: summed), SGD on the trainable parameters. Lightning is imported at the first call, not with this module
    (benchmarks import it before their torchvision schema shim runs)."""
    return _lightning_net_class()(model)


@functools.cache
def _lightning_net_class() -> Any:
    import lightning.pytorch as pl

    class _Net(pl.LightningModule):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> Any:
            return self.model(x)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            out = self(batch)
            return sum(t.float().square().mean() for t in (out if isinstance(out, list) else [out]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3)

    return _Net


def classifier(net: nn.Module) -> Any:
    """``net`` in a LightningModule trained on ``(images, labels)`` batches with cross-entropy, AdamW lr 1e-2 (the
    correction's conv tests). Lightning imported at the first call, as :func:`lightning_net`."""
    return _classifier_class()(net)


@functools.cache
def _classifier_class() -> Any:
    import lightning.pytorch as pl

    class _Classifier(pl.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.cross_entropy(self(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return _Classifier


def small_images(seed: int, n: int = 8) -> torch.Tensor:
    """``n`` smooth 16 x 16 images (4 x 4 noise upsampled, plus a little fine noise): the small conv nets' batches."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.randn(n, 3, 4, 4, generator=g), size=(16, 16), mode="bilinear") + 0.1 * torch.randn(n, 3, 16, 16, generator=g)


def images(batch: int, seed: int, batches: int = 1, size: int = 64) -> list[torch.Tensor] | torch.Tensor:
    """Smooth random images (low-resolution noise upsampled, plus a little fine noise): image-like statistics."""
    g = torch.Generator().manual_seed(seed)
    out = [
        F.interpolate(torch.randn(batch, 3, size // 8, size // 8, generator=g), size=(size, size), mode="bilinear", align_corners=False)
        + 0.1 * torch.randn(batch, 3, size, size, generator=g)
        for _ in range(batches)
    ]
    return out[0] if batches == 1 else out


@torch.no_grad()
def calibrate(model: nn.Module, batches: list[torch.Tensor] | torch.Tensor) -> nn.Module:
    """BatchNorm running statistics like a trained network's: cumulative averages over ``batches`` in train mode."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
    model.train()
    for batch in batches if isinstance(batches, list) else [batches]:
        model(batch)
    for norm in norms:
        norm.momentum = 0.1
    return model.eval()
