"""FlashInfer's fused RoPE call conventions (``flashinfer.rope``), served by ropekit's fused ops.

Mirrors ``rope_quantize_fp8``, ``mla_rope_quantize_fp8`` and ``rope_quantize_fp8_append_paged_kv_cache``
(FlashInfer's ``flashinfer/rope.py`` and ``include/flashinfer/pos_enc.cuh``), and re-exports
``apply_rope_with_cos_sin_cache(_inplace)`` from :mod:`ropekit.compat.vllm`. FlashInfer's conventions kept:

* ``cos_sin_cache`` is ``(max_seq_len, rope_dim)`` float32 holding ``[cos | sin]``; ``pos_ids`` one per token;
  ``is_neox=True`` is the half (GPT-NeoX) pairing, False the interleaved (GPT-J) one.
* The FP8 scale multiplies: stored = fp8(value * quant_scale), saturated to the format's finite range.
  ropekit's own API divides (stored = value / scale), so these functions pass ``scale = 1 / quant_scale``:
  the bytes equal FlashInfer's except where ``r * s`` and ``r / (1 / s)`` round to float32 values on
  either side of an FP8 rounding boundary (never when quant_scale is a power of two).
* MLA is recognised by a 2-D key ``(nnz, rope_dim)``; the nope parts are only scaled and cast.
* The paged append writes token i at page ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] //
  page_size]``, entry ``positions[i] % page_size``; GQA / MHA caches hold the full key ``[k_rope | k_nope]``
  and v, MLA caches are ``(ckv_cache, kpe_cache)`` of shape (pages, page_size, dim).

ropekit also accepts float32 inputs (FlashInfer: float16 / bfloat16) and runs on the CPU.
"""

from __future__ import annotations

import itertools
import math
import numbers

import torch

from ropekit.compat._common import peer_names
from ropekit.compat.vllm import apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace
from ropekit.fused import apply_rotary_qk_and_cache, apply_rotary_qk_fp8
from ropekit.validation import check_bool, check_int, describe, is_compiling

__all__ = [
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
    "mla_rope_quantize_fp8",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
]

_LAYOUTS = {"NHD": "nhd", "HND": "hnd"}
# The core's argument names as FlashInfer's callers typed them (errors are re-raised under these).
_FP8_NAMES = {
    "q": "q_rope",
    "k": "k_rope",
    "q_scale": "quant_scale_q",
    "k_scale": "quant_scale_kv",
    "positions": "pos_ids",
    "cos": "cos_sin_cache",
    "sin": "cos_sin_cache",
    "fp8_dtype": "quantize_dtype",
}
_CACHE_NAMES = {
    "k": "k_rope",
    "k_scale": "quant_scale_kv",
    "v_scale": "quant_scale_kv",
    "positions": "pos_ids",
    "cos": "cos_sin_cache",
    "sin": "cos_sin_cache",
    "slot_mapping": "kv_indices",
}
_GQA_NAMES = _CACHE_NAMES | {"k_cache": "paged_kv_cache[0]", "v_cache": "paged_kv_cache[1]"}
_MLA_NAMES = _CACHE_NAMES | {"k_cache": "paged_kv_cache[1]", "v_cache": "paged_kv_cache[0]", "v": "k_nope"}


def _tables(cos_sin_cache: object) -> tuple[torch.Tensor, torch.Tensor]:
    c = cos_sin_cache
    if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or c.dim() != 2 or c.shape[1] % 2:
        raise ValueError(
            f"cos_sin_cache: expected a float32 (max_seq_len, rope_dim) tensor holding [cos | sin] with an "
            f"even rope_dim, got {describe(c)}"
        )
    half = c.shape[1] // 2
    return c[:, :half], c[:, half:]  # (max_seq_len, rope_dim / 2) views


