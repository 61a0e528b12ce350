"""QK-norm + RoPE cases shared by the backend tests and the Triton interpreter run.

The reference is the float64 composition: the RMSNorm of each form in float64 (no intermediate rounding),
then ``rotary_reference.reference_rotation`` (ropekit's float64 oracle). Tolerances follow the dtype: the
fused op rounds the weighted norm to the storage dtype (where the model does) and the rotation once, so it
may differ from the float64 truth by a few ulps of its dtype relative to the output's scale.
"""

from __future__ import annotations

import numpy as np
import torch

from ropekit.fused.qk_norm import qk_norm_rotary_
from rotary_reference import reference_rotation, reference_tables

# name -> (norm, weight_offset): Qwen3 (per head), Gemma 3 ((1 + w), per head), OLMo 2 (over all heads).
FORMS = {"qwen3": ("head", 0.0), "gemma3": ("head", 1.0), "olmo2": ("all_heads", 0.0)}
# layout -> how positions are given: an int offset on (B, S, W); per-sequence offsets; a packed (T, W) batch
# with cu_seqlens; explicit positions on (T, W).
LAYOUTS = ("offset", "offsets_per_seq", "cu_seqlens", "positions")
Q_HEADS, K_HEADS, HEAD_DIM, EPS = 4, 2, 16, 1e-6


def tolerance(dtype: torch.dtype, scale: float) -> dict[str, float]:
    """A few ulps of dtype relative to the output, and of its scale (cancellation in the rotation)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * eps, "atol": 8 * eps * max(scale, 1.0)}


def make_case(
    dtype, form, layout, *, rotary_dim=None, head_dim=HEAD_DIM, q_heads=Q_HEADS, k_heads=K_HEADS, seed=0
):
    """(qkv, q_weight, k_weight, cos, sin, kwargs, positions as a NumPy array of qkv's leading shape)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    gen = torch.Generator().manual_seed(seed)
    norm, weight_offset = FORMS[form]
    width = (q_heads + 2 * k_heads) * head_dim
    lead = (2, 3) if layout in ("offset", "offsets_per_seq") else (5,)
    qkv = (torch.randn(*lead, width, generator=gen) * 3).to(dtype)
    features = (q_heads * head_dim, k_heads * head_dim) if norm == "all_heads" else (head_dim, head_dim)
    q_weight = (1 + 0.5 * torch.randn(features[0], generator=gen)).to(dtype)
    k_weight = (1 + 0.5 * torch.randn(features[1], generator=gen)).to(dtype)
    cos, sin = reference_tables(rotary_dim, 16)
    kw = dict(num_q_heads=q_heads, num_kv_heads=k_heads, head_dim=head_dim, eps=EPS, norm=norm)
    kw["weight_offset"] = weight_offset
    if layout == "offset":
        kw["offsets"] = 4
        positions = np.broadcast_to(4 + np.arange(3), (2, 3))
    elif layout == "offsets_per_seq":
        kw["offsets"] = torch.tensor([0, 7])
        positions = np.array([[0, 1, 2], [7, 8, 9]])
    elif layout == "cu_seqlens":
        kw["cu_seqlens"] = torch.tensor([0, 2, 5], dtype=torch.int32)
        positions = np.array([0, 1, 0, 1, 2])
    else:
        kw["positions"] = torch.tensor([3, 0, 15, 9, 9])
        positions = kw["positions"].numpy()
    return qkv, q_weight, k_weight, cos, sin, kw, positions


def reference(qkv, q_weight, k_weight, cos, sin, kw, positions, *, interleaved=False) -> torch.Tensor:
    """The float64 composition: RMSNorm of q and k, then the reference rotation; v copied."""
    q_heads, k_heads, head_dim = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
    x = qkv.double()
    out = x.clone()
    start = 0
    for heads, weight in ((q_heads, q_weight), (k_heads, k_weight)):
        part = x[..., start : start + heads * head_dim]
        groups = part if kw["norm"] == "all_heads" else part.unflatten(-1, (heads, head_dim))
        normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + kw["eps"])
        normed = (normed * (weight.double() + kw["weight_offset"])).reshape(*part.shape[:-1], heads, head_dim)
        rotated = reference_rotation(normed, cos, sin, positions, interleaved=interleaved)
        out[..., start : start + heads * head_dim] = rotated.flatten(-2)
        start += heads * head_dim
    return out


