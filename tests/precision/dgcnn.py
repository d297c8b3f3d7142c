"""A DGCNN-style point-cloud classifier (Wang et al. 2019, written small): every EdgeConv builds its kNN graph with a
``topk`` of the pairwise distances of its input features, so a quantized model whose features move a little picks
other neighbours (near-equal distances) from the first layer on, as a healthy one does."""

from __future__ import annotations

import torch
from torch import nn


def knn(x: torch.Tensor, k: int) -> torch.Tensor:
    inner = -2 * x.transpose(2, 1) @ x
    square = (x**2).sum(1, keepdim=True)
    return (-square - inner - square.transpose(2, 1)).topk(k, dim=-1)[1]  # B, N, k: the nearest, the point itself first


def edge_features(x: torch.Tensor, k: int) -> torch.Tensor:
    b, c, n = x.shape
    idx = (knn(x, k) + torch.arange(b, device=x.device).view(-1, 1, 1) * n).view(-1)
    points = x.transpose(2, 1).reshape(b * n, c)
    neighbours = points[idx].view(b, n, k, c)
    centre = x.transpose(2, 1).view(b, n, 1, c).expand(-1, -1, k, -1)
    return torch.cat([neighbours - centre, centre], 3).permute(0, 3, 1, 2)  # B, 2C, N, k


class EdgeConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv = nn.Sequential(nn.Conv2d(2 * cin, cout, 1, bias=False), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(edge_features(x, self.k)).max(-1)[0]  # a max pool over the neighbours (indices unused)


class DGCNN(nn.Module):
    def __init__(self, classes: int = 10, k: int = 8, width: int = 32) -> None:
        super().__init__()
        self.edges = nn.ModuleList([EdgeConv(3, width, k), *(EdgeConv(width, width, k) for _ in range(3))])
        self.fuse = nn.Sequential(nn.Conv1d(4 * width, 4 * width, 1, bias=False), nn.BatchNorm1d(4 * width), nn.LeakyReLU(0.2))
        self.head = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = []
        for edge in self.edges:
            x = edge(x)
            features.append(x)
        return self.head(self.fuse(torch.cat(features, 1)).max(-1)[0])


def clouds(batch: int, seed: int, points: int = 256) -> torch.Tensor:
    """Points on the surfaces of random ellipsoids, a little noise: clouds with structure, as a scanner gives."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, points, generator=g)
    x = x / x.norm(dim=1, keepdim=True) * (0.5 + torch.rand(batch, 3, 1, generator=g))
    return x + 0.01 * torch.randn(batch, 3, points, generator=g)


def dgcnn(seed: int = 0) -> DGCNN:
    """A DGCNN with BatchNorm statistics calibrated on clouds (cumulative averages over 4 batches, as a trained net's)."""
    torch.manual_seed(seed)
    model = DGCNN()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.momentum = None
    model.train()
    with torch.no_grad():
        for i in range(4):
            model(clouds(8, 100 + i))
    return model.eval()
