"""The functional API: :func:`apply_rotary` and :func:`apply_rotary_qk`.

Shape notation:
    B batch, S sequence, T total tokens of a packed batch, H heads (Hq, Hk for q and k), D head_dim,
    R rotary_dim = 2 * cos.shape[-1] <= D, L table_len.

Pair layout (the model families disagree; pick the one your checkpoint was trained with):
    interleaved=False: "half" / GPT-NeoX / Hugging Face pairing, features (i, i + R/2) rotate together.
        LLaMA, Mistral, Qwen, Phi, Gemma, GPT-NeoX as loaded through transformers.
    interleaved=True: GPT-J / Meta pairing, features (2i, 2i+1) rotate together.
        GPT-J, Meta's original LLaMA code and checkpoints, RoFormer.
    The two are the same rotation with the features permuted; docs/math.md derives both.
"""

from __future__ import annotations

import torch

from ropekit.autograd import RotaryFunction, RotaryQKFunction
from ropekit.backends import BACKENDS, Backend, select_backend
from ropekit.backends.kernel_op import MAX_HALF
from ropekit.backends.plan import (
    keep,
    launch_rotary,
    launch_rotary_packed,
    launch_rotary_positions,
    rotary_plan,
)
from ropekit.dtensor_inputs import (
    POSITIONS,
    ROTATED,
    SHARDED_OPS,
    TABLE,
    check_placements,
    is_dtensor,
    lift,
)
from ropekit.positions import Positions, resolve
from ropekit.tables import plain_tables, token_tables
from ropekit.validation import (
    check_bool,
    check_in_place_allowed,
    check_movable,
    check_no_alias,
    check_numerics,
    check_rotary_position,
    check_tables,
    check_writable,
    check_x,
    describe,
)

__all__ = ["apply_rotary", "apply_rotary_qk"]

