"""A decoder-only transformer language model, small enough to train on a laptop CPU.

Read top to bottom: config -> attention -> MLP -> block -> model. Each block can be wrapped in
activation checkpointing, which drops the block's intermediate activations after the forward pass
and recomputes them during backward: memory traded for compute, the first lever against HBM
pressure. On XLA the checkpoint must be torch_xla's own: it puts an optimisation barrier around
the saved inputs, without which XLA's common-subexpression elimination merges the recompute with
the original forward and silently keeps every activation alive again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from watchdog.core.errors import ConfigError

CHECKPOINTING = ("none", "full")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256  # bytes: the text option is character (byte) level
    depth: int = 2
    width: int = 64
    heads: int = 4
    seq_len: int = 64
    dropout: float = 0.0
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "depth", "width", "heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.width % self.heads:
            raise ConfigError("width", f"must be divisible by heads ({self.heads}), got {self.width}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("dropout", f"must be in [0, 1), got {self.dropout!r}")
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ConfigError("activation_checkpointing",
                              f"must be one of {', '.join(CHECKPOINTING)}, got {self.activation_checkpointing!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)
        # A buffer, not a per-call tensor: on XLA it is device data, not a new constant each step.
        mask = torch.tril(torch.ones(config.seq_len, config.seq_len, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, config.seq_len, config.seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # (batch, heads, time, head_width)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        scores = scores.masked_fill(~self.causal_mask[:, :, :time, :time], float("-inf"))
        attention = self.dropout(F.softmax(scores, dim=-1))
        y = (attention @ v).transpose(1, 2).reshape(batch, time, width)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.up = nn.Linear(config.width, 4 * config.width)
        self.down = nn.Linear(4 * config.width, config.width)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attention = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def checkpoint_function(device_type: str) -> Callable[..., torch.Tensor]:
    """The activation-checkpoint wrapper for a device type (see the module docstring for why)."""
    if device_type == "xla":
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

        return xla_checkpoint  # reentrant, with the optimisation barrier
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return lambda function, *args: torch_checkpoint(function, *args, use_reentrant=False)


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.width)
        self.position_embedding = nn.Embedding(config.seq_len, config.width)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.ln_final = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (batch, time) -> logits (batch, time, vocab), and the mean cross-entropy if targets."""
        time = tokens.size(1)
        positions = torch.arange(time, device=tokens.device)
        x = self.dropout(self.token_embedding(tokens) + self.position_embedding(positions))
        checkpoint = (checkpoint_function(tokens.device.type)
                      if self.config.activation_checkpointing == "full" and self.training else None)
        for block in self.blocks:
            x = checkpoint(block, x) if checkpoint is not None else block(x)
        logits = self.head(self.ln_final(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _init_weights(module: nn.Module) -> None:
    # GPT-2's initialisation: small normal weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
