"""ropekit.compat.flashinfer against FlashInfer's documented semantics (flashinfer/rope.py, pos_enc.cuh):
stored = fp8(value * quant_scale) saturated, [cos | sin] caches, MLA 2-D keys, the page-table append.

FlashInfer itself needs a GPU, so the expected values are its formulas written with torch ops; power-of-two
scales make ``r * s`` and ropekit's ``r / (1 / s)`` the same float32 number, so the bytes must match exactly.
"""

from __future__ import annotations

import re

import pytest
import torch

from call_count import ropekit_calls
from ropekit.backends import BACKENDS
from ropekit.backends.plan import clear_plans
from ropekit.compat import flashinfer, vllm

FP8 = torch.float8_e4m3fn


def _cache(rope_dim: int = 8, length: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    angle = torch.rand(length, rope_dim // 2, generator=g) * 6.0
    return torch.cat([angle.cos(), angle.sin()], dim=-1)  # (max_seq_len, rope_dim): [cos | sin]


def _rotated(x: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """The float32 rotation of x (nnz, H, D) at pos, as ropekit's torch backend computes it."""
    half = cache.shape[1] // 2
    out, _ = BACKENDS["torch"].rotate_qk(
        x.float(), None, cache[:, :half], cache[:, half:], pos, interleaved=not is_neox, conjugate=False,
        inplace=False,
    )  # fmt: skip
    return out


def _fp8(x: torch.Tensor, quant_scale: float, dtype=FP8) -> torch.Tensor:
    fmax = torch.finfo(dtype).max
    return (x.float() * quant_scale).clamp(-fmax, fmax).to(dtype).view(torch.uint8)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rope_quantize_fp8_multiplies_by_the_quant_scale(is_neox, dtype):
    g = torch.Generator().manual_seed(1)
    q_rope, k_rope = torch.randn(5, 4, 8, generator=g) * 50, torch.randn(5, 2, 8, generator=g)
    q_nope, k_nope = torch.randn(5, 4, 6, generator=g), torch.randn(5, 2, 6, generator=g)
    cache, pos = _cache(), torch.tensor([0, 3, 9, 40, 63])
    outs = flashinfer.rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cache, pos, is_neox=is_neox, quantize_dtype=dtype, quant_scale_q=4.0,
        quant_scale_kv=0.5,
    )  # fmt: skip
    want = [
        _fp8(_rotated(q_rope, cache, pos, is_neox), 4.0, dtype),
        _fp8(_rotated(k_rope, cache, pos, is_neox), 0.5, dtype),
        _fp8(q_nope, 4.0, dtype),
        _fp8(k_nope, 0.5, dtype),
    ]
    assert all(o.dtype == dtype for o in outs)
    for got, w in zip(outs, want, strict=True):
        assert torch.equal(got.view(torch.uint8), w)


def test_mla_keys_are_2d_and_preallocated_outputs_are_filled():
    g = torch.Generator().manual_seed(2)
    q_rope, k_rope = torch.randn(3, 4, 8, generator=g), torch.randn(3, 8, generator=g)
    q_nope, k_nope = torch.randn(3, 4, 16, generator=g), torch.randn(3, 16, generator=g)
    cache, pos = _cache(), torch.tensor([1, 2, 30])
    k_out = torch.empty(3, 8, dtype=FP8)
    outs = flashinfer.mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cache, pos, k_rope_out=k_out)
    assert outs[1] is k_out and outs[1].shape == (3, 8) and outs[3].shape == (3, 16)
    assert torch.equal(k_out.view(torch.uint8), _fp8(_rotated(k_rope[:, None], cache, pos, True), 1.0)[:, 0])
    with pytest.raises(ValueError, match="k_rope: expected the MLA layout"):
        flashinfer.mla_rope_quantize_fp8(q_rope, k_rope[:, None], q_nope, k_nope, cache, pos)


@pytest.mark.c_compiler
def test_a_steady_mla_step_takes_the_fp8_plan_and_equals_its_first_call():
    """Issue 25: FlashInfer's call reaches apply_rotary_qk_fp8's gate (positions per token, the MLA nope
    parts): a repeated step is the plan's run, byte for byte the checked path's answer."""
    g = torch.Generator().manual_seed(3)
    q_rope, k_rope = torch.randn(3, 4, 8, generator=g), torch.randn(3, 8, generator=g)
    q_nope, k_nope = torch.randn(3, 4, 16, generator=g), torch.randn(3, 16, generator=g)
    cache, pos = _cache(), torch.tensor([1, 2, 30])
    step = lambda: flashinfer.mla_rope_quantize_fp8(  # noqa: E731
        q_rope, k_rope, q_nope, k_nope, cache, pos, quant_scale_q=0.5, quant_scale_kv=2.0, backend="cpu"
    )
    clear_plans()
    first = step()  # the checked path, which keeps the plan
    got = []
    calls = ropekit_calls(lambda: got.append(step()))
    assert "run" in calls and "check_scale" not in calls and "resolve" not in calls, calls
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[0], first, strict=True)
    )