_PLAIN = dict(per_token=False, full_width=False)  # the table form a launch plan takes
_EXACT: dict = {}  # rotate_qk's keywords for numerics "exact": none (a registered backend may take none)


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    per_token: bool = False,
    full_width: bool = False,
    backend: str = "auto",
    inverse: bool = False,
    rotary_position: str = "first",
    numerics: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys together (one kernel launch on fused backends).

    q and k may have different head counts (GQA / MQA). Every other argument is as in :func:`apply_rotary`.

    Returns:
        (q_rotated, k_rotated), with q's and k's shapes and dtype.
    """
    if not isinstance(k, torch.Tensor):
        raise ValueError(f"k: expected a torch.Tensor, got {describe(k)}")
    forms = dict(per_token=per_token, full_width=full_width)
    flags = dict(
        interleaved=interleaved, inplace=inplace, inverse=inverse, rotary_position=rotary_position,
        numerics=numerics,
    )  # fmt: skip
    return _apply(q, k, cos, sin, positions, offsets, cu_seqlens, backend, forms, flags)


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    offsets: int | torch.Tensor = 0,
    cu_seqlens: torch.Tensor | None = None,
    interleaved: bool = False,
    inplace: bool = False,
    per_token: bool = False,
    full_width: bool = False,
    backend: str = "auto",
    inverse: bool = False,
    rotary_position: str = "first",
    numerics: str = "exact",
) -> torch.Tensor:
    """Apply rotary position embeddings to x.

    Args:
        x: (B, S, H, D), or (T, H, D) when cu_seqlens is given. Any float dtype; math runs in float32
            (float64 stays float64) and the output has x's dtype.
        cos, sin: tables of shape (L, R/2); row p serves position p (see :meth:`ropekit.RopeConfig.cos_sin`).
            Features of x past R pass through unchanged (partial rotary).
        positions: optional integer tensor (B, S), or (T,) with cu_seqlens: the table row of each token
            (packing, arbitrary position ids). Mutually exclusive with non-zero offsets.
        offsets: int or (B,) integer tensor (one per sequence, (N,) with cu_seqlens) added to the default
            positions arange(S): KV-cache decoding, left padding.
        cu_seqlens: int32/int64 (N+1,) cumulative sequence lengths of a packed batch, starting at 0 and ending
            at T. Each packed sequence starts at its own position 0 (plus its offset).
        interleaved: pair layout; False = half / GPT-NeoX / HF, True = GPT-J / Meta (module docstring).
        inplace: write into x and return it. Otherwise x is never modified.
        per_token: cos / sin are already one row per token (Hugging Face's ``cos[position_ids]``), shaped
            (B, S, W), (1, S, W) or (S, W), or (T, W) for packed input; positions and offsets must be left
            at their defaults. The rows are read where they lie (see :mod:`ropekit.tables`).
        full_width: the rows hold R values, each pair's value written for both its features (HF's
            ``cat(freqs, freqs)``; with interleaved=True, ``repeat_interleave(freqs, 2)``). Only the first of
            each pair is read, through a view. Works with per_token or with a table indexed by positions.
        backend: "auto", "torch", "cpu" or "triton".
        inverse: rotate by -theta instead of +theta: undoes the rotation (DeepSeek-V4 de-rotates attention
            outputs this way); its gradient is the rotation by +theta.
        rotary_position: where the rotated R features sit in each head: "first" (features [0, R), the rest
            pass through: partial rotary as in GPT-NeoX) or "last" (features [D - R, D), after the
            position-free ones: DeepSeek's NoPE-first layout).
        numerics: whose bits the rotation gives (docs/numerics-modes.md). "exact" (the default): products
            and sums in float32, rounded once to x's dtype. "hf": transformers' eager
            ``x * cos + rotate_half(x) * sin`` with cos / sin cast to x's dtype, each product and sum rounded
            to it (bfloat16 / float16), given these same tables. "vllm": vLLM's ``forward_native``, the same
            arithmetic on its cache cast to x's dtype. The modes differ in bfloat16 and float16 only;
            float32 and float64 compute as "exact" (float64 in float64). The mode is the arithmetic given a
            table: pass the peer's own cos / sin (``per_token`` / ``full_width`` take HF's) for its bits.
            Served by the "torch" and "cpu" backends ("auto" picks one; "triton" raises).

    Returns:
        The rotated tensor, shaped like x.

    Raises:
        ValueError: on a wrong rank, mismatched or too-wide tables, positions of the wrong shape, negative or
            past the table, malformed cu_seqlens, offsets of the wrong length, an unavailable backend, a
            rotary_position other than "first" and "last", or numerics other than "exact", "hf" and "vllm"
            (or one the named backend does not compute).
    """
    forms = dict(per_token=per_token, full_width=full_width)
    flags = dict(
        interleaved=interleaved, inplace=inplace, inverse=inverse, rotary_position=rotary_position,
        numerics=numerics,
    )  # fmt: skip
    return _apply(x, None, cos, sin, positions, offsets, cu_seqlens, backend, forms, flags)[0]


def _apply(q, k, cos, sin, positions, offsets, cu_seqlens, backend, forms, flags):
    interleaved, inplace, inverse = flags["interleaved"], flags["inplace"], flags["inverse"]
    numerics = flags["numerics"]
    gated, key = False, None
    if forms["per_token"] is not False or forms["full_width"] is not False:
        # HF's, Liger's, Megatron's, vLLM's M-RoPE rows: the plain table form, when it certainly is one
        plain = plain_tables(q, cos, sin, positions, offsets, cu_seqlens, interleaved, **forms)
        if plain is not None:
            cos, sin, offsets = plain
            forms = _PLAIN
    if (
        forms["per_token"] is False and forms["full_width"] is False and flags["rotary_position"] == "first"
    ):  # a decode or prefill step seen before: its launch plan (ropekit.backends.plan)
        gated = True
        if positions is not None:  # explicit rows, (B, S) or packed (T,): their own gate
            if type(offsets) is int and offsets == 0:
                out, key = launch_rotary_positions(
                    q, k, cos, sin, positions, cu_seqlens, interleaved=interleaved, inplace=inplace,
                    backend=backend, conjugate=inverse, numerics=numerics,
                )  # fmt: skip
            else:
                out = None  # positions with offsets: the checked path refuses them
        elif cu_seqlens is None:
            out, key = launch_rotary(
                q, k, cos, sin, offsets, interleaved=interleaved, inplace=inplace, backend=backend,
                conjugate=inverse, numerics=numerics,
            )  # fmt: skip
        else:  # a packed (varlen) step: its own gate, cu_seqlens in the key
            out, key = launch_rotary_packed(
                q, k, cos, sin, offsets, cu_seqlens, interleaved=interleaved, inplace=inplace,
                backend=backend, conjugate=inverse, numerics=numerics,
            )  # fmt: skip
        if out is not None:
            return out
    # Per-token and full-width tables become a (rows, R/2) table (a view) plus positions: see ropekit.tables.
    table_cos = cos
    cos, sin, positions = token_tables(q, cos, sin, positions, offsets, cu_seqlens, interleaved, **forms)
    name = "q" if k is not None else "x"
    pos = resolve(q, positions=positions, offsets=offsets, cu_seqlens=cu_seqlens, name=name)
    if inplace is True and (cu_seqlens is not None or type(offsets) is torch.Tensor):
        # The memory rule for what a kernel (and so a plan) reads as it writes, though the rows were resolved
        # into a tensor of their own here: refused on every path alike.
        per_sequence = offsets if type(offsets) is torch.Tensor else None
        check_no_alias(((name, q), ("k", k)), (("offsets", per_sequence), ("cu_seqlens", cu_seqlens)))
    # What the plan reads in the kernel: explicit positions (with a packed batch's cu_seqlens, checked),
    # per-sequence offsets (a decode step), a packed batch's cu_seqlens with its int or per-sequence offsets.
    read = (
        key is not None
        and cos is table_cos
        and (positions is not None or cu_seqlens is not None or type(offsets) is torch.Tensor)
    )
    return apply_resolved(
        q, k, cos, sin, pos, backend=backend, **flags, gated=gated, plan_key=key,
        offsets=offsets if read else None, cu_seqlens=cu_seqlens if read else None,
        positions=positions if read else None,
    )  # fmt: skip


def apply_resolved(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: Positions,
    *,
    interleaved: bool,
    inplace: bool,
    backend: str,
    inverse: bool = False,
    rotary_position: str = "first",
    numerics: str = "exact",
    gated: bool = False,
    plan_key: tuple | None = None,
    offsets: int | torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    swap: tuple[int, int] | None = None,
    table_grows: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The functional API after positions are resolved: the entry :class:`ropekit.RotaryEmbedding` shares.

    A caller that needs the largest position first (to size its table) resolves once with
    :func:`ropekit.positions.resolve` (``pos.largest``: host-known or None), then calls this, which checks
    q, k, the tables, the flags and the rows against the table, and dispatches, exactly as
    :func:`apply_rotary_qk` would (k may be None, as for :func:`apply_rotary`).

    Args:
        q, k: as in :func:`apply_rotary_qk`; pos must come from ``resolve(q, ...)``.
        cos, sin, interleaved, inplace, backend, inverse, rotary_position, numerics: as in
            :func:`apply_rotary`.
        gated: the caller went through the launch-plan gate (:func:`ropekit.backends.plan.gate`)
            already, which answered ``plan_key``: the key to keep this call's plan under, or None (no plan).
            Otherwise the call goes through the gate here.
        offsets: the per-sequence offsets tensor pos was resolved from (no positions, no cu_seqlens, rows
            of the caller's own table), or None: the plan kept under ``plan_key`` then reads them in the
            kernel, so the next call like this one is a lookup and one launch.
        cu_seqlens: the packed batch's cu_seqlens pos was resolved from (no positions, rows of the caller's
            own table), offsets then its int or per-sequence offsets; or None. The plan kept under
            ``plan_key`` reads both in the kernel (no positions tensor built).
        positions: the explicit positions tensor pos was resolved from (rows of the caller's own table;
            with ``cu_seqlens``, a packed batch's), or None: the plan kept under ``plan_key`` hands them to
            the kernel as they are, and the backend checks every row (and cu_seqlens) before it writes.
        swap, table_grows: how the plan kept under ``plan_key`` serves its caller (the module): its key
            holds the caller's tensors, of which q and k are ``t.transpose(*swap)``; the caller grows its
            table for rows past it (:func:`ropekit.backends.plan.rotary_plan`).

    Returns:
        (q_rotated, k_rotated or None).
    """
    if not gated:
        if pos.tensor is None and type(pos.offset) is int and rotary_position == "first":
            out, plan_key = launch_rotary(
                q, k, cos, sin, pos.offset, interleaved=interleaved, inplace=inplace,
                backend=backend, conjugate=inverse, numerics=numerics,
            )  # fmt: skip
            if out is not None:
                return out
    if k is not None:  # q was checked by resolve(q, ...)
        check_x("k", k, varlen=q.dim() == 3)
        q_shape, k_shape = q.shape, k.shape  # same rank (check_x); no slicing: this runs every decode step
        if (
            k_shape[0] != q_shape[0]
            or k_shape[-1] != q_shape[-1]
            or (len(q_shape) == 4 and k_shape[1] != q_shape[1])
        ):
            raise ValueError(
                f"k: expected the same leading axes and head_dim as q {tuple(q.shape)}, got {tuple(k.shape)}"
            )
        if k.dtype != q.dtype or k.device != q.device:
            raise ValueError(
                f"k: expected q's dtype {q.dtype} and device {q.device}, got {k.dtype} on {k.device}"
            )
    check_tables(cos, sin, q.shape[-1])
    check_bool("interleaved", interleaved)
    check_bool("inplace", inplace)
    check_bool("inverse", inverse)
    if not isinstance(backend, str):
        raise ValueError(f"backend: expected a string, got {backend!r}")
    if numerics != "exact":
        check_numerics(numerics)
    if rotary_position != "first":
        check_rotary_position(rotary_position)
        return _rotate_last(q, k, cos, sin, pos, interleaved, inplace, backend, inverse, numerics)
    if inplace:
        _check_inplace(q, k, cos, sin, pos.tensor)
    table_cos = cos
    if cos.device != q.device:
        check_movable("cos", cos, q.device)
        check_movable("sin", sin, q.device)
        cos, sin = cos.to(q.device), sin.to(q.device)
    pos.check_table(cos.shape[0])
    impl = select_backend(backend, q, cos, numerics=numerics)
    rows, offset = pos.tensor, pos.offset
    if type(q) is not torch.Tensor and is_dtensor(q):  # sharded: tables replicated, rows alongside q
        cos, sin, rows, offset = _lift_dtensor(q, k, cos, sin, pos, impl)
    if inplace and torch.compiler.is_exporting():
        # An exported graph holds the out-of-place op, whose decomposition run_decompositions() lowers
        # (ropekit.backends.decompose): rotate out of place and copy back, as below.
        return _out_of_place_then_copy(q, k, cos, sin, pos, interleaved, backend, inverse, numerics)
    # a backend that lists no numerics computes "exact" alone (and is never chosen for another mode)
    rounding = _EXACT if numerics == "exact" else {"numerics": numerics}
    if not torch.is_grad_enabled() or not (
        q.requires_grad or (k is not None and k.requires_grad) or cos.requires_grad or sin.requires_grad
    ):  # no graph to record: skip autograd's bookkeeping
        out = impl.rotate_qk(
            q, k, cos, sin, rows, interleaved=interleaved, conjugate=inverse, inplace=inplace, offset=offset,
            **rounding,
        )  # fmt: skip
        if plan_key is not None:  # plan the next call like this one
            if offsets is not None:  # per-sequence or packed: the plan reads the offsets, not these rows
                offset = offsets
            plannable = cos is table_cos and (
                positions is not None or offsets is not None or (rows is None and type(offset) is int)
            )
            flags = dict(
                interleaved=interleaved, inplace=inplace, conjugate=inverse, cu_seqlens=cu_seqlens, swap=swap,
                table_grows=table_grows, **rounding,
            )  # fmt: skip
            if positions is not None:
                flags["positions"] = positions
            keep(plan_key, rotary_plan(impl, q, k, cos, sin, offset, **flags) if plannable else None)
        return out
    if cos.requires_grad or sin.requires_grad:
        return _learnable_tables(q, k, cos, sin, rows, offset, interleaved, inplace, inverse, numerics)
    if inplace and (impl.name == "torch" or torch.compiler.is_compiling()):
        # AOTAutograd cannot replay a Function that dirties a view (a slice of a packed qkv): it returned
        # wrong gradients (issue 17). Rotate out of place and copy back, which it traces like any torch op;
        # the torch backend always does (its slice assignments inside such a Function fail eagerly too).
        return _out_of_place_then_copy(q, k, cos, sin, pos, interleaved, backend, inverse, numerics)
    if k is None:
        return (
            RotaryFunction.apply(q, cos, sin, rows, offset, impl, interleaved, inplace, inverse, numerics),
            None,
        )
    if inplace:  # two single-output Functions: PyTorch lets only those write into views (packed qkv)
        return (
            RotaryFunction.apply(q, cos, sin, rows, offset, impl, interleaved, True, inverse, numerics),
            RotaryFunction.apply(k, cos, sin, rows, offset, impl, interleaved, True, inverse, numerics),
        )
    return RotaryQKFunction.apply(q, k, cos, sin, rows, offset, impl, interleaved, inverse, numerics)


