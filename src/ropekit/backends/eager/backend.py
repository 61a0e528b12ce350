"""The torch backend's object ("torch"): the rotation (:mod:`.rotary`), the serving fusions (:mod:`.fused`)
and QK-norm + RoPE (:mod:`.qk_norm`), each in plain PyTorch ops, behind the one :class:`Backend` contract."""

from __future__ import annotations

import torch

from ropekit.backends.eager import fused as fused_eager
from ropekit.backends.eager import qk_norm as qk_norm_eager
from ropekit.backends.eager.rotary import rotate_qk
from ropekit.validation import NUMERICS

__all__ = ["EagerBackend"]


class EagerBackend:
    """Plain PyTorch: serves every op on any device and dtype, and traces under torch.compile."""

    name = "torch"
    numerics = NUMERICS  # every arithmetic mode (a backend without this attribute serves "exact" alone)

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        return None

    def fused_unavailable_reason(self, op: str, *, widest: int = 0, spec=None) -> str | None:
        return None  # tensor ops: any head width, any packing

    def launch_fused(self, launch, *, checked: bool, written=()) -> None:
        """A fused serving launch (:class:`~ropekit.backends.fused_launch.FusedLaunch`) with tensor ops, which
        tell autograd what they wrote themselves (``written`` is not needed)."""
        fused_eager.launch(launch, checked=checked)

    def launch_qk_norm(
        self, qkv, q_weight, k_weight, cos, sin, positions, offset, spec, *, written=()
    ) -> None:
        """QK-RMSNorm + RoPE on qkv (B, S, W) in place (:mod:`ropekit.backends.eager.qk_norm`); tensor ops
        bump the version counters themselves."""
        qk_norm_eager.launch(qkv, q_weight.detach(), k_weight.detach(), cos, sin, positions, offset, spec)

    def rotate_qk(
        self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace, offset=0, numerics="exact"
    ):
        flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace, offset=offset)
        return rotate_qk(q, k, cos, sin, positions, **flags, numerics=numerics)
