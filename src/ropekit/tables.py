"""Tables in the forms other libraries hand around, read in place as a (rows, R/2) table plus positions.

The kernels take one form of table: rows of R/2 cos (and sin) values, row ``p`` for position ``p``, read with
a row stride. Two other forms are common, and both are that form seen differently, so they cost no copy:

* Full width, duplicated (Hugging Face, Megatron): rows of R values, each pair's angle written for both of the
  pair's features. With half pairing (GPT-NeoX / HF) the row is ``cat(freqs, freqs)`` and the first R/2 values
  are the table; with interleaved pairing (GPT-J / Cohere's ``repeat_interleave``) the row is
  ``[f0, f0, f1, f1, ...]`` and every second value is. Only those values are read: the duplicates are trusted
  to be duplicates, as in Liger's kernel.
* Per token (HF's ``cos[position_ids]``, what its rotary modules return): one row per token, already gathered,
  shaped like the tokens: (B, S, W), (1, S, W) or (S, W) for (B, S, H, D) input, (T, W) for packed (T, H, D).
  That is a table whose row ``b * S + s`` serves token (b, s): positions = arange. For (B, S, W) rows with
  row stride ``r``, ``reshape(B * S, W)`` is a view with the same row stride, so nothing moves.

Shape notation: B batch, S sequence, T packed tokens, W table width (R or R/2), R rotary_dim.
"""

from __future__ import annotations

import torch

from ropekit.validation import check_bool, check_movable, check_table_pair, check_tables, describe

__all__ = ["half_width", "per_token_table", "plain_tables", "row_starts", "token_tables"]

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack
# (batch, seq, device) -> arange(0, batch * seq, seq): where each batch row's per-token rows start in the
# flattened (B * S, W) table. Kept (a few per process), so a steady call builds no tensor.
_starts: dict[tuple, torch.Tensor] = {}


