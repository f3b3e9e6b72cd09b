"""A small GPT (decoder-only transformer) and a synthetic next-token task it can learn."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.norm1 = nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.norm2 = nn.LayerNorm(config.dim)
        self.up = nn.Linear(config.dim, config.mlp_ratio * config.dim)
        self.down = nn.Linear(config.mlp_ratio * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm blocks, a final norm and an LM head."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.dim)
        self.positions = nn.Embedding(config.seq, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for module in self.blocks:  # GPT-2's scaled init of the residual projections
            block = cast(Block, module)
            nn.init.normal_(block.proj.weight, std=0.02 / math.sqrt(2 * config.layers))
            nn.init.normal_(block.down.weight, std=0.02 / math.sqrt(2 * config.layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on a batch of sequences."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def synthetic_batches(config: GPTConfig, batch: int, seed: int = 0, device: str | torch.device = "cpu") -> Iterator[torch.Tensor]:
    """Endless batches of sequences with learnable structure: each sequence walks through the
    vocabulary with its own stride (mod vocab), so the next token follows from the previous two."""
    generator = torch.Generator().manual_seed(seed)
    steps = torch.arange(config.seq)
    while True:
        start = torch.randint(0, config.vocab, (batch, 1), generator=generator)
        stride = torch.randint(1, 8, (batch, 1), generator=generator)
        yield ((start + stride * steps) % config.vocab).to(device)
