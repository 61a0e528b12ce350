"""Argument checks shared by every layer. Each raises a ValueError naming the argument, the value and what was
expected; none ever asserts. Data-dependent checks (that read tensor values) are skipped while torch.compile
traces, so they never break the graph; eager calls always run them."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from ropekit.dtensor_inputs import local

__all__ = [
    "NUMERICS",
    "SUPPORTED_DTYPES",
    "InPlaceError",
    "byte_extent",
    "check_base",
    "check_bool",
    "check_disjoint",
    "check_even",
    "check_fraction",
    "check_grid_thw",
    "check_head_dim",
    "check_in_place_allowed",
    "check_int",
    "check_movable",
    "check_no_alias",
    "check_number",
    "check_numerics",
    "check_positive",
    "check_rotary_dim",
    "check_rotary_position",
    "check_seconds_per_grid",
    "check_table_pair",
    "check_tables",
    "check_writable",
    "check_x",
    "describe",
    "is_compiling",
    "shares_memory",
]


# Storage dtypes the rotation serves: every backend computes in float32 (float64 for float64) and rounds once.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The rotation's arithmetic (docs/numerics-modes.md): "exact" rounds once, at the output; "hf" and "vllm"
# round to the input's dtype after each product and sum, as transformers' eager apply_rotary_pos_emb and
# vLLM's forward_native compute in bfloat16 / float16 (the two differ only in the table their peers pass).
NUMERICS = ("exact", "hf", "vllm")


def is_compiling() -> bool:
    """True while torch.compile / dynamo traces; value checks are skipped then."""
    return torch.compiler.is_compiling()


def describe(value: Any) -> str:
    """A short description of a received value for error messages: tensors by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    expected: str = "a positive integer",
) -> int:
    """value must be an integer (Python or NumPy, never a bool) in [minimum, maximum]; returns an int."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        raise ValueError(f"{name}: expected {expected}, got {describe(value)}")
    return int(value)


def check_even(name: str, value: Any) -> int:
    """value must be a positive even integer (a rotated width: features come in pairs)."""
    value = check_int(name, value, expected="a positive even integer")
    if value % 2:
        raise ValueError(f"{name}: expected a positive even integer, got {value!r}")
    return value


def check_fraction(name: str, value: Any) -> float:
    """value must be a number in (0, 1] (a share of the head width, such as partial_rotary_factor)."""
    if not _is_finite_real(value) or not 0 < value <= 1:
        raise ValueError(f"{name}: expected a number in (0, 1], got {describe(value)}")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """value must be a bool (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected a bool, got {describe(value)}")
    return value


def check_rotary_position(value: Any, describe: Callable[[Any], str] = describe) -> str:
    """value must be 'first' or 'last': where the rotated features sit in each head (the one rule of the
    torch, JAX and MLX paths; ``describe`` renders a received value, arrays included)."""
    if not isinstance(value, str) or value not in ("first", "last"):
        raise ValueError(
            f"rotary_position: expected 'first' (rotated features lead each head) or 'last' (they end it, "
            f"NoPE first), got {describe(value)}"
        )
    return value


def check_numerics(value: Any) -> str:
    """value must be one of :data:`NUMERICS`: whose bits the rotation gives (docs/numerics-modes.md)."""
    if type(value) is not str or value not in NUMERICS:
        raise ValueError(
            f"numerics: expected 'exact' (one rounding, at the output), 'hf' (transformers' eager bits) or "
            f"'vllm' (vLLM's forward_native bits), got {describe(value)}"
        )
    return value


def _is_finite_real(value: Any) -> bool:
    """A finite real number; a bool or a string is not a number here."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_number(name: str, value: Any, *, minimum: float) -> float:
    """value must be a finite real number >= minimum; returns it as a float."""
    if not _is_finite_real(value) or value < minimum:
        raise ValueError(f"{name}: expected a finite number >= {minimum:g}, got {describe(value)}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """value must be a finite real number > 0; returns it as a float."""
    if not _is_finite_real(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0, got {describe(value)}")
    return float(value)


def check_base(base: Any) -> float:
    """base must be a finite real number > 1."""
    if not _is_finite_real(base) or base <= 1:
        raise ValueError(f"base: expected a finite number > 1, got {describe(base)}")
    return float(base)


def check_head_dim(head_dim: Any) -> int:
    """head_dim must be a positive integer."""
    return check_int("head_dim", head_dim, minimum=1, expected="a positive integer")


def check_rotary_dim(rotary_dim: Any, head_dim: int) -> int:
    """rotary_dim must be a positive even integer no larger than head_dim."""
    expected = f"a positive even integer <= head_dim ({head_dim})"
    rotary_dim = check_int("rotary_dim", rotary_dim, minimum=1, expected=expected)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim: expected {expected}, got {rotary_dim!r}")
    return rotary_dim


def check_x(name: str, x: Any, *, varlen: bool) -> None:
    """x is (batch, seq, heads, head_dim), or (total_tokens, heads, head_dim) with cu_seqlens."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {describe(x)}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name}: expected a float16, bfloat16, float32 or float64 tensor, got dtype {x.dtype}"
        )
    want = 3 if varlen else 4
    if x.dim() != want:
        if varlen:
            expected = "(total_tokens, heads, head_dim) when cu_seqlens is given"
        elif x.dim() in (2, 3):
            expected = "(batch, seq, heads, head_dim); a packed 3-D input needs cu_seqlens"
        else:
            expected = "(batch, seq, heads, head_dim)"
        raise ValueError(f"{name}: expected a {want}-D tensor {expected}, got shape {tuple(x.shape)}")


