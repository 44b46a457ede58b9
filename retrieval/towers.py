"""The two towers: pooled embeddings (+ dense features) -> MLP -> L2-normalized vector [B, D]."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

NORM_EPS = 1e-12
"""``F.normalize``'s default: a zero row stays zero."""


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
        x = torch.cat(list(parts), dim=1)
        # the layers as functions, and the norm without F.normalize's Python wrappers: the same
        # ops and bits without a module call's overhead per layer, which a served batch of one
        # row would pay more for than for its arithmetic
        for layer in self.mlp:
            x = F.linear(x, layer.weight, layer.bias) if isinstance(layer, nn.Linear) else F.relu(x)
        return x / torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(NORM_EPS)


class HistoryAttention(nn.Module):
    """Self-attention over a user's newest ``L`` history items, with positions, pooled by the
    user's own query: ``seq [B, L, E]`` item embeddings (newest first), ``valid [B, L] bool``,
    ``context [B, E]`` (the mean-pooled history) -> ``[B, E]``.

    One encoder layer lets the items see each other (what follows what), then an attention pool
    whose query comes from the context weighs them for this user. A learned "no item" token is
    always present, so a user with no history (every slot padded) gets a defined output.
    """

    def __init__(self, dim: int, length: int, heads: int = 2):
        super().__init__()
        self.position = nn.Parameter(torch.randn(length + 1, dim) * 0.02)  # slot 0: no item
        self.empty = nn.Parameter(torch.zeros(1, 1, dim))
        self.encoder = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True
        )
        self.query = nn.Linear(dim, dim)
        self.pool = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(
        self, seq: torch.Tensor, valid: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        b, length, dim = seq.shape
        x = torch.cat([self.empty.expand(b, 1, dim), seq], dim=1) + self.position[: length + 1]
        pad = torch.cat([valid.new_zeros(b, 1), ~valid], dim=1)  # [B, L + 1], True: ignore
        x = self.encoder(x, src_key_padding_mask=pad)
        out, _ = self.pool(self.query(context).unsqueeze(1), x, x, key_padding_mask=pad)
        return out[:, 0]  # [B, E]