def half_width(
    cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the R/2 values per row that a full-width duplicated table (width R) holds once.

    interleaved=False reads ``[..., :R/2]`` (rows ``cat(freqs, freqs)``); interleaved=True reads
    ``[..., ::2]`` (rows ``freqs.repeat_interleave(2)``). Both are views: no copy.

    Raises:
        ValueError: if cos / sin are not floating-point tensors of one shape with an even, non-zero width.
    """
    check_table_pair(cos, sin)
    width = cos.shape[-1] if cos.dim() else 0
    if width == 0 or width % 2:
        raise ValueError(
            f"cos: a full-width table holds rotary_dim values per row, so its width must be even and > 0; "
            f"got shape {tuple(cos.shape)}"
        )
    if interleaved:
        return cos[..., ::2], sin[..., ::2]
    return cos[..., : width // 2], sin[..., : width // 2]


def per_token_table(
    cos: torch.Tensor,
    sin: torch.Tensor,
    tokens: tuple[int, ...],
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Turn per-token rows (half width) into a (rows, R/2) table and the positions that read it.

    Args:
        cos, sin: one row per token, width R/2: (B, S, R/2), (1, S, R/2) or (S, R/2) when ``tokens`` is
            (B, S); (T, R/2) when ``tokens`` is (T,). A batch axis of stride 0 (an ``expand``) counts as 1.
        tokens: the input's token axes, x.shape[:-2].
        head_dim: the input's head_dim (R must not exceed it).

    Returns:
        (cos_rows, sin_rows, positions): tables of shape (rows, R/2), views of cos / sin when their layout
        allows (always for contiguous or row-sliced rows), and int64 positions of shape ``tokens``, or None
        when every batch row reads rows 0..S-1 in order (one batch row, or rows shared by the batch): the
        functional API then takes its int-offset path, which builds no positions tensor.

    Raises:
        ValueError: rows that do not match the tokens, or a table wider than head_dim / 2.
    """
    check_table_pair(cos, sin)
    lead = tuple(cos.shape[:-1])
    if len(tokens) == 2:
        batch, seq = tokens
        shared = lead in ((seq,), (1, seq)) or (
            lead == (batch, seq) and batch > 1 and cos.stride(0) == 0 and sin.stride(0) == 0
        )
        if not shared and lead != (batch, seq):
            raise ValueError(
                f"cos: expected per-token rows of shape (batch, seq, width) = ({batch}, {seq}, w), "
                f"(1, {seq}, w) or ({seq}, w) for input tokens {tokens}, got shape {tuple(cos.shape)}"
            )
    else:
        shared = False
        if lead != tokens:
            raise ValueError(
                f"cos: expected per-token rows of shape (total_tokens, width) = ({tokens[0]}, w) for packed "
                f"input, got shape {tuple(cos.shape)}"
            )
    width = cos.shape[-1]
    if shared:
        seq = tokens[1]
        cos_rows = cos.reshape(-1, seq, width)[0]  # (seq, width): the one row set every batch row shares
        sin_rows = sin.reshape(-1, seq, width)[0]
    else:
        cos_rows, sin_rows = cos.reshape(-1, width), sin.reshape(-1, width)  # (tokens, width): a view
    if len(tokens) == 2 and (shared or tokens[0] == 1):
        positions = None  # every batch row reads rows 0..S-1 in order: offset 0, no positions tensor
    else:
        positions = torch.arange(cos_rows.shape[0], device=cos.device).view(tokens)
    check_tables(cos_rows, sin_rows, head_dim)
    return cos_rows, sin_rows, positions


def token_tables(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor | None,
    offsets: int | torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    interleaved: bool,
    *,
    per_token: bool = False,
    full_width: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The functional API's table forms, turned into its one form: (cos, sin, positions) as
    :func:`ropekit.apply_rotary` takes them, with cos / sin views of the caller's tensors.

    With neither flag set, everything is returned as it came. full_width reads one value per pair
    (:func:`half_width`); per_token turns the rows into a table plus the positions that read it
    (:func:`per_token_table`), and then positions must be None and offsets 0.

    Raises:
        ValueError: a flag that is not a bool, positions or offsets given with per_token, rows that do not
            match x's tokens.
    """
    check_bool("per_token", per_token)
    if check_bool("full_width", full_width):
        cos, sin = half_width(cos, sin, interleaved=bool(interleaved))
    if not per_token:
        return cos, sin, positions
    if positions is not None:
        raise ValueError(
            f"positions: expected None with per_token=True (the rows are already one per token), "
            f"got {describe(positions)}"
        )
    if isinstance(offsets, torch.Tensor) or offsets != 0:
        raise ValueError(
            f"offsets: expected 0 with per_token=True (the rows are already one per token), "
            f"got {describe(offsets)}"
        )
    if not isinstance(x, torch.Tensor) or x.dim() != (3 if cu_seqlens is not None else 4):
        return cos, sin, positions  # the functional API's own check of x names what is wrong
    if isinstance(cos, torch.Tensor) and cos.device != x.device:
        check_table_pair(cos, sin)
        check_movable("cos", cos, x.device)
        check_movable("sin", sin, x.device)
        cos, sin = cos.to(x.device), sin.to(x.device)
    return per_token_table(cos, sin, tuple(x.shape[:-2]), x.shape[-1])


def row_starts(batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """arange(0, batch * seq, seq) on device, int64 (batch,): each batch row's first row in per-token rows
    (B, S, W) seen as a (B * S, W) table; the same tensor for the same arguments (at most 64 kept)."""
    key = (batch, seq, device)
    starts = _starts.get(key)
    if starts is None:
        if len(_starts) >= 64:
            _starts.clear()
        starts = _starts[key] = torch.arange(0, batch * seq, seq, device=device)  # (batch,)
    return starts


def plain_tables(x, cos, sin, positions, offsets, cu_seqlens, interleaved, *, per_token, full_width):
    """The common table forms as the plain form, for the launch-plan gate: ``(cos, sin, offsets)``, cos and
    sin (rows, R/2) views of the caller's, or None for any other call (:func:`token_tables` then turns it,
    with its checks).

    Taken only where :func:`token_tables` would certainly accept the call and give the same rows: exact
    types and flags, floating tables of one shape, dtype and device (x's), that need no gradient, R <= D,
    plain eager (no trace, no dispatch mode); full_width: an even width; per_token: no positions, offsets
    exactly 0, 4-D x (B, S, H, D) and rows (S, W) or (1, S, W) or shared by the batch (offset 0), or
    (B, S, W) viewable as (B * S, W) (each batch row's first row: :func:`row_starts`, per-sequence
    offsets). Packed per-token rows are left to token_tables
    (their rows would be a positions tensor built per call). A call made of this form gives what the
    checked path gives the original call, and raises what it raises: every check token_tables makes holds.
    """
    if (
        _is_compiling()
        or _dispatch_depth()  # a trace or a fake mode: row_starts must not keep its tensors
        or type(x) is not Tensor
        or type(cos) is not Tensor
        or type(sin) is not Tensor
        or (interleaved is not True and interleaved is not False)
        or (per_token is not True and per_token is not False)
        or (full_width is not True and full_width is not False)
        or cos.shape != sin.shape
        or cos.dtype != sin.dtype
        or not cos.is_floating_point()
        or cos.device != x.device
        or sin.device != x.device
        or cos.requires_grad
        or sin.requires_grad
        or not cos.dim()
    ):
        return None
    if full_width:
        width = cos.shape[-1]
        if width == 0 or width % 2:
            return None
        cos, sin = (
            (cos[..., ::2], sin[..., ::2])
            if interleaved
            else (cos[..., : width // 2], sin[..., : width // 2])
        )
    width = cos.shape[-1]
    if not 0 < 2 * width <= (x.shape[-1] if x.dim() else 0):
        return None
    if not per_token:
        return (cos, sin, offsets) if cos.dim() == 2 else None
    if positions is not None or type(offsets) is not int or offsets != 0 or cu_seqlens is not None:
        return None
    if x.dim() != 4:
        return None
    batch, seq = x.shape[0], x.shape[1]
    lead = cos.shape[:-1]
    if lead == (seq,):
        return cos, sin, 0  # row s serves token s of every batch row
    if len(lead) != 2 or lead[1] != seq:
        return None
    if lead[0] == 1 or (lead[0] == batch and batch > 1 and cos.stride(0) == 0 and sin.stride(0) == 0):
        return cos[0], sin[0], 0  # (S, W): one row set, shared by the batch
    if lead[0] != batch:
        return None
    if cos.stride(0) != seq * cos.stride(1) or sin.stride(0) != seq * sin.stride(1):
        return None  # not viewable as (B * S, W) rows
    rows = batch * seq
    return cos.view(rows, width), sin.view(rows, width), row_starts(batch, seq, x.device)
