"""A regression model with its own loss, trained by shoal on dict batches.

The model takes the batch's columns by name (`features`, `price`: workload.yaml's
`data.columns` maps the parquet columns to these arguments) and returns a dict:
`loss` is what shoal trains on, every other scalar (`mae`) is logged beside it.
"""

from __future__ import annotations

import torch
from torch import nn


class PriceRegressor(nn.Module):
    def __init__(self, in_features: int = 8, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor, price: torch.Tensor) -> dict[str, torch.Tensor]:
        predicted = self.net(features.float()).squeeze(-1)
        error = predicted - price.float()
        return {"loss": error.pow(2).mean(), "mae": error.abs().mean()}