def _scale(name: str, quant_scale: object) -> float:
    """FlashInfer's multiplying scale as ropekit's dividing one, checked as each kernel uses it: the scale
    (FlashInfer's kernels take a float32) and its reciprocal (ropekit's divide by it in float32) must both be
    finite and > 0 in float32; 1e300 is inf there and its reciprocal 0, which turned zeros into NaN."""
    value = math.nan
    if isinstance(quant_scale, numbers.Real) and not isinstance(quant_scale, bool):
        try:
            value = float(quant_scale)
        except OverflowError:  # an int past float's range
            value = math.inf
    reciprocal = 1.0 / value if value else math.inf
    as_float32 = torch.tensor([value, reciprocal], dtype=torch.float32)  # (2,)
    if not bool(((as_float32 > 0) & (as_float32 < math.inf)).all()):
        raise ValueError(
            f"{name}: expected a number whose float32 value and reciprocal are finite and > 0 (stored = "
            f"value * {name}, in float32), got {describe(quant_scale)}"
        )
    return reciprocal


def _quantize_dtype(quantize_dtype, outs) -> torch.dtype:
    """FlashInfer's rule: the given dtype, else the first given output's, else float8_e4m3fn."""
    if quantize_dtype is not None:
        return quantize_dtype
    return next((o.dtype for o in outs if o is not None), torch.float8_e4m3fn)


def _with_heads(name: str, t: object, mla: bool) -> torch.Tensor:
    """An MLA key (nnz, dim) as (nnz, 1, dim); a GQA / MHA tensor as it is."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(t)}")
    return t.unsqueeze(1) if mla else t


def _check_out(out: object, value: torch.Tensor, name: str) -> None:
    """A caller's preallocated output (FlashInfer's *_out) must be shaped and typed like value."""
    if out is not None and (
        not isinstance(out, torch.Tensor) or out.shape != value.shape or out.dtype != value.dtype
    ):
        raise ValueError(
            f"{name}: expected a {value.dtype} tensor of shape {tuple(value.shape)}, got {describe(out)}"
        )


def _store(out: torch.Tensor | None, value: torch.Tensor, name: str) -> torch.Tensor:
    """Copy value into a caller's preallocated output (FlashInfer's *_out), or return value."""
    if out is None:
        return value
    _check_out(out, value, name)
    return out.copy_(value)


def rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor | None,
    k_nope: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: torch.dtype | None = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: torch.Tensor | None = None,
    k_rope_out: torch.Tensor | None = None,
    q_nope_out: torch.Tensor | None = None,
    k_nope_out: torch.Tensor | None = None,
    enable_pdl: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mirrors ``flashinfer.rope.rope_quantize_fp8``: rotate the rope parts, quantise all four to FP8.

    Shapes: q_rope (nnz, Hq, rope_dim); k_rope (nnz, Hk, rope_dim), or (nnz, rope_dim) for MLA; the nope
    parts alike with their own width, or None (empty). enable_pdl is accepted and ignored (a CUDA launch
    attribute). ``backend`` (keyword only, ropekit's): "auto", "torch", "cpu" or "triton", as for
    :func:`ropekit.apply_rotary_qk_fp8`. Returns (q_rope_out, k_rope_out, q_nope_out, k_nope_out) in
    quantize_dtype, written into the given ``*_out`` tensors when passed.

    Raises:
        ValueError: a cos_sin_cache that is not float32 [cos | sin], a scale <= 0, shapes that disagree, or a
            preallocated output of the wrong shape or dtype; a backend that is unknown or cannot serve the
            inputs.
    """
    check_bool("is_neox", is_neox)
    check_bool("enable_pdl", enable_pdl)
    cos, sin = _tables(cos_sin_cache)
    dtype = _quantize_dtype(quantize_dtype, (q_rope_out, k_rope_out, q_nope_out, k_nope_out))
    mla = isinstance(k_rope, torch.Tensor) and k_rope.dim() == 2
    k = _with_heads("k_rope", k_rope, mla)
    if not isinstance(q_rope, torch.Tensor) or q_rope.dim() != 3:
        raise ValueError(f"q_rope: expected (nnz, num_qo_heads, rope_dim), got {describe(q_rope)}")
    nnz, heads = q_rope.shape[:2]
    if q_nope is None:
        q_nope = q_rope.new_empty(nnz, heads, 0)
    if k_nope is None:
        k_nope = k.new_empty(nnz, k.shape[1], 0)
    else:
        k_nope = _with_heads("k_nope", k_nope, mla)
    if not isinstance(pos_ids, torch.Tensor):
        raise ValueError(f"pos_ids: expected an integer tensor (nnz,), got {describe(pos_ids)}")
    q_scale, k_scale = _scale("quant_scale_q", quant_scale_q), _scale("quant_scale_kv", quant_scale_kv)
    with peer_names(_FP8_NAMES):
        outs = apply_rotary_qk_fp8(
            q_rope, k, cos, sin, q_scale=q_scale, k_scale=k_scale, fp8_dtype=dtype, q_nope=q_nope,
            k_nope=k_nope, positions=pos_ids, interleaved=not is_neox, backend=backend,
        )  # fmt: skip
    if mla:  # back to FlashInfer's 2-D MLA keys
        outs = (outs[0], outs[1][:, 0], outs[2], outs[3][:, 0])
    names = ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out")
    given = (q_rope_out, k_rope_out, q_nope_out, k_nope_out)
    for out, value, name in zip(given, outs, names, strict=True):  # all checked before the first is filled
        _check_out(out, value, name)
    return tuple(_store(o, v, n) for o, v, n in zip(given, outs, names, strict=True))


