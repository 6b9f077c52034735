"""A small convolutional classifier for square single-channel images (digits: 8x8)."""

from __future__ import annotations

import torch
from torch import nn


class ConvNet(nn.Module):
    task = "classify"
    arg_limits = {  # checked before launch (models/registry.py): beyond these, a typo
        "channels": (1, 4096),
        "image_size": (2, 4096),
        "in_channels": (1, 4096),
        "num_classes": (1, 1 << 20),
        "dropout": (0, 1),
    }

    def __init__(
        self,
        channels: int = 32,
        image_size: int = 8,
        in_channels: int = 1,
        num_classes: int = 10,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.in_channels, self.image_size = in_channels, image_size
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        pooled = image_size // 2
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(2 * channels * pooled * pooled, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.in_channels, self.image_size, self.image_size)
        return self.head(self.features(x))