def test_none_nope_parts_are_empty_and_bad_scales_are_refused():
    q_rope, k_rope = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    outs = flashinfer.rope_quantize_fp8(q_rope, k_rope, None, None, _cache(), torch.tensor([0, 1]))
    assert outs[2].shape == (2, 2, 0) and outs[3].shape == (2, 1, 0)
    with pytest.raises(ValueError, match="quant_scale_q"):
        flashinfer.rope_quantize_fp8(
            q_rope, k_rope, None, None, _cache(), torch.tensor([0, 1]), quant_scale_q=0.0
        )
    with pytest.raises(ValueError, match="cos_sin_cache"):
        flashinfer.rope_quantize_fp8(q_rope, k_rope, None, None, _cache().double(), torch.tensor([0, 1]))


def _page_table():
    """Two requests: 3 tokens at positions 0-2 (pages [4]) and 2 tokens at positions 17-18 (pages [1, 6])."""
    kv_indices = torch.tensor([4, 1, 6], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
    batch_indices = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 17, 18], dtype=torch.int32)
    slots = torch.tensor([4 * 16 + 0, 4 * 16 + 1, 4 * 16 + 2, 6 * 16 + 1, 6 * 16 + 2])
    return kv_indices, kv_indptr, batch_indices, positions, slots


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_append_writes_the_full_key_and_v_at_the_page_table_slots(kv_layout):
    g = torch.Generator().manual_seed(3)
    q_rope, k_rope, k_nope = (torch.randn(5, h, d, generator=g) for h, d in ((4, 8), (2, 8), (2, 4)))
    v = torch.randn(5, 2, 12, generator=g)
    cache, pos = _cache(), torch.tensor([0, 1, 2, 17, 18])
    shape = (8, 16, 2, 12) if kv_layout == "NHD" else (8, 2, 16, 12)
    k_cache, v_cache = torch.zeros(shape, dtype=FP8), torch.zeros(shape, dtype=FP8)
    kv_indices, kv_indptr, batch_indices, positions, slots = _page_table()
    q8, q_nope8 = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, None, k_nope, v, cache, pos, (k_cache, v_cache), kv_indices, kv_indptr, batch_indices,
        positions, quant_scale_q=2.0, quant_scale_kv=0.25, kv_layout=kv_layout,
    )  # fmt: skip
    assert torch.equal(q8.view(torch.uint8), _fp8(_rotated(q_rope, cache, pos, True), 2.0))
    assert q_nope8.shape == (5, 4, 0)
    flat = (lambda c: c.flatten(0, 1)) if kv_layout == "NHD" else (lambda c: c.transpose(1, 2).flatten(0, 1))
    k_full = torch.cat([_rotated(k_rope, cache, pos, True), k_nope], dim=-1)
    assert torch.equal(flat(k_cache).view(torch.uint8)[slots], _fp8(k_full, 0.25))
    assert torch.equal(flat(v_cache).view(torch.uint8)[slots], _fp8(v, 0.25))
    others = torch.ones(8 * 16, dtype=torch.bool)
    others[slots] = False
    assert not flat(k_cache).view(torch.uint8)[others].any()


