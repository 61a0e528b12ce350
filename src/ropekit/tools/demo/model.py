"""The demo's model: a small byte-level, decoder-only transformer assembled from ropekit's pieces.

Shape notation: B batch, S sequence, V = 256 byte values, C model width.

The three variants differ only in where position enters: ``nope`` nowhere (the causal mask is the only
order signal), ``sinusoidal`` as :class:`ropekit.SinusoidalPositionalEmbedding` added to the byte
embeddings (at their initial size), ``rope`` as one :class:`ropekit.RotaryEmbedding` shared by every
attention block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ropekit.config import RopeConfig
from ropekit.module import RotaryEmbedding
from ropekit.nn.attention import Attention
from ropekit.sinusoidal import SinusoidalPositionalEmbedding
from ropekit.validation import check_int

__all__ = ["VARIANTS", "ByteTransformer", "ModelConfig"]

VARIANTS = ("nope", "sinusoidal", "rope")
VOCAB = 256  # bytes: no tokenizer, nothing to download
INIT_STD = 0.02  # GPT-2's: small normal weights keep the residual stream's scale steady at the start


@dataclass(frozen=True)
class ModelConfig:
    variant: str = "rope"
    dim: int = 128  # wide enough to learn Python's byte statistics in minutes on a CPU
    n_layers: int = 4  # >= 2 so induction-style copying (which needs position) can form
    n_heads: int = 4  # head_dim 32: 16 rotary pairs, enough for a visible spread of wavelengths
    mlp_ratio: int = 4
    rope_base: float = 10000.0  # the base of RoFormer (Su et al. 2021) and of Vaswani et al.'s sinusoids
    # Keys also see the previous byte (PrevTokenKeys), so one attention layer can find "the byte after the
    # earlier STX" and retrieval is learnt within the demo's budget; without them the two-layer induction
    # circuit had not formed after 400 steps (docs/demo.md). Every variant gets them: they tell a key its
    # predecessor, not its position.
    prev_token_keys: bool = True

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {self.variant!r}")
        for name in ("dim", "n_layers", "n_heads", "mlp_ratio"):
            check_int(name, getattr(self, name))
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim: expected a multiple of 2 * n_heads ({2 * self.n_heads}), got {self.dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class PrevTokenKeys(nn.Module):
    """Key projection that also sees the previous position: k_i = W_k x_i + W_p x_{i-1}.

    Replaces an :class:`~ropekit.nn.attention.Attention` block's ``wk`` (called on the whole (B, S, C)
    sequence), so the rotary embedding is applied to these keys as usual. One attention layer can then match
    "the byte after an earlier STX" (an induction head in one layer, as smeared keys do in Olsson et al.
    2022). Not for cached decoding, which calls wk one token at a time.
    """

    def __init__(self, wk: nn.Linear) -> None:
        super().__init__()
        self.current = wk
        self.previous = nn.Linear(wk.in_features, wk.out_features, bias=False)
        nn.init.normal_(self.previous.weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before = F.pad(x, (0, 0, 1, 0))[:, :-1]  # (B, S, C): x_{i-1}, zeros at i = 0
        return self.current(x) + self.previous(before)


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.dim)
        self.attn = Attention(config.dim, config.n_heads, rope=rope)
        self.mlp_norm = nn.LayerNorm(config.dim)
        hidden = config.mlp_ratio * config.dim
        self.mlp = nn.Sequential(nn.Linear(config.dim, hidden), nn.GELU(), nn.Linear(hidden, config.dim))

    def forward(self, x: torch.Tensor, need_weights: bool = False):
        out = self.attn(self.attn_norm(x), need_weights=need_weights)
        attn, probs = out if need_weights else (out, None)
        x = x + attn
        x = x + self.mlp(self.mlp_norm(x))
        return (x, probs) if need_weights else x


class ByteTransformer(nn.Module):
    """Decoder-only language model over bytes.

    Args:
        config: a :class:`ModelConfig`.

    Example:
        >>> model = ByteTransformer(ModelConfig(variant="rope", dim=64, n_layers=2, n_heads=2))
        >>> logits = model(torch.randint(0, 256, (2, 32)))  # (2, 32, 256)
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.embed_scale = math.sqrt(config.dim)
        self.sinusoidal = (
            SinusoidalPositionalEmbedding(config.dim) if config.variant == "sinusoidal" else None
        )
        # The encoding enters at the scaled embeddings' initial size: INIT_STD * sqrt(C) per entry, where the
        # sinusoids' own is 1/sqrt(2). At full size it outweighed the embeddings 3 to 1, and the model never
        # learnt to retrieve a key (0% in every seed); at this size, or in channels of its own, it did
        # (docs/demo.md, "The sinusoidal model").
        self.position_scale = INIT_STD * self.embed_scale * math.sqrt(2.0)
        rope = None
        if config.variant == "rope":
            rope = RotaryEmbedding(RopeConfig(config.head_dim, config.rope_base))
        self.blocks = nn.ModuleList(Block(config, rope) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: fewer parameters to learn in a short run
        self.apply(_init_weights)
        if config.prev_token_keys:
            for block in self.blocks:
                block.attn.wk = PrevTokenKeys(block.attn.wk)

    @property
    def rope(self) -> RotaryEmbedding | None:
        """The rotary embedding every block shares (None for nope / sinusoidal)."""
        return self.blocks[0].attn.rope

    def set_rope(self, rope_config: RopeConfig) -> None:
        """Swap in a rotary embedding built from ``rope_config`` (inference-time scaling); weights stay.

        Length-dependent schedules (dynamic NTK) need nothing more: RotaryEmbedding computes their frequencies
        per call for seq_len = (largest position) + 1, as Hugging Face does.

        Raises:
            ValueError: when the model is not the rope variant, or the config's head_dim differs.
        """
        if self.config.variant != "rope":
            raise ValueError(
                f"rope_config: only the rope variant has a rotary embedding, this is {self.config.variant!r}"
            )
        if rope_config.head_dim != self.config.head_dim:
            raise ValueError(
                f"rope_config: expected head_dim {self.config.head_dim}, got {rope_config.head_dim}"
            )
        rope = RotaryEmbedding(rope_config).to(self.embed.weight.device)
        for block in self.blocks:
            block.attn.rope = rope

    def forward(self, tokens: torch.Tensor, need_weights: bool = False):
        """Next-byte logits.

        Args:
            tokens: (B, S) int64 byte values.
            need_weights: also return every block's attention probabilities.

        Returns:
            logits (B, S, V); with need_weights, (logits, [probs (B, H, S, S)] * n_layers).
        """
        # Vaswani et al. scale embeddings by sqrt(C) before adding the encoding. Applied to every variant so
        # they differ only in position.
        x = self.embed(tokens) * self.embed_scale  # (B, S, C)
        if self.sinusoidal is not None:
            x = x + self.position_scale * self.sinusoidal(torch.zeros_like(x))  # (B, S, C): + scaled PE(m)
        maps = []
        for block in self.blocks:
            if need_weights:
                x, probs = block(x, need_weights=True)
                maps.append(probs)
            else:
                x = block(x)
        logits = self.head(self.norm(x))  # (B, S, V)
        return (logits, maps) if need_weights else logits

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy (nats) of a (B, S + 1) batch of inputs-plus-targets."""
        logits = self(batch[:, :-1])  # (B, S, V)
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
