"""Hugging Face's ``apply_rotary_pos_emb`` (transformers 5.x, ``models/llama/modeling_llama.py``) on the core.

Migration: ``from transformers.models.llama.modeling_llama import apply_rotary_pos_emb`` becomes
``from ropekit.compat.hf import apply_rotary_pos_emb``; the call stays as it is (plus ropekit's keyword-only
``backend=``). ``from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, rope_config_validation``
becomes ``from ropekit.compat.hf import ...``: the rope-init functions
``ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len) -> (inv_freq, attention_factor)`` computed by
ropekit's schedules, and the validation of a config's rope parameters.

HF's rotary modules return per-token tables: ``cos, sin = rotary_emb(x, position_ids)``, each
(B, S, D) with duplicated halves (``cat(freqs, freqs)``, times the schedule's attention scaling), in x's
dtype. ropekit reads them as they are: the first D/2 values of each row, through a view (no table is rebuilt,
nothing is copied), one row per token, shared by every head.

Shape notation: B batch, S sequence, H heads (Hq, Hk for q and k), D head_dim.

Same semantics as HF: pairs (i, i + D/2) (``rotate_half``), q and k never modified, outputs in q's and k's
layout and dtype. Differences:

- Math runs in float32 with one rounding to the output dtype; HF multiplies in the input dtype, so bfloat16
  results differ from HF's by about one bfloat16 ulp (ropekit's are the closer to the exact rotation).
- Only the first half of each row is read: a table whose halves differ is not HF's and is not detected, and
  a gradient with respect to cos / sin (HF's tables carry none; a learnable table would) reaches only that
  first half.
- Shapes HF would broadcast into something else (a table of another width, a sequence axis of 1 for S > 1)
  are a ValueError.
- Outputs have q's and k's dtype. HF's rotary modules return tables in that dtype already; given tables of a
  wider dtype, HF's arithmetic would promote its outputs to it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ropekit.backends.plan import launch_rotary
from ropekit.compat._common import peer_names
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary_qk
from ropekit.hf_config import load_hf_config, rope_layer_types
from ropekit.tables import row_starts
from ropekit.validation import check_int, describe

__all__ = ["ROPE_INIT_FUNCTIONS", "apply_rotary_pos_emb", "rope_config_validation"]


def _head_axis(cos: torch.Tensor, unsqueeze_dim: object) -> int:
    """The axis of a 4-D q that ``cos.unsqueeze(unsqueeze_dim)`` broadcasts over: 1 (B, H, S, D) or 2.

    HF right-aligns the unsqueezed table with q; the inserted axis of size 1 is the heads axis.
    """
    if not isinstance(cos, torch.Tensor) or cos.dim() not in (2, 3):
        raise ValueError(
            f"cos: expected per-token rows of shape (batch, seq, head_dim) or (seq, head_dim), "
            f"got {describe(cos)}"
        )
    rank = cos.dim() + 1  # after unsqueeze
    expected = f"an int in [{-rank}, {rank - 1}] (cos has {cos.dim()} axes)"
    unsqueeze_dim = check_int(
        "unsqueeze_dim", unsqueeze_dim, minimum=-rank, maximum=rank - 1, expected=expected
    )
    inserted = unsqueeze_dim + rank if unsqueeze_dim < 0 else unsqueeze_dim
    axis = inserted + 4 - rank  # the same axis counted on q
    if axis not in (1, 2):
        raise ValueError(
            f"unsqueeze_dim: {unsqueeze_dim} makes cos {tuple(cos.shape)} broadcast over axis {axis} of q; "
            f"expected the heads axis, 1 for q (batch, heads, seq, head_dim) or 2 for (batch, seq, heads, "
            f"head_dim) (unsqueeze_dim {1 if cos.dim() == 3 else 0} or {2 if cos.dim() == 3 else 1})"
        )
    return axis


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
    *,
    backend: str = "auto",
    numerics: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` (Llama and most).

    Args:
        q: (B, Hq, S, D) with unsqueeze_dim=1 (HF's layout), or (B, S, Hq, D) with unsqueeze_dim=2.
        k: like q, with Hk heads.
        cos, sin: per-token rows (B, S, D) or (1, S, D), full width with duplicated halves, as HF's rotary
            modules return; (S, D) with unsqueeze_dim 0 (bhsd) or 1 (bshd) as HF broadcasts it.
        unsqueeze_dim: where HF unsqueezes cos / sin to broadcast them over the heads axis.
        backend: ropekit's backend ("auto", "torch", "cpu" or "triton").
        numerics: "exact" (ropekit's one rounding, the default) or "hf": HF's own bits on these tables
            (each product and sum rounded to q's dtype; :func:`ropekit.apply_rotary`).

    Returns:
        (q_embed, k_embed), shaped and laid out like q and k.

    Raises:
        ValueError: tables of another width or token shape, an unsqueeze_dim that does not land on a heads
            axis, or anything :func:`ropekit.apply_rotary_qk` rejects.
    """
    out = _direct(q, k, cos, sin, unsqueeze_dim, backend, numerics)
    if out is not None:
        return out
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor, got {describe(t)}")
    axis = _head_axis(cos, unsqueeze_dim)
    if cos.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"cos: expected rows as wide as head_dim ({q.shape[-1]}) with duplicated halves, as HF's rotary "
            f"modules return, got shape {tuple(cos.shape)}"
        )
    if axis == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D) views
    with peer_names({"x": "q"}):
        q_out, k_out = apply_rotary_qk(
            q, k, cos, sin, per_token=True, full_width=True, backend=backend, numerics=numerics
        )
    if axis == 1:
        q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)  # back to (B, H, S, D)
    return q_out, k_out