def _out_of_place_then_copy(q, k, cos, sin, pos, interleaved, backend, inverse, numerics):
    """An in-place rotation as an out-of-place one copied back into q and k (traced graphs: see callers)."""
    out_q, out_k = apply_resolved(
        q, k, cos, sin, pos, interleaved=interleaved, inplace=False, backend=backend, inverse=inverse,
        numerics=numerics,
    )  # fmt: skip
    q.copy_(out_q)
    if k is not None:
        k.copy_(out_k)
    return q, k


def _lift_dtensor(q, k, cos, sin, pos, impl):
    """A DTensor q: the backend must rotate through a registered op with a sharding rule; the tables and rows
    become DTensors on q's mesh (:mod:`ropekit.dtensor_inputs`), so each rank rotates its own shard, and their
    placements are checked here, as ValueErrors, before the op's rule would refuse them."""
    if not hasattr(impl, "op_"):
        raise ValueError(
            f"backend: a DTensor q is rotated through ropekit's registered ops ('cpu' on CPU tensors, "
            f"'triton' on GPUs), got the {impl.name!r} backend for {q.dtype} on {q.device.type} (float64 and "
            f"rotary_dim > {2 * MAX_HALF} use it); pass float32, float16 or bfloat16"
        )
    op_name = f"{impl.name}_rotary_"  # on DTensors the kernel backends rotate through the in-place op
    if op_name not in SHARDED_OPS:
        raise ValueError(
            f"q: a DTensor needs ropekit's sharding rules, and ropekit::{op_name} has none registered; "
            f"import ropekit.integrations.dtensor first (once per process)"
        )
    for name, t in (("k", k), ("cos", cos), ("sin", sin), ("positions", pos.tensor)):
        if is_dtensor(t) and t.device_mesh != q.device_mesh:
            raise ValueError(f"{name}: expected a DTensor on q's mesh {q.device_mesh}, got {t.device_mesh}")
    if k is not None and not is_dtensor(k):
        raise ValueError(
            f"k: expected a DTensor like q (placements {tuple(q.placements)}), got {describe(k)}"
        )
    roles = (ROTATED, ROTATED, TABLE, TABLE, POSITIONS)
    check_placements("ropekit.apply_rotary", roles[:1], (tuple(q.placements),), q.dim())
    cos, sin, rows, offset = lift(q, cos, sin, pos.tensor, pos.offset, lambda: pos.as_tensor(q))
    placed = tuple(None if t is None else tuple(t.placements) for t in (q, k, cos, sin, rows))
    check_placements("ropekit.apply_rotary", roles, placed, q.dim())
    return cos, sin, rows, offset