def test_mla_append_fills_kpe_and_ckv_caches():
    g = torch.Generator().manual_seed(4)
    q_rope, q_nope = torch.randn(5, 4, 8, generator=g), torch.randn(5, 4, 16, generator=g)
    k_rope, k_nope = torch.randn(5, 8, generator=g), torch.randn(5, 16, generator=g)
    cache, pos = _cache(), torch.tensor([0, 1, 2, 17, 18])
    ckv, kpe = torch.zeros(8, 16, 16, dtype=FP8), torch.zeros(8, 16, 8, dtype=FP8)
    kv_indices, kv_indptr, batch_indices, positions, slots = _page_table()
    flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, None, cache, pos, (ckv, kpe), kv_indices, kv_indptr, batch_indices,
        positions,
    )  # fmt: skip
    assert torch.equal(
        kpe.flatten(0, 1).view(torch.uint8)[slots],
        _fp8(_rotated(k_rope[:, None], cache, pos, True), 1.0)[:, 0],
    )
    assert torch.equal(ckv.flatten(0, 1).view(torch.uint8)[slots], _fp8(k_nope, 1.0))


def test_append_refuses_bad_input_and_leaves_the_caches_alone():
    q_rope, k_rope, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cache, pos = _cache(), torch.tensor([0, 1, 2, 17, 18])
    k_cache, v_cache = torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8)
    kv_indices, kv_indptr, batch_indices, positions, _ = _page_table()
    args = (cache, pos, (k_cache, v_cache), kv_indices, kv_indptr, batch_indices, positions)
    with pytest.raises(ValueError, match="kv_layout"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, None, None, v, *args, kv_layout="NDH"
        )
    with pytest.raises(ValueError, match="v: expected"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, None, None, None, *args)
    with pytest.raises(ValueError, match="paged_kv_cache"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, None, None, v, *args, quantize_dtype=torch.float8_e5m2
        )
    with pytest.raises(ValueError, match=r"^kv_indices: "):  # a page index past the cache's 8 pages
        bad = (cache, pos, (k_cache, v_cache), torch.tensor([4, 1, 9]), kv_indptr, batch_indices, positions)
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, None, None, v, *bad)
    assert not k_cache.view(torch.uint8).any() and not v_cache.view(torch.uint8).any()


def test_apply_rope_with_cos_sin_cache_is_the_vllm_module_s():
    assert flashinfer.apply_rope_with_cos_sin_cache is vllm.apply_rope_with_cos_sin_cache
    assert flashinfer.apply_rope_with_cos_sin_cache_inplace is vllm.apply_rope_with_cos_sin_cache_inplace


@pytest.mark.parametrize("name", ["quant_scale_q", "quant_scale_kv"])
@pytest.mark.parametrize("bad", [1e300, 1e-300, float("inf"), float("nan"), 0.0, -1.0])
def test_a_quant_scale_is_checked_as_the_kernel_uses_it_and_named_as_flashinfer_names_it(name, bad):
    """Issue 24, defect 4: quant_scale_q=1e300 gave 1 / 1e300, 0 in float32, and NaN outputs without an
    error; inf was refused under ropekit's name q_scale with the value 0.0. The scale and its reciprocal
    must both be finite and > 0 in float32 (FlashInfer's kernels take the scale as a float32)."""
    q_rope, k_rope = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    with pytest.raises(ValueError, match=rf"^{name}: expected .*float32.*, got {re.escape(repr(bad))}"):
        flashinfer.rope_quantize_fp8(
            q_rope, k_rope, None, None, _cache(), torch.tensor([0, 1]), **{name: bad}
        )


def _append(kv_indices, kv_indptr, batch_indices, positions, *, page_size=16, caches=None, q_rope_out=None):
    """One GQA append of the 5 tokens of _page_table into zeroed (8, 16, 2, 8) caches; returns the caches
    and q_rope_out so a test can see that nothing was written."""
    q_rope, k_rope, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    if caches is None:
        caches = torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8)
    flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, None, None, v, _cache(), torch.tensor([0, 1, 2, 17, 18]), caches, kv_indices,
        kv_indptr, batch_indices, positions, page_size=page_size, q_rope_out=q_rope_out,
    )  # fmt: skip


