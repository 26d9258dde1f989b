"""The tiny policy every part of ehp-fsm trains and serves on CPU.

A decoder-only transformer over a character vocabulary for small arithmetic prompts
("12+7=" → "19"). Training (Core and Hybrid replicas), the embedded rollout engine and the
tests all build it from the same frozen `PolicyConfig`, so a state dict saved by one loads into
the others by name. It knows nothing about GRPO, replicas or engines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+-*= "
VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *_CHARS)
_INDEX = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    """Token ids for `text` (no BOS/EOS). Raises ValueError naming the first unknown character."""
    try:
        return [_INDEX[c] for c in text]
    except KeyError as exc:
        raise ValueError(
            f"character {exc.args[0]!r} is not in the policy vocabulary {_CHARS!r}"
        ) from None


def decode(ids: list[int]) -> str:
    """Text for token ids, stopping at EOS and skipping PAD/BOS."""
    out = []
    for i in ids:
        if i == EOS:
            break
        if i > EOS:
            out.append(VOCAB[i])
    return "".join(out)


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    vocab_size: int = len(VOCAB)
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 128
    max_len: int = 32

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.vocab_size < len(VOCAB):
            raise ValueError(f"vocab_size={self.vocab_size} is smaller than the vocabulary")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class TinyPolicy(nn.Module):
    """Causal transformer LM: `forward(tokens[B, T]) -> logits[B, T, V]`. Dropout-free, so the
    same weights and inputs give the same outputs (needed for exact equivalence tests)."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_len, config.d_model)
        layer = nn.TransformerEncoderLayer(
            config.d_model,
            config.n_heads,
            config.d_ff,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.config.max_len}")
        pos = torch.arange(t, device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def build_policy(config: PolicyConfig, *, seed: int) -> TinyPolicy:
    """A freshly initialised policy; the same (config, seed) always gives the same weights."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return TinyPolicy(config)
    finally:
        torch.random.set_rng_state(gen_state)
