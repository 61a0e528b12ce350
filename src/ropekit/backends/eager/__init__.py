"""The torch backend ("torch", plain PyTorch ops): the rotation, the serving fusions, QK-norm + RoPE.

It serves every input and every op; every other backend is measured against it."""