BAD_PAGE_TABLES = {
    # Issue 24, defect 6: each wrote into another request's page or a page of no request, or was an IndexError
    "negative batch index wraps": ("batch_indices", dict(batch_indices=[0, 0, 0, -1, 1])),
    "batch index past kv_indptr": ("batch_indices", dict(batch_indices=[0, 0, 0, 2, 1])),
    "position -1": ("positions", dict(positions=[0, 1, -1, 17, 18])),
    "position past the request's pages": ("positions", dict(positions=[0, 1, 16, 17, 18])),
    "page index past the cache": ("kv_indices", dict(kv_indices=[4, 1, 8])),
    "negative page index": ("kv_indices", dict(kv_indices=[4, -1, 6])),
    "kv_indptr not monotone": ("kv_indptr", dict(kv_indptr=[0, 2, 1])),
    "kv_indptr past kv_indices": ("kv_indptr", dict(kv_indptr=[0, 1, 4])),
    "kv_indptr negative": ("kv_indptr", dict(kv_indptr=[-1, 1, 3])),
    "page_size not the caches'": ("page_size", dict(page_size=8)),
    "batch_indices of another length": ("batch_indices", dict(batch_indices=[0, 0, 0, 1])),
    "positions of another length": ("positions", dict(positions=[0, 1, 2, 17])),
}


@pytest.mark.parametrize("case", list(BAD_PAGE_TABLES))
def test_the_page_table_is_checked_against_the_caches_before_any_write(case):
    name, change = BAD_PAGE_TABLES[case]
    change = dict(change)  # shared with the next test
    kv_indices, kv_indptr, batch_indices, positions, _ = _page_table()
    args = dict(kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=batch_indices, positions=positions)
    page_size = change.pop("page_size", 16) if "page_size" in change else 16
    args.update({key: torch.tensor(value, dtype=torch.int32) for key, value in change.items()})
    caches = torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8)
    q_rope_out = torch.zeros(5, 4, 8, dtype=FP8)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        _append(**args, page_size=page_size, caches=caches, q_rope_out=q_rope_out)
    assert not any(c.view(torch.uint8).any() for c in (*caches, q_rope_out))


def test_caches_of_the_wrong_head_count_leave_the_callers_q_rope_out_unwritten():
    """Issue 24: the append filled the caller's q_rope_out, then raised for the caches' head count."""
    q_rope_out = torch.zeros(5, 4, 8, dtype=FP8)
    caches = torch.zeros(8, 16, 3, 8, dtype=FP8), torch.zeros(8, 16, 3, 8, dtype=FP8)
    with pytest.raises(ValueError, match=r"^paged_kv_cache\[0\]: "):
        _append(*_page_table()[:4], caches=caches, q_rope_out=q_rope_out)
    assert not q_rope_out.view(torch.uint8).any() and not any(c.view(torch.uint8).any() for c in caches)
    with pytest.raises(ValueError, match=r"^q_rope_out: "):  # and a bad q_rope_out leaves the caches alone
        _append(*_page_table()[:4], caches=(caches := (
            torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8))),
            q_rope_out=torch.zeros(5, 4, 7, dtype=FP8))  # fmt: skip
    assert not any(c.view(torch.uint8).any() for c in caches)


def test_the_device_side_page_table_check_agrees_with_the_host_one(monkeypatch):
    """CUDA tensors are checked with a device-side assert (no host sync). That branch is run here on the CPU
    (is_compiling forced, where torch._assert_async raises at once): the same slots for a good table, and
    every bad table of BAD_PAGE_TABLES whose values (not shapes) are wrong trips the assert."""
    from ropekit.compat import flashinfer as module

    kv_indices, kv_indptr, batch_indices, positions, slots = _page_table()
    args = (kv_indices, kv_indptr, batch_indices, positions, 16, 8, 5, torch.device("cpu"))
    assert torch.equal(module._page_slots(*args), slots)
    monkeypatch.setattr(module, "is_compiling", lambda: True)
    assert torch.equal(module._page_slots(*args), slots)
    for case, (_, change) in BAD_PAGE_TABLES.items():
        if "page_size" in case or "length" in case:
            continue  # checked from shapes, before any value
        table = dict(
            kv_indices=kv_indices, kv_indptr=kv_indptr, batch_indices=batch_indices, positions=positions
        )
        table.update({key: torch.tensor(value, dtype=torch.int32) for key, value in change.items()})
        with pytest.raises(RuntimeError, match="page table"):
            module._page_slots(*table.values(), 16, 8, 5, torch.device("cpu"))