def mla_rope_quantize_fp8(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor,
    k_nope: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: torch.dtype | None = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: torch.Tensor | None = None,
    k_rope_out: torch.Tensor | None = None,
    q_nope_out: torch.Tensor | None = None,
    k_nope_out: torch.Tensor | None = None,
    enable_pdl: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mirrors ``flashinfer.rope.mla_rope_quantize_fp8``: :func:`rope_quantize_fp8` with 2-D MLA keys."""
    for name, t in (("k_rope", k_rope), ("k_nope", k_nope)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name}: expected the MLA layout (nnz, dim), got {describe(t)}")
    return rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype, quant_scale_q,
        quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out, enable_pdl, backend=backend,
    )  # fmt: skip


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    q_nope: torch.Tensor | None,
    k_nope: torch.Tensor | None,
    v: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    pos_ids: torch.Tensor,
    paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    is_neox: bool = True,
    quantize_dtype: torch.dtype | None = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: torch.Tensor | None = None,
    q_nope_out: torch.Tensor | None = None,
    enable_pdl: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirrors ``flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache``: quantised q returned, k and v
    rotated / scaled into the FP8 paged cache.

    GQA / MHA: ``paged_kv_cache = (k_cache, v_cache)`` in kv_layout "NHD" (pages, page_size, Hk, D) or
    "HND" (pages, Hk, page_size, D), D = rope_dim + no_rope_dim, and v (nnz, Hk, D). MLA (2-D k_rope):
    ``(ckv_cache, kpe_cache)``, (pages, page_size, no_rope_dim) and (pages, page_size, rope_dim); v None.
    ``backend`` (keyword only, ropekit's) runs both the quantisation and the cache write.

    Returns:
        (q_rope_out, q_nope_out) in quantize_dtype.

    Raises:
        ValueError: as :func:`rope_quantize_fp8`; caches not in quantize_dtype or of the wrong rank, v given
            for MLA or missing for GQA / MHA, an unknown kv_layout, or a page index or slot outside the cache
            (the caches are then left as they were).
    """
    page_size = check_int("page_size", page_size)
    if kv_layout not in _LAYOUTS:
        raise ValueError(f"kv_layout: expected 'NHD' or 'HND', got {kv_layout!r}")
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError(f"paged_kv_cache: expected a tuple of 2 tensors, got {describe(paged_kv_cache)}")
    mla = isinstance(k_rope, torch.Tensor) and k_rope.dim() == 2
    dtype = _quantize_dtype(quantize_dtype, (q_rope_out, q_nope_out))
    cache_0, cache_1 = paged_kv_cache
    page_axis = 2 if kv_layout == "HND" and not mla else 1
    for name, cache in (("paged_kv_cache[0]", cache_0), ("paged_kv_cache[1]", cache_1)):
        want = 3 if mla else 4
        if not isinstance(cache, torch.Tensor) or cache.dtype != dtype or cache.dim() != want:
            raise ValueError(f"{name}: expected a {want}-D {dtype} cache, got {describe(cache)}")
        if cache.shape[page_axis] != page_size:
            raise ValueError(
                f"page_size: expected the caches' page size, {cache.shape[page_axis]} ({name} has shape "
                f"{tuple(cache.shape)}), got {page_size}"
            )
    if mla and v is not None:
        raise ValueError(f"v: expected None for MLA (k_nope is the compressed kv), got {describe(v)}")
    if not mla and v is None:
        raise ValueError("v: expected a (nnz, num_kv_heads, head_dim) tensor for GQA / MHA, got None")
    if not isinstance(q_rope, torch.Tensor):
        raise ValueError(f"q_rope: expected (nnz, num_qo_heads, rope_dim), got {describe(q_rope)}")
    slots = _page_slots(
        kv_indices, kv_indptr, batch_indices, positions, page_size, cache_0.shape[0], q_rope.shape[0],
        cache_0.device,
    )  # fmt: skip
    # q first, into new tensors: the caller's q_rope_out / q_nope_out are filled only once the caches are.
    q_rope_8, _, q_nope_8, _ = rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, dtype, quant_scale_q, quant_scale_kv,
        None, None, None, None, enable_pdl, backend=backend,
    )  # fmt: skip
    _check_out(q_rope_out, q_rope_8, "q_rope_out")
    _check_out(q_nope_out, q_nope_8, "q_nope_out")
    cos, sin = _tables(cos_sin_cache)
    scale = _scale("quant_scale_kv", quant_scale_kv)
    common = dict(
        slot_mapping=slots,
        positions=pos_ids,
        interleaved=not is_neox,
        k_scale=scale,
        v_scale=scale,
        backend=backend,
    )
    if mla:
        ckv_cache, kpe_cache = cache_0, cache_1
        # kpe holds the rotated k_rope, ckv the scaled k_nope: one head each, as "nhd" caches.
        with peer_names(_MLA_NAMES):
            apply_rotary_qk_and_cache(
                None, k_rope[:, None], k_nope[:, None], cos, sin, k_cache=kpe_cache[:, :, None],
                v_cache=ckv_cache[:, :, None], cache_layout="nhd", **common,
            )  # fmt: skip
    else:
        k_full = k_rope if k_nope is None or k_nope.shape[-1] == 0 else torch.cat([k_rope, k_nope], dim=-1)
        with peer_names(_GQA_NAMES):
            apply_rotary_qk_and_cache(
                None, k_full, v, cos, sin, k_cache=cache_0, v_cache=cache_1, cache_layout=_LAYOUTS[kv_layout],
                **common,
            )  # fmt: skip
    return _store(q_rope_out, q_rope_8, "q_rope_out"), _store(q_nope_out, q_nope_8, "q_nope_out")


