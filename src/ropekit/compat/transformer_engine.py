"""TransformerEngine's rotary calls on the core: angles in, rotated tensors out, sbhd / bshd / thd layouts.

Migration: ``from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb`` (and
``apply_fused_qkv_rotary_pos_emb``) becomes ``from ropekit.compat.transformer_engine import ...``; the calls
stay as they are.

Shape notation: s sequence, b batch, h heads, d head_dim, t packed tokens, d2 the rotated width (<= d), s2 the
rows of freqs.

The convention (TransformerEngine 2.x, ``transformer_engine/pytorch/attention/rope.py``):
    freqs: float angles of shape (s2, 1, 1, d2), as TE's ``RotaryPositionEmbedding`` returns them: row p holds
        position p's angles, each pair's angle written for both its features (``cat(f, f)``, or each angle
        twice in a row when interleaved). The rotation is ``t * cos(freqs) + rotate_half(t) * sin(freqs)`` on
        the first d2 features; the rest pass through. Pairs must share their angle (TE's module always builds
        them so); it is checked for CPU tensors.
    tensor_format: "sbhd" (s, b, h, d), "bshd" (b, s, h, d), or "thd" (t, h, d) with cu_seqlens (b + 1,): each
        packed sequence starts at position 0.
    start_positions: (b,) integers; sequence i starts at position start_positions[i] (inference with a cache).
    interleaved: False pairs (i, i + d2/2) (GPT-NeoX / Megatron default), True pairs (2i, 2i+1) (GPT-J).
    cp_size, cp_rank: context parallelism with TE's load-balanced split: each rank holds two chunks of every
        sequence, chunk cp_rank and chunk 2 cp_size - 1 - cp_rank of 2 cp_size (for thd, cu_seqlens are the
        global padded lengths, and each holds its 1 / cp_size share).
    fused: accepted and ignored (ropekit has one implementation per backend).

Both functions return new tensors and leave their inputs unchanged; they are differentiable with respect to t
(qkv). cos and sin are taken in the angles' own dtype (float64 angles stay float64), as TE takes them.
Differences: math runs in float32 (float64 for float64 t), with cos and sin rounded to it once (TE's unfused
path rounds them to t's dtype); start_positions together with cp_size > 1 is a ValueError (TE asserts);
apply_fused_qkv_rotary_pos_emb takes any layout of qkv (TE requires contiguous).
"""

from __future__ import annotations

import itertools

import torch

from ropekit.compat._common import peer_names
from ropekit.functional import apply_rotary
from ropekit.validation import check_bool, check_int, describe

__all__ = ["apply_fused_qkv_rotary_pos_emb", "apply_rotary_pos_emb"]

_FORMATS = ("sbhd", "bshd", "thd")
_NAMES = {"x": "t", "offsets": "start_positions", "positions": "freqs", "cos": "freqs"}