def check_matches_reference(
    backend, dtype, form, layout, *, interleaved=False, rotary_dim=None, head_dim=HEAD_DIM
):
    """The backend's in-place result equals the float64 composition to dtype's tolerance; v is untouched."""
    qkv, q_weight, k_weight, cos, sin, kw, positions = make_case(
        dtype, form, layout, rotary_dim=rotary_dim, head_dim=head_dim
    )
    want = reference(qkv, q_weight, k_weight, cos, sin, kw, positions, interleaved=interleaved)
    before = qkv.clone()
    version = qkv._version
    out = qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, interleaved=interleaved, backend=backend, **kw)
    assert out is qkv and qkv._version > version
    v_start = (Q_HEADS + K_HEADS) * head_dim
    assert torch.equal(qkv[..., v_start:], before[..., v_start:])
    torch.testing.assert_close(qkv.double(), want, **tolerance(dtype, float(want.abs().max())))


def check_bad_row_writes_nothing(backend) -> None:
    """A position past the table is a ValueError naming positions, raised before anything is written."""
    import pytest

    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(torch.float32, "qwen3", "positions")
    kw["positions"] = torch.tensor([0, 1, 2, 3, 16])
    before = qkv.clone()
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rotary_(qkv, q_weight, k_weight, cos, sin, backend=backend, **kw)
    assert torch.equal(qkv, before)


def unfused(qkv, q_weight, k_weight, cos, sin, kw, *, interleaved=False) -> torch.Tensor:
    """What a model runs today, out of place: transformers' RMSNorm of each form, then apply_rotary."""
    from ropekit import apply_rotary

    q_heads, k_heads, head_dim = kw["num_q_heads"], kw["num_kv_heads"], kw["head_dim"]
    pieces, start = [], 0
    for heads, weight in ((q_heads, q_weight), (k_heads, k_weight)):
        part = qkv[..., start : start + heads * head_dim]
        groups = part if kw["norm"] == "all_heads" else part.unflatten(-1, (heads, head_dim))
        x32 = groups.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + kw["eps"])
        if kw["norm"] == "head" and kw["weight_offset"] == 0:  # Qwen3RMSNorm
            normed = weight * normed.to(qkv.dtype)
        else:  # Gemma3RMSNorm, Olmo2RMSNorm
            normed = (normed * (weight.float() + kw["weight_offset"])).to(qkv.dtype)
        heads_view = normed.reshape(*part.shape[:-1], heads, head_dim)
        if "cu_seqlens" not in kw and qkv.dim() == 2:
            heads_view = heads_view.unsqueeze(0)
        pos_kw = {name: kw[name] for name in ("positions", "offsets", "cu_seqlens") if name in kw}
        if "positions" in pos_kw and qkv.dim() == 2 and "cu_seqlens" not in kw:
            pos_kw["positions"] = pos_kw["positions"].unsqueeze(0)
        rotated = apply_rotary(heads_view, cos, sin, interleaved=interleaved, **pos_kw)
        pieces.append(rotated.reshape(part.shape))
        start += heads * head_dim
    pieces.append(qkv[..., start:])
    return torch.cat(pieces, dim=-1)


def check_gradients_match_unfused(backend, dtype, form, layout="offsets_per_seq") -> None:
    """Gradients for qkv, q_weight and k_weight equal those of the unfused torch composition to rounding."""
    qkv, q_weight, k_weight, cos, sin, kw, _ = make_case(dtype, form, layout)
    grad = torch.randn(qkv.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    leaves = []
    for run in ("fused", "unfused"):
        x = qkv.clone().requires_grad_(True)
        wq, wk = q_weight.clone().requires_grad_(True), k_weight.clone().requires_grad_(True)
        if run == "fused":
            out = qk_norm_rotary_(x.clone(), wq, wk, cos, sin, backend=backend, **kw)
        else:
            out = unfused(x, wq, wk, cos, sin, kw)
        out.backward(grad)
        leaves.append((out.detach(), x.grad, wq.grad, wk.grad))
    for got, want in zip(leaves[0], leaves[1], strict=True):
        torch.testing.assert_close(got.double(), want.double(), **tolerance(dtype, float(want.abs().max())))
