"""The Triton backend ("triton"): kernels (*_kernel.py, fused.py) and their launchers for the rotation, the
serving fusions and QK-norm + RoPE; compiled ahead of time for sm_80/90/100 by ropekit.tools.triton_aot."""