# -- the rope-init functions (transformers' ``modeling_rope_utils``) --------------------------------------


def _rope_init_function(rope_type: str) -> Callable[..., tuple[torch.Tensor, float]]:
    def compute(
        config: Any,
        device: torch.device | str | None = None,
        seq_len: int | torch.Tensor | None = None,
        layer_type: str | None = None,
    ) -> tuple[torch.Tensor, float]:
        rope = RopeConfig.from_hf(config, layer_type=layer_type, hf_float32_inv_freq=True)
        if rope.rope_type != rope_type:
            raise ValueError(
                f"config: its rope_type is {rope.rope_type!r}; expected {rope_type!r} "
                f"(ROPE_INIT_FUNCTIONS[{rope_type!r}]); use ROPE_INIT_FUNCTIONS[{rope.rope_type!r}]"
            )
        if isinstance(seq_len, torch.Tensor):  # HF's dynamic update passes the longest position as a tensor
            seq_len = int(seq_len.max())
        inv_freq = rope.inv_freq(seq_len).to(device=device, dtype=torch.float32)  # (rotary_dim // 2,)
        return inv_freq, float(rope.attention_scaling(seq_len))

    compute.__name__ = compute.__qualname__ = f"compute_{rope_type}_rope_parameters"
    compute.__doc__ = (
        f"transformers' ``ROPE_INIT_FUNCTIONS[{rope_type!r}](config, device=None, seq_len=None, "
        f"layer_type=None)``: (inv_freq float32 (rotary_dim // 2,) on device, attention_factor), from "
        f"ropekit's {rope_type!r} schedule with HF's float32 frequencies. Raises ValueError for a config of "
        f"another rope_type, or anything :meth:`ropekit.RopeConfig.from_hf` rejects."
    )
    return compute


# transformers 5.24's keys, plus "default" (which transformers 5 moved onto each model's rotary class as
# ``compute_default_rope_parameters``).
ROPE_INIT_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, float]]] = {
    name: _rope_init_function(name)
    for name in ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
}


def rope_config_validation(config: Any, ignore_keys: set[str] | None = None) -> None:
    """Mirrors ``transformers.modeling_rope_utils.rope_config_validation`` (and ``config.validate_rope()``).

    Every layer type's rope parameters are read as :meth:`ropekit.RopeConfig.from_hf` reads them. What
    transformers rejects, and what it accepts but cannot work (a factor below 1, a missing required key, an
    unknown rope_type), is a ValueError naming the key. What transformers accepts with a warning, ropekit
    accepts with a ``UserWarning`` saying the same:

    - yarn: an explicit ``factor`` that differs from max_position_embeddings /
      original_max_position_embeddings (when that ratio is not 1); the explicit factor is used.
    - longrope: no ``factor``, so it is implicit (max_position_embeddings /
      original_max_position_embeddings).
    - yarn, llama3, longrope: no ``original_max_position_embeddings``; max_position_embeddings is used.
      transformers' function standardises the config first (``standardize_rope_params``), which sets the
      same default silently; only ``config.validate_rope()`` called on a config never standardised raises
      ``KeyError`` there (tests/compat/test_hf.py calls both on one config).

    ``ignore_keys`` is accepted for transformers' signature (ropekit logs unused keys and ignores them).

    Raises:
        ValueError: as :meth:`ropekit.RopeConfig.from_hf`, naming the key.
    """
    d = load_hf_config(config)
    for layer_type in rope_layer_types(d) or [None]:
        rope = RopeConfig.from_hf(d, layer_type=layer_type)
        _warn_as_transformers(d, layer_type, rope.rope_type)


