"""The C backend ("cpu"): OpenMP loops built at first use (build.py: compile, cache, lock, CLibrary) for the
rotation, the serving fusions and QK-norm + RoPE."""