def _page_slots(
    kv_indices: object,
    kv_indptr: object,
    batch_indices: object,
    positions: object,
    page_size: int,
    num_pages: int,
    nnz: int,
    device: torch.device,
) -> torch.Tensor:
    """Each token's flat slot from FlashInfer's page table, (nnz,) int64: token i goes to page
    ``kv_indices[kv_indptr[b] + positions[i] // page_size]`` (b = batch_indices[i]), entry
    ``positions[i] % page_size``.

    Every value is checked first, so that no token lands in another request's page or outside the caches:
    kv_indptr non-decreasing offsets into kv_indices; the pages of the requests' ranges within the caches;
    each batch index one of the requests; each position >= 0 and within its request's pages. On the host for
    CPU tensors (a ValueError naming the argument); with a device-side assert otherwise (no host sync: the
    indices are then clamped so that nothing is read or written outside its tensor).
    """
    named = (("kv_indices", kv_indices), ("kv_indptr", kv_indptr), ("batch_indices", batch_indices),
             ("positions", positions))  # fmt: skip
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not _is_integer(t) or t.dim() != 1:
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {describe(t)}")
        if t.device != device:
            raise ValueError(
                f"{name}: expected a tensor on the caches' device {device}, got one on {t.device}"
            )
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        if t.shape[0] != nnz:
            raise ValueError(f"{name}: expected one entry per token ({nnz}), got shape {tuple(t.shape)}")
    if kv_indptr.shape[0] == 0:
        raise ValueError("kv_indptr: expected (batch_size + 1,) offsets into kv_indices, got an empty tensor")
    # int64 throughout: slot ids (page * page_size) can pass 2^31.
    indices, indptr, batch, pos = (t.long() for t in (kv_indices, kv_indptr, batch_indices, positions))
    requests, length = indptr.shape[0] - 1, indices.shape[0]
    if device.type == "cpu" and not is_compiling():
        _check_page_table(indices, indptr, batch, pos, page_size, num_pages)
    else:
        used = torch.arange(length, device=device)
        used = (used >= indptr[0]) & (used < indptr[-1])  # (length,): the entries some request owns
        ok = (indptr[0] >= 0) & (indptr[-1] <= length) & (indptr.diff() >= 0).all()
        ok &= (~used | ((indices >= 0) & (indices < num_pages))).all()
        ok &= ((batch >= 0) & (batch < requests)).all()
        batch = batch.clamp(0, max(requests - 1, 0))
        if requests:
            pages = indptr[batch + 1] - indptr[batch]  # (nnz,) pages of each token's request
            ok &= ((pos >= 0) & (pos < pages * page_size)).all()
        torch._assert_async(
            ok, "ropekit: the page table (kv_indices, kv_indptr, batch_indices, positions) addresses a page "
            "outside the token's request or the caches",
        )  # fmt: skip
        pos = pos.clamp(min=0)
        indptr = indptr.clamp(0, max(length - 1, 0))
    if nnz == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    table_index = indptr[batch] + pos // page_size  # (nnz,)
    if device.type != "cpu" or is_compiling():
        table_index = table_index.clamp(0, max(length - 1, 0))
        return indices[table_index].clamp(0, num_pages - 1) * page_size + pos % page_size
    return indices[table_index] * page_size + pos % page_size


