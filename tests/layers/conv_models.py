"""Convolutional networks at their real layouts and sizes, hand-written (torchvision and timm do not import beside
the CPU torch this project tests with): torchvision's resnet18, timm's EfficientNet-B0 blocks in miniature."""

from __future__ import annotations

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
