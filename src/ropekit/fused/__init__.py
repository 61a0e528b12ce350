"""Serving fusions: RoPE with the pass beside it (KV-cache write, FP8 quantisation, QK-norm), and cache shift.

Each fusion removes a full read and write of q or k; each has a readable torch reference, the C loop and a
Triton kernel, checked against the float64 reference (docs/serving.md).
"""

from ropekit.fused.cache import apply_rotary_qk_and_cache
from ropekit.fused.fp8 import apply_rotary_qk_fp8
from ropekit.fused.shift import shift_cache_

__all__ = ["apply_rotary_qk_and_cache", "apply_rotary_qk_fp8", "shift_cache_"]