def _check_float_tensor(name: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point torch.Tensor, got {describe(t)}")


def _check_same_shape(cos: torch.Tensor, sin: torch.Tensor) -> None:
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin: expected the same shape, got cos {tuple(cos.shape)} and sin {tuple(sin.shape)}"
        )


def check_table_pair(cos: Any, sin: Any) -> None:
    """cos and sin are floating-point tensors of one shape (any rank: tables or per-token rows)."""
    _check_float_tensor("cos", cos)
    _check_float_tensor("sin", sin)
    _check_same_shape(cos, sin)


def check_tables(cos: Any, sin: Any, head_dim: int) -> int:
    """cos, sin: same shape (table_len, rotary_dim // 2) with rotary_dim <= head_dim. Returns rotary_dim."""
    for name, t in (("cos", cos), ("sin", sin)):
        _check_float_tensor(name, t)
        if t.dim() != 2:
            raise ValueError(
                f"{name}: expected shape (table_len, rotary_dim // 2), got shape {tuple(t.shape)}"
            )
    _check_same_shape(cos, sin)
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0 or rotary_dim > head_dim:
        raise ValueError(
            f"cos: table width {cos.shape[1]} means rotary_dim {rotary_dim}; expected 0 < rotary_dim <= "
            f"head_dim ({head_dim})"
        )
    if cos.device != sin.device or cos.dtype != sin.dtype:
        raise ValueError(
            f"cos and sin: expected one device and dtype, got cos {cos.dtype} on {cos.device} and "
            f"sin {sin.dtype} on {sin.device}"
        )
    return rotary_dim


def check_movable(name: str, t: Any, device: torch.device, *, where: str = "x's device") -> None:
    """t (if a tensor) can be moved to device (``where`` says whose it is, for the message): a meta tensor
    has no values to copy anywhere but meta. PyTorch would raise NotImplementedError ("Cannot copy out of
    meta tensor") from inside the call."""
    if isinstance(t, torch.Tensor) and t.is_meta and device.type != "meta":
        raise ValueError(
            f"{name}: expected a tensor with values, on {where} {device}, got a meta tensor (shape "
            f"{tuple(t.shape)}: no data); build it on {device}, or fill it after to_empty()"
        )


