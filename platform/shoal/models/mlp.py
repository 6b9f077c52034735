"""A multi-layer perceptron classifier over flat feature vectors."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    task = "classify"
    arg_limits = {  # checked before launch (models/registry.py): beyond these, a typo
        "in_features": (1, 1 << 24),
        "hidden": (1, 1 << 16),
        "layers": (0, 256),
        "num_classes": (1, 1 << 20),
    }

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
