"""A multi-layer perceptron classifier over flat feature vectors."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    task = "classify"

    def __init__(self, in_features: int = 64, hidden: int = 128, layers: int = 2, num_classes: int = 10):
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        blocks.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.flatten(1))