def _tables(
    name: str, freqs: object, interleaved: bool, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables (s2, d2 / 2) in compute's dtype from TE's angles (s2, 1, 1, d2), one angle per pair.

    As TE (and compat.megatron): cos and sin are taken in the angles' own dtype (float32 at least), then
    cast. Float64 angles rounded to float32 first lose ~0.03 rad at position 1e6 (and 2e-5 at 1000, for
    float64 t)."""
    if (
        not isinstance(freqs, torch.Tensor)
        or not freqs.is_floating_point()
        or freqs.dim() != 4
        or freqs.shape[1] != 1
        or freqs.shape[2] != 1
        or freqs.shape[3] % 2
        or freqs.shape[3] == 0
    ):
        raise ValueError(
            f"{name}: expected float angles of shape (s2, 1, 1, d2) with d2 even, got {describe(freqs)}"
        )
    # (s2, d2) in freqs' dtype, float32 at least (half-precision angles gain nothing from a half cos)
    angles = freqs[:, 0, 0, :].to(torch.promote_types(freqs.dtype, torch.float32))
    half = angles.shape[1] // 2
    first, second = (
        (angles[:, 0::2], angles[:, 1::2]) if interleaved else (angles[:, :half], angles[:, half:])
    )
    if angles.device.type == "cpu" and not torch.equal(first, second):
        layout = "each angle twice in a row" if interleaved else "cat(f, f)"
        raise ValueError(
            f"{name}: expected each pair's angle written for both its features ({layout}, as TE's "
            f"RotaryPositionEmbedding builds it with interleaved={interleaved}); the pairs differ"
        )
    return torch.cos(first).to(compute), torch.sin(first).to(compute)


def _check_cp(cp_size: object, cp_rank: object, start_positions: object) -> tuple[int, int]:
    cp_size = check_int("cp_size", cp_size, minimum=1, expected="a positive int")
    cp_rank = check_int("cp_rank", cp_rank, minimum=0, expected="a non-negative int")
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank: expected 0 <= cp_rank < cp_size ({cp_size}), got {cp_rank}")
    if cp_size > 1 and start_positions is not None:
        raise ValueError("start_positions: expected None with cp_size > 1 (TE supports neither together)")
    return cp_size, cp_rank


def _cp_positions(length: int, cp_size: int, cp_rank: int, device: torch.device) -> torch.Tensor:
    """Global positions of one sequence's `length` local tokens on rank cp_rank (TE's two-chunk split)."""
    if length % 2:
        raise ValueError(f"t: expected an even local sequence length with cp_size > 1, got {length}")
    chunk = length // 2
    first = torch.arange(chunk, device=device) + cp_rank * chunk
    second = torch.arange(chunk, device=device) + (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([first, second])  # (length,)


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    fused: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Mirrors TE's ``apply_rotary_pos_emb``: t rotated by the angles in freqs, a new tensor shaped like t.

    ``backend`` (keyword only, ropekit's): "auto", "torch", "cpu" or "triton", as for
    :func:`ropekit.apply_rotary`.

    Raises:
        ValueError: an unknown tensor_format; "thd" without cu_seqlens; freqs not (s2, 1, 1, d2) float angles
            with one angle per pair, d2 wider than d, or fewer rows than the positions need; start_positions
            not (b,) integers; cp_rank outside [0, cp_size), start_positions with cp_size > 1, an odd local
            length with cp_size > 1; and what :func:`ropekit.apply_rotary` refuses.
    """
    check_bool("fused", fused)
    if tensor_format not in _FORMATS:
        raise ValueError(f"tensor_format: expected one of {_FORMATS}, got {tensor_format!r}")
    if tensor_format == "thd" and cu_seqlens is None:
        raise ValueError(
            "cu_seqlens: expected the (b + 1,) cumulative lengths with tensor_format='thd', got None"
        )
    if tensor_format != "thd" and cu_seqlens is not None:
        raise ValueError(f"cu_seqlens: expected None with tensor_format={tensor_format!r} (only 'thd' packs)")
    if not isinstance(t, torch.Tensor) or t.dim() != (3 if tensor_format == "thd" else 4):
        want = "(t, h, d)" if tensor_format == "thd" else f"a 4-D {tensor_format} tensor"
        raise ValueError(f"t: expected {want} for tensor_format={tensor_format!r}, got {describe(t)}")
    rotate = (tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank)
    return _rotate(t, freqs, *rotate, inplace=False, backend=backend)