def _raw_rope_parameters(d: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return params


def _warn_as_transformers(d: dict[str, Any], layer_type: str | None, rope_type: str) -> None:
    params = _raw_rope_parameters(d, layer_type)
    where = "rope_parameters" if layer_type is None else f"rope_parameters[{layer_type!r}]"
    original = params.get("original_max_position_embeddings", d.get("original_max_position_embeddings"))
    longest = d.get("max_position_embeddings")
    if rope_type in ("yarn", "llama3", "longrope") and original is None:
        warnings.warn(
            f"{where}['original_max_position_embeddings']: missing for rope_type {rope_type!r}; using "
            f"max_position_embeddings ({longest}), as transformers does",
            stacklevel=3,
        )
        return
    if original is None or not longest:
        return
    implicit = longest / original
    factor = params.get("factor")
    if rope_type == "yarn" and factor is not None and implicit not in (1, factor):
        warnings.warn(
            f"{where}['factor']: {factor} differs from max_position_embeddings / "
            f"original_max_position_embeddings = {implicit}; the explicit factor is used, as transformers "
            f"does",
            stacklevel=3,
        )
    if rope_type == "longrope" and factor is None:
        warnings.warn(
            f"{where}['factor']: missing, so it is implicit: max_position_embeddings / "
            f"original_max_position_embeddings = {implicit}; set it explicitly",
            stacklevel=3,
        )


def _direct(q, k, cos, sin, unsqueeze_dim, backend, numerics):
    """HF's usual call, 3-D tables of q's sequence length and head_dim, as the core call it amounts to: a
    (rows, D/2) view of the tables and each batch row's first row (an int 0 when the rows are shared by the
    batch). In the steady state that is the core's launch plan (its one gate, :mod:`ropekit.backends.plan`)
    with no other check: everything HF's shapes rely on is compared here, the rest is in the plan's key. None
    for any other call (the checked path below then names what is wrong)."""
    if type(unsqueeze_dim) is not int or (unsqueeze_dim != 1 and unsqueeze_dim != 2):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(cos) is not torch.Tensor:
        return None
    q_shape, rows = q.shape, cos.shape
    if len(q_shape) != 4 or len(rows) != 3 or type(sin) is not torch.Tensor or sin.shape != rows:
        return None
    batch, seq, width = q_shape[0], q_shape[unsqueeze_dim ^ 3], q_shape[3]  # seq: axis 2 (bhsd) or 1 (bshd)
    if (
        rows[1] != seq
        or rows[2] != width
        or width % 2
        or len(k.shape) != 4
        or k.shape[unsqueeze_dim ^ 3] != seq
    ):
        return None
    half = width // 2
    if rows[0] == 1 or batch == 1 or (cos.stride(0) == 0 and sin.stride(0) == 0):
        cos_rows, sin_rows, starts = cos[0, :, :half], sin[0, :, :half], 0  # (S, D/2): row s, token s
    elif rows[0] == batch and cos.is_contiguous() and sin.is_contiguous():
        cos_rows = cos.view(batch * seq, width)[:, :half]  # (B * S, D/2): row b * S + s, token (b, s)
        sin_rows = sin.view(batch * seq, width)[:, :half]
        starts = row_starts(batch, seq, q.device)
    else:
        return None
    if unsqueeze_dim == 1:
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D) views
    out = launch_rotary(
        q,
        k,
        cos_rows,
        sin_rows,
        starts,
        interleaved=False,
        inplace=False,
        backend=backend,
        conjugate=False,
        numerics=numerics,
    )[0]  # the rotation's gate: a steady step is its plan (a miss is looked up again by apply_rotary_qk)
    if out is None:
        with peer_names({"x": "q"}):
            out = apply_rotary_qk(
                q, k, cos_rows, sin_rows, offsets=starts, backend=backend, numerics=numerics
            )
    if unsqueeze_dim == 2:
        return out
    return out[0].transpose(1, 2), out[1].transpose(1, 2)  # back to (B, H, S, D)
