"""QK-RMSNorm + RoPE in plain PyTorch: the torch backend's launch and the readable reference of the kernels.

The three norm forms (Qwen3, Gemma 3, OLMo 2) are described once, in :mod:`ropekit.fused.qk_norm`; a
:class:`~ropekit.backends.c.qk_norm.NormSpec` names the form. The C loop and the Triton kernel are tested
against :func:`rms_norm` followed by the torch backend's rotation.
"""

from __future__ import annotations

import torch

from ropekit.backends.c.qk_norm import NormSpec
from ropekit.backends.eager.rotary import rotate, table_rows

__all__ = ["heads", "launch", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, spec: NormSpec) -> torch.Tensor:
    """The readable RMSNorm of q or k (..., H, D) in the form ``spec`` names; returns x's shape and dtype.

    The torch path of :func:`ropekit.qk_norm_rotary_` and the reference its kernels are tested against.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    groups = x.flatten(-2) if spec.all_heads else x  # (..., H * D) for OLMo 2, else (..., H, D)
    x32 = groups.to(compute)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + spec.eps)
    w = weight.to(compute) + spec.weight_offset
    if spec.cast_before_weight:
        normed = normed.to(x.dtype).to(compute)
    return (normed * w).to(x.dtype).view(x.shape)


def heads(qkv: torch.Tensor, spec: NormSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of qkv (..., W) as views (..., Hq, D) and (..., Hk, D)."""
    q_width, k_width = spec.q_heads * spec.head_dim, spec.k_heads * spec.head_dim
    q = qkv[..., :q_width].unflatten(-1, (spec.q_heads, spec.head_dim))
    k = qkv[..., q_width : q_width + k_width].unflatten(-1, (spec.k_heads, spec.head_dim))
    return q, k


def launch(qkv, q_weight, k_weight, cos, sin, positions, offset, spec: NormSpec) -> None:
    """RMSNorm, then the torch backend's rotation, written back into qkv (B, S, W); arguments as
    :func:`ropekit.backends.c.qk_norm.launch` takes them (weights and tables in any float dtype)."""
    batch, seq, _ = qkv.shape
    rows = table_rows(None if positions is None else positions.view(batch, seq), offset, qkv, cos.shape[0])
    for x, weight in zip(heads(qkv, spec), (q_weight, k_weight), strict=True):
        normed = rms_norm(x, weight, spec)
        x.copy_(rotate(normed, cos, sin, rows, interleaved=spec.interleaved, conjugate=False, inplace=True))