def check_writable(name: str, x: torch.Tensor) -> None:
    """x is written in place: no two of its elements may share memory (an expanded or stride-0 view would be
    rotated once per alias). The same rule, in nearly the same words, as PyTorch's ``add_`` on such a view."""
    x = local(x)  # a DTensor: the shard this rank writes
    if is_compiling():  # torch's overlap query is not traceable: catch the common case, a stride-0 axis
        overlapping = x.numel() > 1 and any(
            n > 1 and s == 0 for n, s in zip(x.shape, x.stride(), strict=True)
        )
    else:  # 1: provably overlapping; 2: too hard to tell (as torch, which refuses 1 only)
        overlapping = torch._debug_has_internal_overlap(x) == 1
    if overlapping:
        raise ValueError(
            f"{name}: inplace=True needs a tensor whose elements do not share memory, got shape "
            f"{tuple(x.shape)} with strides {x.stride()} (an expanded or stride-0 view: more than one "
            f"element refers to a single memory location); clone() it first or pass inplace=False"
        )


class InPlaceError(ValueError, RuntimeError):
    """An in-place write PyTorch itself refuses (a leaf that requires grad, a view of one, an inference tensor
    outside inference mode). A ValueError like every argument error of ropekit, and the RuntimeError PyTorch
    raises for the same write, so code written for PyTorch's in-place ops catches it as it did."""


def check_in_place_allowed(name: str, t: torch.Tensor) -> None:
    """t is about to be written in place: refuse, before anything is written, what PyTorch's in-place ops
    refuse (their checks run before the kernel; ropekit's kernels write through pointers, so it asks first).

    Raises:
        InPlaceError: naming t and what PyTorch would say.
    """
    compiling = is_compiling()  # views and inference tensors are not traced as such: PyTorch checks the graph
    if not compiling and local(t).is_inference() and not torch.is_inference_mode_enabled():
        raise InPlaceError(
            f"{name}: an inference tensor (made under torch.inference_mode()) cannot be written in place "
            f"outside inference mode, as PyTorch refuses any in-place op on it; write it inside "
            f"torch.inference_mode(), or pass {name}.clone()"
        )
    if not t.requires_grad or not torch.is_grad_enabled():
        return
    if t.is_leaf:
        raise InPlaceError(
            f"{name}: inplace=True on a leaf tensor that requires grad would overwrite the value autograd "
            f"differentiates with respect to; pass {name}.clone() or inplace=False"
        )
    if compiling:
        return
    base = t._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise InPlaceError(
            f"{name}: a view of a leaf tensor that requires grad cannot be written in place (PyTorch refuses "
            f"it: the write would change the leaf); pass {name}.clone() or inplace=False"
        )


def check_disjoint(
    name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, *, optional: bool = True
) -> None:
    """a and b are both written in place: they must not share an element (e.g. q and k the same tensor).

    Views of one packed buffer (q and k slices of a fused qkv projection) are fine and pass. While
    torch.compile traces, storage identity is not traceable: only one tensor passed twice is caught then, and
    the kernels' ops check the rest as the graph runs. optional=False: the writes are the call's purpose (a
    cache), not an inplace=True the caller could turn off."""
    shared = (a is b) if is_compiling() else shares_memory(a, b)
    if shared:
        verb, fix = ("inplace=True writes", " or inplace=False") if optional else ("the call writes", "")
        raise ValueError(
            f"{name_b}: {verb} {name_a} and {name_b}, which share memory (shapes {tuple(a.shape)} and "
            f"{tuple(b.shape)}, strides {a.stride()} and {b.stride()}); pass disjoint tensors{fix}"
        )


Named = tuple[str, Any]  # (the argument's name, a tensor or None)


