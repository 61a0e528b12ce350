"""Decompositions of the registered rotary ops into core ATen ops, for exported programs.

``torch.export.export`` keeps ``torch.ops.ropekit.<backend>_rotary`` as one node (the C loop and the Triton
kernel write through pointers; no exported-program runtime knows them). ``run_decompositions()`` lowers
every functional op with a CompositeImplicitAutograd kernel (its default table,
``torch.export.default_decompositions()``, collects them from every namespace), so each out-of-place op gets
one here: the torch backend's rotation (:func:`ropekit.backends.eager.rotary.rotate`), the same float32 (or
float64) products and sums rounded in the same order as the kernels (built without fused multiply-adds), so
the decomposed program equals eager bit for bit.

The composite kernel is a Python one (``py_impl``) that answers only while torch.export traces or
decomposes (``torch.compiler.is_exporting()``) and returns NotImplemented otherwise: torch.compile also runs
the composite kernel of an op without a backend kernel of its own (the ops register a
CompositeExplicitAutograd one), and would then trace the torch math instead of keeping the kernel's node.
Eager calls never reach it (the dispatcher takes the explicit kernel).

The in-place ops get none (functionalization runs the composite kernel of any mutating op): under
torch.export :mod:`ropekit.functional` rotates out of place and copies back, so an exported graph holds
the out-of-place op only. The serving fusions (``fused/``) write caches in place and are not lowered
(docs/export.md). Rows are not checked here: ATen's index raises for a row past the table on the CPU (a
device-side assert on CUDA); the exported program trusts its positions as the model's own code would.
"""

from __future__ import annotations

import sys

import torch

from ropekit.backends.eager.rotary import rotate

__all__ = ["DECOMPOSED_OPS", "rotary_decomposition"]

# The out-of-place rotary ops of the kernel backends (backends.kernel_op.KernelBackend registers them).
DECOMPOSED_OPS = ("cpu_rotary", "triton_rotary")


def rotary_decomposition(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
    """``ropekit::<backend>_rotary`` in ATen ops: the same schema, the same values.

    q, k: (B, S, H, D), or packed (T, H, D); positions: q.shape[:-2] rows, or None for rows
    ``offset + arange(S)`` (packed: ``offset + arange(T)``). Returns [q_out] or [q_out, k_out].
    """
    if positions is None:
        seq = q.shape[-3]
        positions = torch.arange(offset, offset + seq, device=q.device).expand(q.shape[:-2])  # (B, S) or (T,)
    flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=False)
    q_out = rotate(q, cos, sin, positions, **flags)
    return [q_out] if k is None else [q_out, rotate(k, cos, sin, positions, **flags)]


def _export_only(*args, **kwargs):
    """The composite kernel: the decomposition while torch.export traces or decomposes, NotImplemented
    (keep the op) otherwise, so that torch.compile, which decomposes every op with a composite kernel and
    no backend kernel of its own, keeps the kernel op."""
    if not torch.compiler.is_exporting():
        _keep_in_inductor()
        return NotImplemented
    return rotary_decomposition(*args, **kwargs)


def _keep_in_inductor() -> None:
    """Inductor collects every composite kernel into its decomposition table, then refuses to fall back to
    an op it holds a decomposition for ("both a fallback and a decomp"). When this kernel declines under
    torch.compile, inductor is already imported: give each op its fallback lowering (the kernel itself)."""
    lowering = sys.modules.get("torch._inductor.lowering")
    if lowering is None:
        return
    for name in DECOMPOSED_OPS:
        op = getattr(torch.ops.ropekit, name).default
        if op not in lowering.lowerings:
            lowering.make_fallback(op, override_decomp=True)


for _name in DECOMPOSED_OPS:
    # A Python kernel (py_impl), not a dispatcher registration: export's default decomposition table
    # collects both, and only a Python one may answer NotImplemented.
    getattr(torch.ops.ropekit, _name).default.py_impl(torch._C.DispatchKey.CompositeImplicitAutograd)(
        _export_only
    )
