"""Serving fusions: RoPE with the pass beside it (KV-cache write, FP8 quantisation, QK-norm), and cache shift.

Each fusion removes a full read and write of q or k; each has a readable torch reference, the C loop and a
Triton kernel, checked against the float64 reference (docs/serving.md).
"""