def test_a_bad_preallocated_output_leaves_the_other_outputs_unwritten():
    """Every *_out is checked before the first is filled (q_rope_out was written, then k_rope_out refused)."""
    q_rope, k_rope = torch.randn(2, 2, 8) * 10, torch.randn(2, 1, 8) * 10
    q_out = torch.zeros(2, 2, 8, dtype=FP8)
    with pytest.raises(ValueError, match=r"^k_rope_out: expected a torch.float8_e4m3fn tensor of shape"):
        flashinfer.rope_quantize_fp8(
            q_rope, k_rope, None, None, _cache(), torch.tensor([0, 1]), q_rope_out=q_out,
            k_rope_out=torch.zeros(2, 1, 7, dtype=FP8),
        )  # fmt: skip
    assert not q_out.view(torch.uint8).any()


def test_append_with_caches_of_the_wrong_head_count_writes_nothing_not_even_q_rope_out():
    """Issue 24: caches of the wrong head count filled the caller's q_rope_out, then raised."""
    q_rope, k_rope, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cache, pos = _cache(), torch.tensor([0, 1, 2, 17, 18])
    k_cache, v_cache = (
        torch.zeros(8, 16, 3, 8, dtype=FP8),
        torch.zeros(8, 16, 3, 8, dtype=FP8),
    )  # 3 heads, not 2
    q_rope_out = torch.zeros(5, 4, 8, dtype=FP8)
    with pytest.raises(ValueError, match=r"paged_kv_cache\[0\]"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, None, None, v, cache, pos, (k_cache, v_cache), *_page_table()[:4],
            q_rope_out=q_rope_out,
        )  # fmt: skip
    assert not q_rope_out.view(torch.uint8).any()
    assert not k_cache.view(torch.uint8).any() and not v_cache.view(torch.uint8).any()


def test_a_bad_second_output_leaves_the_first_unwritten():
    q_rope, k_rope = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    q_rope_out = torch.zeros(5, 4, 8, dtype=FP8)
    with pytest.raises(ValueError, match="k_rope_out"):
        flashinfer.rope_quantize_fp8(
            q_rope, k_rope, None, None, _cache(), torch.arange(5), q_rope_out=q_rope_out,
            k_rope_out=torch.zeros(5, 3, 8, dtype=FP8),
        )  # fmt: skip
    assert not q_rope_out.view(torch.uint8).any()


def test_outputs_and_caches_that_share_memory_with_an_input_or_each_other_are_refused():
    """The memory rule on the compat surface: an output aliasing another output (or a cache aliasing the
    value it is written from) is a ValueError naming both, before anything is written."""
    q_rope, k_rope, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    both = torch.zeros(5, 4, 8, dtype=FP8)
    with pytest.raises(ValueError, match=r"k_rope_out: the call writes q_rope_out and k_rope_out"):
        flashinfer.rope_quantize_fp8(
            q_rope, k_rope, None, None, _cache(), torch.arange(5), q_rope_out=both, k_rope_out=both[:, :2],
        )  # fmt: skip
    assert not both.view(torch.uint8).any()
    k_cache, v_cache = torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8)
    q_rope_out = k_cache.view(-1)[: 5 * 4 * 8].view(5, 4, 8)
    with pytest.raises(
        ValueError, match=r"paged_kv_cache\[0\]: the call writes q_rope_out and paged_kv_cache\[0\]"
    ):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, None, None, v, _cache(), torch.tensor([0, 1, 2, 17, 18]), (k_cache, v_cache),
            *_page_table()[:4], q_rope_out=q_rope_out,
        )  # fmt: skip
    assert not k_cache.view(torch.uint8).any() and not v_cache.view(torch.uint8).any()


def test_append_bumps_the_caches_version_counters():
    """Every in-place path bumps what it wrote (issue 24: each path has its version test)."""
    q_rope, k_rope, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    k_cache, v_cache = torch.zeros(8, 16, 2, 8, dtype=FP8), torch.zeros(8, 16, 2, 8, dtype=FP8)
    q_rope_out = torch.zeros(5, 4, 8, dtype=FP8)
    versions = k_cache._version, v_cache._version, q_rope_out._version
    flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, None, None, v, _cache(), torch.tensor([0, 1, 2, 17, 18]), (k_cache, v_cache),
        *_page_table()[:4], q_rope_out=q_rope_out,
    )  # fmt: skip
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    assert q_rope_out._version > versions[2]
