"""Models for the tensor-parallel tests, built by Ray's workers from the repository root
(`model.factory = "tests.tp_models:..."`)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections whose head count is read
    from the projection's (possibly split) output: (N, T, D) -> (N, T, D)."""

    def __init__(self, width: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = (
            p(x).view(n, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (N, H, T, hd)
        return self.out(y.transpose(1, 2).reshape(n, t, -1))


class TinyLM(nn.Module):
    """Tokens (N, T) -> logits (N, T, V): an embedding, one attention and an MLP."""

    def __init__(self, vocab: int = 128, width: int = 32, head_dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = Attention(width, head_dim)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        x = x + self.attn(x)
        return self.head(x + self.mlp(x))


def build_tiny_lm(width: int = 32) -> nn.Module:
    return TinyLM(width=width)
