"""The two towers: pooled embeddings (+ dense features) -> MLP -> L2-normalized vector [B, D]."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Tower(nn.Module):
    """MLP over concatenated inputs: ``[B, in_dim] -> [B, out_dim]``, unit length rows."""

    def __init__(self, in_dim: int, hidden: Sequence[int], out_dim: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, out_dim))
        self.mlp = nn.Sequential(*layers)

    def forward(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.normalize(self.mlp(torch.cat(list(parts), dim=1)), dim=1)
