"""KVCache: preallocated key/value buffers with one fill length per batch row.

Shape notation: B batch, L capacity (max cached tokens), S new tokens, Hk key/value heads, D head_dim.

Keys are cached *after* rotation, each at the position it was written with. That is why a length-dependent
schedule (dynamic NTK, LongRoPE) must keep its frequencies fixed for a whole generation: keys already in the
cache were rotated under the old frequencies and are never re-rotated.
"""

from __future__ import annotations

import torch

from ropekit.validation import check_int, is_compiling

__all__ = ["KVCache"]


class KVCache:
    """Key/value buffers for incremental decoding.

    Row b's next tokens are written at slots ``lengths[b], lengths[b] + 1, ...``; a left-padded batch keeps
    every row's lengths equal and marks padding slots with the attention block's ``attn_mask``.

    Args:
        batch_size: B.
        max_len: L, the number of slots per row.
        n_kv_heads: Hk.
        head_dim: D.
        dtype: buffer dtype (the model's compute dtype).
        device: buffer device.

    Attributes:
        k, v: (B, L, Hk, D) buffers.
        lengths: (B,) int64, slots filled so far in each row.

    Raises:
        ValueError: for a non-positive size.
    """

    def __init__(
        self,
        batch_size: int,
        max_len: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        for name, value in (
            ("batch_size", batch_size),
            ("max_len", max_len),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
        ):
            check_int(name, value)
        shape = (batch_size, max_len, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        """Forget every cached token (the buffers are reused)."""
        self.lengths.zero_()

    def update(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write S new keys and values at each row's fill length and advance the lengths.

        Args:
            k, v: (B, S, Hk, D), already rotated.

        Returns:
            (B,) int64: the slot each row's first new token went to (the lengths before the write).

        Raises:
            ValueError: when k or v do not fit the buffers, or a row would overflow max_len.
        """
        if (
            k.shape != v.shape
            or k.dim() != 4
            or k.shape[0] != self.k.shape[0]
            or k.shape[2:] != self.k.shape[2:]
        ):
            raise ValueError(
                f"k, v: expected (batch, new_tokens, n_kv_heads, head_dim) matching the cache "
                f"{tuple(self.k.shape)}, got k {tuple(k.shape)} and v {tuple(v.shape)}"
            )
        new = k.shape[1]
        if not is_compiling():
            longest = int(self.lengths.max())
            if longest + new > self.max_len:
                raise ValueError(
                    f"kv_cache: writing {new} tokens after {longest} overflows max_len {self.max_len}; "
                    "allocate a larger cache"
                )
        start = self.lengths.clone()
        slots = start[:, None] + torch.arange(new, device=k.device)  # (B, S)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        self.k[rows, slots] = k.to(self.k.dtype)
        self.v[rows, slots] = v.to(self.v.dtype)
        self.lengths += new
        return start
