"""A LLaMA-style attention block: GQA, RoPE through ropekit, scaled_dot_product_attention, a KV cache.

Shape notation: B batch, S new tokens, S_kv keys attended to (S without a cache, the cache's max_len with
one), H query heads, Hk key/value heads, D head_dim = dim // H.

The block keeps no state derived from its rotary embedding, so ``block.rope`` may be replaced at any time (for
example to evaluate a trained model under another scaling schedule).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ropekit.module import RotaryEmbedding
from ropekit.nn.kv_cache import KVCache
from ropekit.validation import check_int

__all__ = ["Attention"]


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads and rotary position embeddings.

    Args:
        dim: model width; must be divisible by n_heads.
        n_heads: H, query heads.
        n_kv_heads: Hk, key/value heads (GQA); H must be a multiple. None means H (plain multi-head).
        rope: a :class:`ropekit.RotaryEmbedding` with layout "bshd" or "bhsd", or None for no rotary
            (NoPE, or absolute encodings added to the input).
        bias: add biases to the q/k/v/o projections (Qwen2 style).
        causal: mask future tokens.

    Attributes:
        wq (dim -> H*D), wk, wv (dim -> Hk*D), wo (H*D -> dim): the projections, named as in Meta's LLaMA.

    Raises:
        ValueError: for sizes that do not divide, or a rope that is not a RotaryEmbedding.

    Example:
        >>> block = Attention(64, 8, 2, RotaryEmbedding(head_dim=8, max_position_embeddings=256))
        >>> y = block(torch.randn(2, 16, 64))
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        rope: RotaryEmbedding | None = None,
        *,
        bias: bool = False,
        causal: bool = True,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        for name, value in (("dim", dim), ("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
            check_int(name, value)
        if dim % n_heads:
            raise ValueError(f"dim: expected a multiple of n_heads ({n_heads}), got {dim}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads ({n_heads}), got {n_kv_heads}")
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise ValueError(f"rope: expected a ropekit.RotaryEmbedding or None, got {type(rope).__name__}")
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.causal = causal
        self.rope = rope
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)

    def new_kv_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None
    ) -> KVCache:
        """An empty :class:`KVCache` sized for this block (dtype and device default to the weights')."""
        w = self.wk.weight
        return KVCache(
            batch_size, max_len, self.n_kv_heads, self.head_dim,
            dtype=w.dtype if dtype is None else dtype, device=w.device if device is None else device,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        offsets: int | torch.Tensor = 0,
        attn_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend over x (and over the cache, when one is given).

        Args:
            x: (B, S, dim).
            positions: (B, S) integer rotary positions, or None for ``offsets + arange(S)``. With a kv_cache
                and no positions, they continue from the cache: ``kv_cache.lengths + offsets + arange(S)``.
            offsets: int or (B,) integer tensor, as in :func:`ropekit.apply_rotary`.
            attn_mask: (B, S_kv) bool key-padding mask, True for real tokens, or None. With a kv_cache it
                covers all max_len cache slots; slots not yet written are masked out regardless.
            kv_cache: a :class:`KVCache` that the new keys and values are appended to, or None.
            need_weights: also return the attention probabilities (explicit softmax instead of SDPA).

        Returns:
            y (B, S, dim); or (y, probs (B, H, S, S_kv)) when need_weights is True.

        Raises:
            ValueError: for an input of the wrong width, a mask of the wrong shape or dtype, or a rope whose
                layout is "thd".
        """
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x: expected shape (batch, seq, {self.dim}), got {tuple(x.shape)}")
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)  # (B, S, H, D)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)  # (B, S, Hk, D)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)  # (B, S, Hk, D)

        if self.rope is not None:
            if positions is None and kv_cache is not None:
                offsets = kv_cache.lengths + offsets
            q, k = self._rotate(q, k, positions, offsets)

        if kv_cache is not None:
            start = kv_cache.update(k, v)
            k, v = kv_cache.k, kv_cache.v  # (B, L, Hk, D)
        else:
            start = None
        mask = self._mask(batch, seq, k.shape[1], start, attn_mask, x.device)  # (B, 1, S, S_kv) or None

        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S or S_kv, D)
        if need_weights:
            out, probs = self._explicit_attention(q, k, v, mask, causal_square=mask is None and self.causal)
        else:
            out = F.scaled_dot_product_attention(
                q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                is_causal=mask is None and self.causal, enable_gqa=self.n_kv_heads != self.n_heads,
            )  # fmt: skip
        y = self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))  # (B, S, dim)
        return (y, probs) if need_weights else y

    def _rotate(self, q, k, positions, offsets):
        layout = self.rope.layout
        if layout == "bshd":
            return self.rope(q, k, positions=positions, offsets=offsets)
        if layout == "bhsd":
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), positions=positions, offsets=offsets)
            return q.transpose(1, 2), k.transpose(1, 2)  # back to (B, S, heads, D)
        raise ValueError(f"rope: expected a RotaryEmbedding with layout 'bshd' or 'bhsd', got {layout!r}")

    def _mask(self, batch, seq, kv_len, start, attn_mask, device):
        """Bool (B, 1, S, S_kv) mask, True where a query may attend; None when SDPA's is_causal suffices."""
        if attn_mask is not None:
            if not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype != torch.bool:
                raise ValueError(f"attn_mask: expected a bool tensor or None, got {attn_mask!r:.80}")
            if tuple(attn_mask.shape) != (batch, kv_len):
                raise ValueError(
                    f"attn_mask: expected shape (batch, keys) = {(batch, kv_len)}, "
                    f"got {tuple(attn_mask.shape)}"
                )
        if start is None and attn_mask is None:
            return None
        if start is None:
            start = torch.zeros(batch, dtype=torch.int64, device=device)
        query_slot = start[:, None] + torch.arange(seq, device=device)  # (B, S)
        key_slot = torch.arange(kv_len, device=device)  # (S_kv,)
        if self.causal:
            allowed = key_slot[None, None, :] <= query_slot[:, :, None]  # (B, S, S_kv)
        else:
            allowed = (key_slot[None, None, :] < (start + seq)[:, None, None]).expand(batch, seq, kv_len)
        if attn_mask is not None:
            allowed = allowed & attn_mask[:, None, :].to(device)
        # A padding query may have no real key to look at; letting every query see its own slot keeps softmax
        # finite (no NaN) and changes nothing for real tokens, which always see themselves.
        allowed = allowed | (key_slot[None, None, :] == query_slot[:, :, None])
        return allowed[:, None]  # (B, 1, S, S_kv)

    def _explicit_attention(self, q, k, v, mask, *, causal_square):
        """softmax(q k^T / sqrt(D)) v and the probabilities. q (B, H, S, D); k, v (B, Hk, S_kv, D)."""
        group = self.n_heads // self.n_kv_heads
        k = k.to(q.dtype).repeat_interleave(group, dim=1)  # (B, H, S_kv, D)
        v = v.to(q.dtype).repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)  # (B, H, S, S_kv)
        if causal_square:
            seq = q.shape[2]
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()  # (S, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = scores.softmax(dim=-1)
        return probs @ v, probs