def _rotate(
    t, freqs, tensor_format, start_positions, interleaved, cu_seqlens, cp_size, cp_rank, *, inplace, backend
):
    """Both functions' rotation of t (checked rank and format): positions from start_positions or the
    context-parallel split, then :func:`ropekit.apply_rotary` on the (b, s, h, d) or (t, h, d) view."""
    check_bool("interleaved", interleaved)
    cp_size, cp_rank = _check_cp(cp_size, cp_rank, start_positions)
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    cos, sin = _tables("freqs", freqs, interleaved, compute)
    x = t.transpose(0, 1) if tensor_format == "sbhd" else t  # (b, s, h, d), or (t, h, d)
    kw: dict = dict(interleaved=interleaved, inplace=inplace, backend=backend)
    if tensor_format == "thd":
        kw["cu_seqlens"] = cu_seqlens
        if cp_size > 1:
            if not isinstance(cu_seqlens, torch.Tensor):
                raise ValueError(f"cu_seqlens: expected an integer tensor, got {describe(cu_seqlens)}")
            local = (cu_seqlens // cp_size).tolist()  # TE: each rank holds 1 / cp_size of every sequence
            lengths = [b - a for a, b in itertools.pairwise(local)]
            if local[0] != 0 or sum(lengths) != x.shape[0]:
                raise ValueError(
                    f"cu_seqlens: expected the global padded lengths, whose 1 / cp_size shares sum to t's "
                    f"{x.shape[0]} tokens, got {cu_seqlens.tolist()}"
                )
            kw["positions"] = torch.cat([_cp_positions(n, cp_size, cp_rank, x.device) for n in lengths])
            kw["cu_seqlens"] = torch.tensor(local, dtype=torch.int64)
        elif start_positions is not None:
            kw["offsets"] = start_positions
    elif cp_size > 1:
        kw["positions"] = _cp_positions(x.shape[1], cp_size, cp_rank, x.device).expand(x.shape[0], -1)
    elif start_positions is not None:
        kw["offsets"] = start_positions
    with peer_names(_NAMES):
        out = apply_rotary(x, cos, sin, **kw)
    return out.transpose(0, 1) if tensor_format == "sbhd" else out


def apply_fused_qkv_rotary_pos_emb(
    qkv: torch.Tensor,
    q_freqs: torch.Tensor,
    k_freqs: torch.Tensor,
    qkv_split_arg_list: list[int],
    tensor_format: str = "sbhd",
    start_positions: torch.Tensor | None = None,
    interleaved: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mirrors TE's ``apply_fused_qkv_rotary_pos_emb``: split packed qkv, rotate q and k; returns (q, k, v).

    qkv is (s, b, h, q_elems + k_elems + v_elems) ("sbhd") or (b, s, h, ...) ("bshd"), h the key-value groups,
    each group holding its q heads, one k head and one v head: ``qkv_split_arg_list = [q_elems, k_elems,
    v_elems]`` (Megatron's GQA layout). The head_dim is k_elems; each group has q_elems / k_elems q heads.
    Returns new tensors q (s, b, h * q_elems / k_elems, k_elems), k (s, b, h, k_elems) and v (s, b, h,
    v_elems) (b and s swapped for "bshd"): q rotated by q_freqs, k by k_freqs, v copied. ``backend`` (keyword
    only, ropekit's) rotates both.

    Raises:
        ValueError: tensor_format "thd" or unknown (TE serves only sbhd / bshd here), a split that does not
            sum to qkv's last axis or whose q_elems is not a multiple of k_elems, and what
            :func:`apply_rotary_pos_emb` refuses.
    """
    if tensor_format not in ("sbhd", "bshd"):
        raise ValueError(
            f"tensor_format: expected 'sbhd' or 'bshd' (TE packs no 'thd' qkv), got {tensor_format!r}"
        )
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: expected None (TE ignores it here: 'thd' is not supported)")
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError(f"qkv: expected a 4-D {tensor_format} tensor, got {describe(qkv)}")
    split = list(qkv_split_arg_list) if isinstance(qkv_split_arg_list, (list, tuple)) else None
    if (
        split is None
        or len(split) != 3
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split)
    ):
        raise ValueError(
            f"qkv_split_arg_list: expected three positive ints [q, k, v], got {qkv_split_arg_list!r}"
        )
    q_elems, head_dim, _ = split
    if sum(split) != qkv.shape[-1] or q_elems % head_dim:
        raise ValueError(
            f"qkv_split_arg_list: expected q + k + v = qkv's last axis ({qkv.shape[-1]}) and q a multiple of "
            f"k (the head_dim), got {split}"
        )
    q_per_group = q_elems // head_dim
    # q's heads sit in groups between k and v heads: a copy gathers them into TE's (s, b, h * n, d) output,
    # which is then rotated in place; k is rotated out of place into its own output; v is copied.
    q = qkv[..., :q_elems].unflatten(-1, (q_per_group, head_dim))  # (s, b, h, n, d) view
    q = q.clone(memory_format=torch.contiguous_format).flatten(2, 3)  # (s, b, h * n, d)
    k = qkv[..., q_elems : q_elems + head_dim]  # (s, b, h, d) view
    rotate = (tensor_format, start_positions, interleaved, None, cp_size, cp_rank)
    q_out = _rotate(q, q_freqs, *rotate, inplace=True, backend=backend)
    k_out = _rotate(k, k_freqs, *rotate, inplace=False, backend=backend)
    v_out = qkv[..., q_elems + head_dim :].clone(memory_format=torch.contiguous_format)
    return q_out, k_out, v_out
