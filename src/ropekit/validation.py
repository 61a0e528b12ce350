"""Argument checks shared by every layer. Each raises a ValueError naming the argument, the value and what was
expected; none ever asserts. Data-dependent checks (that read tensor values) are skipped while torch.compile
traces, so they never break the graph; eager calls always run them."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["check_base", "check_rotary_dim", "check_tables", "check_x", "is_compiling"]


def is_compiling() -> bool:
    """True while torch.compile / dynamo traces; value checks are skipped then."""
    return torch.compiler.is_compiling()


def check_base(base: Any) -> float:
    """base must be a finite real number > 1."""
    try:
        b = float(base)
    except (TypeError, ValueError):
        raise ValueError(f"base: expected a finite number > 1, got {base!r}") from None
    if not math.isfinite(b) or b <= 1.0:
        raise ValueError(f"base: expected a finite number > 1, got {base!r}")
    return b


def check_head_dim(head_dim: Any) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"head_dim: expected a positive integer, got {head_dim!r}")
    return head_dim


def check_rotary_dim(rotary_dim: Any, head_dim: int) -> int:
    """rotary_dim must be a positive even integer no larger than head_dim."""
    if (
        isinstance(rotary_dim, bool)
        or not isinstance(rotary_dim, int)
        or rotary_dim <= 0
        or rotary_dim % 2
        or rotary_dim > head_dim
    ):
        raise ValueError(
            f"rotary_dim: expected a positive even integer <= head_dim ({head_dim}), got {rotary_dim!r}"
        )
    return rotary_dim


def check_x(name: str, x: Any, *, varlen: bool) -> None:
    """x is (batch, seq, heads, head_dim), or (total_tokens, heads, head_dim) with cu_seqlens."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    want = 3 if varlen else 4
    if x.dim() != want:
        if varlen:
            expected = "(total_tokens, heads, head_dim) when cu_seqlens is given"
        elif x.dim() in (2, 3):
            expected = "(batch, seq, heads, head_dim); a packed 3-D input needs cu_seqlens"
        else:
            expected = "(batch, seq, heads, head_dim)"
        raise ValueError(f"{name}: expected a {want}-D tensor {expected}, got shape {tuple(x.shape)}")


def check_tables(cos: Any, sin: Any, head_dim: int) -> int:
    """cos, sin: same shape (table_len, rotary_dim // 2) with rotary_dim <= head_dim. Returns rotary_dim."""
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point torch.Tensor, got {t!r:.80}")
        if t.dim() != 2:
            raise ValueError(
                f"{name}: expected shape (table_len, rotary_dim // 2), got shape {tuple(t.shape)}"
            )
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin: expected the same shape, got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}"
        )
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(
            f"cos: table width {cos.shape[1]} means rotary_dim {rotary_dim}; expected 0 < rotary_dim <= "
            f"head_dim ({head_dim})"
        )
    if cos.device != sin.device:
        raise ValueError(f"cos and sin: expected one device, got {cos.device} and {sin.device}")
    return rotary_dim