def _is_integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _check_page_table(
    indices: torch.Tensor,
    indptr: torch.Tensor,
    batch: torch.Tensor,
    pos: torch.Tensor,
    page_size: int,
    num_pages: int,
) -> None:
    """The host check of :func:`_page_slots` (int64 CPU tensors), each failure a ValueError naming the
    argument, the first bad value and what was expected."""
    bounds = indptr.tolist()
    length = indices.shape[0]
    if bounds[0] < 0 or bounds[-1] > length or any(b < a for a, b in itertools.pairwise(bounds)):
        raise ValueError(
            f"kv_indptr: expected non-decreasing offsets into kv_indices, from >= 0 to <= {length} (its "
            f"length), got {bounds[:8]}{'...' if len(bounds) > 8 else ''}"
        )
    used = indices[bounds[0] : bounds[-1]]
    bad = ((used < 0) | (used >= num_pages)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"kv_indices: expected page ids in [0, {num_pages}) (the caches' pages), got {int(used[i])} at "
            f"index {bounds[0] + i}"
        )
    requests = len(bounds) - 1
    bad = ((batch < 0) | (batch >= requests)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"batch_indices: expected request ids in [0, {requests}) (the intervals of kv_indptr), got "
            f"{int(batch[i])} (token {i})"
        )
    if batch.numel():
        limit = (indptr[batch + 1] - indptr[batch]) * page_size  # (nnz,) positions each request's pages hold
        bad = ((pos < 0) | (pos >= limit)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(
                f"positions: expected 0 <= position < page_size * (pages of the token's request) = "
                f"{int(limit[i])}, got {int(pos[i])} (token {i}, request {int(batch[i])})"
            )
