"""ropekit: rotary position embeddings, verified against the mathematics and against Hugging Face.

Layers, bottom to top: reference (float64 NumPy) -> schedules -> config (tables) -> positions -> backends ->
autograd -> functional -> module; on them compat, nn and integrations; on top the tools wing (tools, cli).
ARCHITECTURE.md draws the picture.
"""

from ropekit import _moved
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.fused.qk_norm import qk_norm_rotary_
from ropekit.module import RotaryEmbedding
from ropekit.multiaxis import axial_cos_sin, mrope_positions, xpos_cos_sin
from ropekit.schedules import register_schedule
from ropekit.sinusoidal import SinusoidalPositionalEmbedding, sinusoidal_embedding

__version__ = "0.1.0"

_moved.install()  # ropekit.models, ropekit.demo, ... keep importing, with a DeprecationWarning

__all__ = [
    "RopeConfig",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "__version__",
    "apply_rotary",
    "apply_rotary_qk",
    "axial_cos_sin",
    "mrope_positions",
    "qk_norm_rotary_",
    "register_schedule",
    "sinusoidal_embedding",
    "xpos_cos_sin",
]
