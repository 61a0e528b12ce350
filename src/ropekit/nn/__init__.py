"""Reference model pieces built on ropekit: a LLaMA-style attention block, a KV cache and a decode loop."""

from ropekit.nn.attention import Attention
from ropekit.nn.decode import incremental_forward, left_pad, padding_positions
from ropekit.nn.kv_cache import KVCache

__all__ = ["Attention", "KVCache", "incremental_forward", "left_pad", "padding_positions"]