def _check_inplace(q, k, cos, sin, rows) -> None:
    """What PyTorch itself refuses for an in-place op, and the memory rule, as ValueErrors naming the
    tensors, before anything is written."""
    name = "q" if k is not None else "x"
    for t_name, t in ((name, q), ("k", k)):
        if t is not None:
            check_in_place_allowed(t_name, t)
            check_writable(t_name, t)
    check_no_alias(
        ((name, q), ("k", k)), ((name, q), ("k", k), ("cos", cos), ("sin", sin), ("positions", rows))
    )


def _rotate_last(q, k, cos, sin, pos, interleaved, inplace, backend, inverse, numerics):
    """rotary_position="last": the rotated features end each head (DeepSeek's NoPE-first layout). The last R
    features are a view with a unit last stride, rotated as a head of width R; out of place, the position-free
    features are joined back in front."""
    start = q.shape[-1] - 2 * cos.shape[-1]  # the first rotated feature (the tables were checked)
    q_rot, k_rot = q[..., start:], None if k is None else k[..., start:]  # (..., heads, R) views
    out_q, out_k = apply_resolved(
        q_rot,
        k_rot,
        cos,
        sin,
        pos,
        interleaved=interleaved,
        inplace=inplace,
        backend=backend,
        inverse=inverse,
        numerics=numerics,
    )
    if inplace:
        return q, k
    out_q = torch.cat((q[..., :start], out_q), dim=-1)  # (..., heads, head_dim)
    return out_q, None if k is None else torch.cat((k[..., :start], out_k), dim=-1)


def _learnable_tables(q, k, cos, sin, rows, offset, interleaved, inplace, inverse, numerics):
    """Tables that require grad: autograd differentiates the plain torch math (the fused rule treats the
    tables as constants). In place, the rotation reads a copy and writes the result back, so the values the
    table gradient needs are not overwritten before backward."""
    torch_backend: Backend = BACKENDS["torch"]
    src_q, src_k = (q.clone(), None if k is None else k.clone()) if inplace else (q, k)
    out_q, out_k = torch_backend.rotate_qk(
        src_q, src_k, cos, sin, rows, interleaved=interleaved, conjugate=inverse, inplace=False,
        offset=offset, numerics=numerics,
    )  # fmt: skip
    if not inplace:
        return out_q, out_k
    q.copy_(out_q)
    if k is not None:
        k.copy_(out_k)
    return q, k
