"""Reference model pieces built on ropekit: a LLaMA-style attention block, a KV cache and a decode loop."""

from ropekit.models.attention import Attention
from ropekit.models.decode import incremental_forward, left_pad, padding_positions
from ropekit.models.kv_cache import KVCache

__all__ = ["Attention", "KVCache", "incremental_forward", "left_pad", "padding_positions"]