def check_no_alias(written: tuple[Named, ...], read: tuple[Named, ...], *, optional: bool = True) -> None:
    """The memory rule of every op (docs/safety.md): a tensor the op writes may share memory with no tensor
    it reads and no other tensor it writes, except when it is written exactly in place of its own source.

    Args:
        written: (name, tensor) for each tensor written (an output, an input rotated in place, a cache).
        read: (name, tensor) for each tensor read (tables, sources, weights, scales, positions, slots). A
            tensor rotated in place is read as its own source: list it in both under one name, and that one
            pair (the same elements, same layout) is allowed. Entries that are not tensors (None, a float
            scale) are skipped.
        optional: the writes come from an ``inplace=True`` the caller could turn off (the message says so);
            False for writes that are the call's purpose (caches).

    Decided from where the elements lie in memory (data pointers, strides, element sizes), never from which
    storage object holds them: two ``torch.from_numpy`` of one array are two storages over one memory. Each
    call decides afresh. While torch.compile traces, memory is not traceable: only one tensor passed twice is
    caught then (the kernels' ops check as the graph runs).

    Raises:
        ValueError: naming the written tensor and the one it shares memory with.
    """
    if is_compiling():  # only a tensor passed twice is visible to a trace
        for i, (w_name, w) in enumerate(written):
            for j, (r_name, r) in enumerate((*written[i + 1 :], *read)):
                if r is w and isinstance(w, torch.Tensor) and r_name != w_name:
                    _refuse(w_name, w, r_name, r, optional, written=j < len(written) - i - 1)
        return
    spans = {id(t): _span(t) for _, t in (*written, *read) if isinstance(t, torch.Tensor)}
    for i, (w_name, w) in enumerate(written):
        w_span = spans.get(id(w))
        if w_span is None:
            continue
        for j, (r_name, r) in enumerate((*written[i + 1 :], *read)):
            r_span = spans.get(id(r))
            if r_span is None or r_span[0] != w_span[0] or r_span[2] < w_span[1] or w_span[2] < r_span[1]:
                continue  # no memory, another device, or separate byte ranges: the common case
            is_written = j < len(written) - i - 1
            if not is_written and r_name == w_name and _same_elements(w, r):
                continue  # written exactly in place of its own source
            if shares_memory(w, r):
                _refuse(w_name, w, r_name, r, optional, written=is_written)


def _refuse(w_name, w, r_name, r, optional: bool, *, written: bool) -> None:
    if written:
        check_disjoint(w_name, w, r_name, r, optional=optional)  # raises, in its own words
    raise ValueError(
        f"{w_name}: it is written and shares memory with {r_name}, which the call reads ({w_name} "
        f"{tuple(w.shape)} with strides {w.stride()}, {r_name} {tuple(r.shape)} with strides {r.stride()}); "
        f"a written tensor may overlap only itself, written in place: pass {r_name}.clone() or a separate "
        f"{w_name}"
    )


def _span(t: torch.Tensor) -> tuple[torch.device, int, int] | None:
    """(device, first byte, last byte) of t's elements; None when t has no memory (meta, empty)."""
    if type(t) is not torch.Tensor:
        t = local(t)  # a DTensor: the shard this rank holds
    if t.is_meta or t.numel() == 0:
        return None
    first, last = t.data_ptr(), 0
    for n, s in zip(t.shape, t.stride(), strict=True):  # byte_extent, inlined: this runs for every tensor
        last += (n - 1) * s
    size = t.element_size()
    return t.device, first, first + last * size + size - 1


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same elements laid out the same way (a tensor and its own view as itself)."""
    if a is b:
        return True
    a, b = local(a), local(b)
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.device == b.device
    )


def _byte_dims(t: torch.Tensor) -> list[tuple[int, int]]:
    """t's elements as a lattice of bytes: (stride in bytes, count) per axis that moves (count > 1, stride >
    0), plus the bytes of one element (stride 1); sorted by stride."""
    size = t.element_size()
    dims = [(s * size, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1 and s]
    return sorted(dims + ([(1, size)] if size > 1 else []))


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two strided tensors (each without internal overlap) touch a common byte of memory.

    Decided from addresses alone: each tensor's first byte (``data_ptr``), its strides and its element size.
    Separate byte ranges (the common case) answer at once; tensors whose ranges meet (views of one buffer,
    or two storages over one memory) are solved exactly."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:
        a, b = local(a), local(b)  # a DTensor: the shard this rank holds
    if a.is_meta or b.is_meta or a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False  # meta tensors have no memory; each device has its own
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    a_hi, b_hi = a_lo + byte_extent(a), b_lo + byte_extent(b)
    if a_hi < b_lo or b_hi < a_lo:
        return False  # the common case: separate byte ranges
    dims_a, dims_b = _byte_dims(a), _byte_dims(b)
    if [s for s, _ in dims_a] == [s for s, _ in dims_b]:
        # Same strides (views of one buffer): a's index i and b's index j meet where sum (i_d - j_d) s_d =
        # b_start - a_start, so c_d = i_d - j_d runs over -(nb_d - 1) .. na_d - 1. Solved exactly by a short
        # depth-first search, largest stride first.
        ranges = [(s, -(nb - 1), na - 1) for (s, na), (_, nb) in zip(dims_a, dims_b, strict=True)][::-1]
        found = _solve(b_lo - a_lo, ranges, budget=[4096])
        if found is not None:
            return found
    # Anything else: mark a's bytes and look for one of b's (rare; costs one pass over the span).
    lo, hi = min(a_lo, b_lo), max(a_hi, b_hi)
    marks = torch.zeros(hi - lo + 1, dtype=torch.bool, device=a.device)
    marks.as_strided([n for _, n in dims_a], [s for s, _ in dims_a], a_lo - lo).fill_(True)
    return bool(marks.as_strided([n for _, n in dims_b], [s for s, _ in dims_b], b_lo - lo).any())


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from t's first byte to its last (strides are never negative in torch): t's elements lie in
    ``[t.data_ptr(), t.data_ptr() + byte_extent(t)]``."""
    last = 0
    for n, s in zip(t.shape, t.stride(), strict=True):  # a loop, not sum(generator): a frame fewer per call
        last += (n - 1) * s
    size = t.element_size()
    return last * size + size - 1


