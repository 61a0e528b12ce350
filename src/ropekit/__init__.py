"""ropekit: rotary position embeddings, verified against the mathematics and against Hugging Face.

Layers, bottom to top: reference (float64 NumPy) -> schedules -> config (tables) -> positions -> backends ->
autograd -> functional -> module; on them compat, nn and integrations; on top the tools wing (tools, cli).
ARCHITECTURE.md draws the picture.
"""

from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.fused import apply_rotary_qk_and_cache, apply_rotary_qk_fp8, shift_cache_
from ropekit.fused.qk_norm import qk_norm_rotary_
from ropekit.layer_rope import LayerRope, model_rope
from ropekit.module import RotaryEmbedding
from ropekit.multiaxis import axial_cos_sin, mrope_positions, xpos_cos_sin
from ropekit.rope_index import get_rope_index
from ropekit.schedules import register_schedule
from ropekit.shared_kv import rotate_shared_kv, unrotate_output
from ropekit.sinusoidal import SinusoidalPositionalEmbedding, sinusoidal_embedding

__version__ = "0.1.0"

__all__ = [
    "LayerRope",
    "RopeConfig",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "__version__",
    "apply_rotary",
    "apply_rotary_qk",
    "apply_rotary_qk_and_cache",
    "apply_rotary_qk_fp8",
    "axial_cos_sin",
    "get_rope_index",
    "model_rope",
    "mrope_positions",
    "qk_norm_rotary_",
    "register_schedule",
    "rotate_shared_kv",
    "shift_cache_",
    "sinusoidal_embedding",
    "unrotate_output",
    "xpos_cos_sin",
]
