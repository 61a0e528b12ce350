"""ONNX export of models that use ropekit: the standard ``RotaryEmbedding`` operator (opset 23).

``torch.onnx.export(..., dynamo=True)`` exports through ``torch.export``, where ropekit's rotation is one
node, ``torch.ops.ropekit.<backend>_rotary`` (:mod:`ropekit.backends.kernel_op`). :func:`translation_table`
maps it to ONNX's ``RotaryEmbedding`` (opset 23; onnxruntime runs it on the CPU), so the exported graph
rotates with the operator every ONNX runtime knows; :func:`export` is ``torch.onnx.export`` with that
table. Without it the op is lowered to plain ONNX ops through its ATen decomposition
(:mod:`ropekit.backends.decompose`): the same values, a longer graph. Calls that never reach a ropekit op
(the torch backend: float64 inputs, tables wider than the kernels serve, ``backend="torch"``) export as
plain ONNX ops in either case.

How each form of the op maps (one ``RotaryEmbedding`` per rotated tensor, q and k each):

* (B, S, H, D) input: a free reshape to (B, S, H * D), the operator's 3-D form with ``num_heads=H``
  (static); when H is not known at export, the operator's 4-D (B, H, S, D) form between two transposes.
  Packed (T, H, D) input is one sequence of T tokens.
* half-split (GPT-NeoX) and interleaved (GPT-J) pairs: the ``interleaved`` attribute.
* partial rotary: ``rotary_embedding_dim`` = 2 * cos.shape[-1]; the rest of each head passes through.
* rows: explicit positions are the operator's ``position_ids``; an offset (KV-cache decoding) becomes
  ``offset + Range(S)`` per batch row. The cos / sin tables, every scaling type's frequencies and attention
  scaling already in them, are the operator's caches: a model's buffers export as initializers.
* the inverse rotation (``inverse=True``): the sine cache negated (exact).
* float16 / bfloat16 input: cast to float32 around the operator, as ropekit computes (float32 math, one
  rounding to the input dtype at the end), which also keeps the float32 tables exact.

Every form of the rotary ops reaches one of these, so nothing falls back silently; the serving fusions
(``apply_rotary_qk_and_cache``, ...) write caches in place, have no ONNX form, and :func:`export` refuses
them by name (docs/export.md).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ropekit.backends.decompose import DECOMPOSED_OPS

__all__ = ["MIN_OPSET", "export", "rotary_embedding", "translation_table"]

MIN_OPSET = 23  # the first opset with RotaryEmbedding


def rotary_embedding(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
    """The ONNX graph of ``ropekit::<backend>_rotary`` (an onnxscript translation: torch.onnx calls it with
    symbolic tensors while it translates the exported graph). Returns [q_out] or [q_out, k_out]."""
    from onnxscript import opset23 as op

    if conjugate:
        sin = op.Neg(sin)
    rotary_dim = 2 * cos.shape[-1]
    packed = len(q.shape) == 3  # (T, H, D): one sequence of T tokens
    if positions is None:
        seq = op.Shape(q, start=0 if packed else 1, end=1 if packed else 2)  # (1,): S, or T
        start = op.Constant(value_int=offset) if isinstance(offset, int) else op.Cast(offset, to=7)
        rows = op.Add(op.Range(op.Constant(value_int=0), op.Squeeze(seq), op.Constant(value_int=1)), start)
        rows = op.Unsqueeze(rows, op.Constant(value_ints=[0]))  # (1, S)
        if not packed:
            rows = op.Expand(rows, op.Shape(q, start=0, end=2))  # (B, S)
    else:
        rows = positions if positions.dtype == 7 else op.Cast(positions, to=7)  # int64
        if packed:
            rows = op.Unsqueeze(rows, op.Constant(value_ints=[0]))  # (1, T)
    outs = [_rotate(op, x, cos, sin, rows, interleaved, rotary_dim, packed) for x in (q, k) if x is not None]
    return outs


def _rotate(op, x, cos, sin, rows, interleaved: bool, rotary_dim: int, packed: bool):
    """One tensor through RotaryEmbedding, in float32 (cast around it otherwise)."""
    float32 = 1  # ONNX's TensorProto.FLOAT
    dtype = x.dtype
    y = x if dtype == float32 else op.Cast(x, to=float32)
    if cos.dtype != float32:
        cos, sin = op.Cast(cos, to=float32), op.Cast(sin, to=float32)
    if packed:
        y = op.Unsqueeze(y, op.Constant(value_ints=[0]))  # (1, T, H, D)
    heads = x.shape[-2]
    flags = dict(interleaved=int(interleaved), rotary_embedding_dim=rotary_dim)
    if isinstance(heads, int):  # the 3-D form: a reshape is free
        flat = op.Reshape(y, op.Constant(value_ints=[0, 0, -1]))  # (B, S, H * D)
        out = op.RotaryEmbedding(flat, cos, sin, rows, num_heads=heads, **flags)
        out = op.Reshape(out, op.Shape(y))  # (B, S, H, D)
    else:  # heads unknown at export: the 4-D form, (B, H, S, D)
        out = op.RotaryEmbedding(op.Transpose(y, perm=[0, 2, 1, 3]), cos, sin, rows, **flags)
        out = op.Transpose(out, perm=[0, 2, 1, 3])  # (B, S, H, D)
    if packed:
        out = op.Squeeze(out, op.Constant(value_ints=[0]))  # (T, H, D)
    return out if dtype == float32 else op.Cast(out, to=dtype)


def translation_table() -> dict[Callable, Callable]:
    """``custom_translation_table`` entries for torch.onnx.export(dynamo=True): each of ropekit's rotary ops
    to :func:`rotary_embedding`."""
    return {getattr(torch.ops.ropekit, name).default: rotary_embedding for name in DECOMPOSED_OPS}


def export(
    model: torch.nn.Module,
    args: tuple = (),
    f: str | os.PathLike | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    opset_version: int = MIN_OPSET,
    custom_translation_table: Mapping[Callable, Callable] | None = None,
    **export_kwargs: Any,
):
    """``torch.onnx.export(model, args, f, dynamo=True, ...)`` with ropekit's rotation as ``RotaryEmbedding``.

    Args:
        model, args, f, kwargs: as for torch.onnx.export.
        opset_version: at least 23 (RotaryEmbedding's first opset).
        custom_translation_table: more translations; an entry for a ropekit op replaces ropekit's.
        export_kwargs: the rest of torch.onnx.export's keywords (``dynamic_shapes``, ``input_names``,
            ``external_data``, ...).

    Returns:
        The ``torch.onnx.ONNXProgram``.

    Raises:
        ValueError: for an opset below 23 (export with torch.onnx.export itself then: ropekit's ops lower to
            plain ONNX ops), for ``dynamo=False`` (the TorchScript exporter knows no ropekit op), or for a
            model whose exported graph holds a ropekit op with no ONNX form (the serving fusions, which
            write a KV cache in place), naming it.
    """
    if type(opset_version) is not int or opset_version < MIN_OPSET:
        raise ValueError(
            f"opset_version: expected an int >= {MIN_OPSET} (the first opset with RotaryEmbedding), got "
            f"{opset_version!r}; for an older opset call torch.onnx.export(..., dynamo=True) directly: "
            f"ropekit's ops then lower to plain ONNX ops"
        )
    if export_kwargs.pop("dynamo", True) is not True:
        raise ValueError("dynamo: expected True (ropekit's ops export through torch.export), got False")
    table = {**translation_table(), **(custom_translation_table or {})}
    try:
        return torch.onnx.export(
            model, args, f, kwargs=kwargs, dynamo=True, opset_version=opset_version,
            custom_translation_table=table, **export_kwargs,
        )  # fmt: skip
    except Exception as error:
        name = _untranslated_op(error, table)
        if name is None:
            raise
        raise ValueError(
            f"model: its exported graph holds ropekit::{name}, which has no ONNX form (the serving fusions "
            f"write a KV cache in place); export the rotation with apply_rotary_qk and write the cache with "
            f"torch ops (docs/export.md)"
        ) from error


def _untranslated_op(error: BaseException, table: Mapping[Callable, Callable]) -> str | None:
    """The ropekit op torch.onnx found no translation for, read from its error chain (torch.onnx names the
    op, as ``op='ropekit.<name>'``, in a KeyError deep in its translation), or None."""
    translated = {
        str(op).split(".")[1] for op in table if str(op).startswith("ropekit.")
    }  # ropekit.<name>.<overload>
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for name in re.findall(r"op='ropekit\.(\w+)'", str(error)):
            if name not in translated:
                return name
        error = error.__cause__ or error.__context__
    return None