def _solve(residual: int, ranges: list[tuple[int, int, int]], budget: list[int]) -> bool | None:
    """Whether residual = sum c_d s_d for integers lo_d <= c_d <= hi_d ((s_d, lo_d, hi_d) in ranges, strides
    descending); None if the search budget runs out."""
    if not ranges:
        return residual == 0
    budget[0] -= 1
    if budget[0] < 0:
        return None
    (stride, lo, hi), rest = ranges[0], ranges[1:]
    reach = sum(s * max(-l, h) for s, l, h in rest)  # |sum over the smaller strides| is at most this
    first, last = max(lo, -((reach - residual) // stride)), min(hi, (residual + reach) // stride)
    for c in range(first, last + 1):
        found = _solve(residual - c * stride, rest, budget)
        if found is not False:
            return found
    return False


def check_grid_thw(name: str, grid_thw: Any) -> torch.Tensor | None:
    """A Qwen-VL / Qwen3-Omni ``image_grid_thw`` or ``video_grid_thw``: None, or an integer (count, 3)
    tensor of positive (t, h, w) rows, returned as int64 on the host (:mod:`ropekit.rope_index`,
    :mod:`ropekit.rope_index_omni`)."""
    if grid_thw is None:
        return None
    if not isinstance(grid_thw, torch.Tensor) or grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:
        raise ValueError(f"{name}: expected an integer tensor of shape (count, 3), got {describe(grid_thw)}")
    if grid_thw.is_floating_point() or grid_thw.is_complex() or (grid_thw.numel() and grid_thw.min() < 1):
        raise ValueError(f"{name}: expected positive integer (t, h, w) rows, got {grid_thw.tolist()}")
    return grid_thw.to("cpu", torch.int64)


def check_seconds_per_grid(second_per_grid_ts: Any) -> torch.Tensor:
    """second_per_grid_ts on the host, each a finite number >= 0 (Qwen2.5-VL, Qwen3-Omni).

    nan or inf seconds made frame positions of -2^63 (Qwen2.5-VL) or NaN (Qwen3-Omni); negative ones run time
    backwards.
    """
    check_movable("second_per_grid_ts", second_per_grid_ts, torch.device("cpu"), where="the host device")
    seconds = torch.as_tensor(second_per_grid_ts).cpu()
    if seconds.is_complex() or not bool(seconds.isfinite().all() & (seconds >= 0).all()):
        raise ValueError(
            f"second_per_grid_ts: expected finite numbers >= 0 (seconds per temporal patch), got "
            f"{seconds.reshape(-1).tolist()[:8]}"
        )
    return seconds
