"""ropekit inside SGLang: a general plugin that serves SGLang's rotary forwards with ropekit's kernels.

Turned on by installing ropekit: the entry point ``sglang.srt.plugins: ropekit =
ropekit.integrations.sglang:register`` is in its metadata, and ``SGLANG_PLUGINS`` (comma-separated names)
filters plugins as usual. SGLang calls :func:`register` in every process (``load_plugins``), then applies
the hooks itself.

How it plugs in: SGLang's hook registry (``sglang.srt.plugins.hook_registry``, ``HookType.AROUND`` on a
method by dotted path, so the few calls ropekit does not serve still reach SGLang's own method). The
methods hooked are those of :data:`TARGETS`, each a class's own ``forward_native`` / ``forward_cpu`` /
``forward_cuda``: subclasses that inherit them (linear, dynamic NTK, NTK-alpha, Llama 3, Gemma 4, YaRN,
and DeepSeek YaRN's ``forward_cuda``) are served too, with their own caches. Construction and the
``[cos | sin]`` cache (``cos_sin_cache``, (P, R)) stay SGLang's:

* ``forward_cuda`` / ``forward_cpu`` rotate query and key in place
  (:func:`ropekit.compat.vllm.rotary_embedding`) and return them, as SGLang's kernels do. With
  ``fused_set_kv_buffer_arg`` (SGLang's ``FusedSetKVBufferArg``: ``value``, ``k_buffer`` (slots, Hk * D),
  ``v_buffer``, ``cache_loc``), the rotated key and the value are also written into the buffers at
  ``cache_loc``, as SGLang's fused kernel does.
* ``forward_native`` returns new tensors and leaves its inputs alone; like SGLang's, it refuses the fused
  argument.

The math runs in float32 whatever the cache dtype, or, with ``ROPEKIT_NUMERICS=vllm`` (read by
:func:`register`, as the vLLM plugin reads it), in the query's dtype after each op: the bits of SGLang's own
``forward_native`` (vLLM's arithmetic). Nothing here imports SGLang until :func:`register` runs.
"""

from __future__ import annotations

import logging

import torch

from ropekit.compat.vllm import apply_rope_with_cos_sin_cache, rotary_embedding
from ropekit.integrations.vllm import MODE, mrope_rotate, plugin_numerics

__all__ = ["LEFT", "TARGETS", "register"]

logger = logging.getLogger(__name__)


def _cache(module, query: torch.Tensor) -> torch.Tensor:
    cache = module.cos_sin_cache
    return cache if cache.device == query.device else cache.to(query.device)


def _store(fused, key: torch.Tensor, tokens: int) -> None:
    """SGLang's fused KV write: the rotated key and the value into their buffers at ``cache_loc``."""
    loc = fused.cache_loc.reshape(tokens).long()
    k_buffer, v_buffer = fused.k_buffer, fused.v_buffer
    k_buffer.index_copy_(0, loc, key.reshape(tokens, k_buffer.shape[-1]).to(k_buffer.dtype))
    v_buffer.index_copy_(0, loc, fused.value.reshape(tokens, v_buffer.shape[-1]).to(v_buffer.dtype))


def _no_fused(fused) -> None:
    if fused is not None:
        raise ValueError(
            "fused_set_kv_buffer_arg: expected None on SGLang's native path (as its own forward_native); "
            "the fused KV write is served by forward_cuda and forward_cpu"
        )


def forward_native(original, self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    """SGLang's ``RotaryEmbedding.forward_native``: new rotated tensors from the module's cache."""
    if hasattr(self, "sin_cos_cache"):  # SGLang's precomputed per-token rows (NPU graphs): its own path
        return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)
    _no_fused(fused_set_kv_buffer_arg)
    if offsets is not None:
        positions = positions + offsets
    cache = _cache(self, query)
    return apply_rope_with_cos_sin_cache(
        positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
    )


def forward_inplace(original, self, positions, query, key, offsets=None, fused_set_kv_buffer_arg=None):
    """SGLang's ``RotaryEmbedding.forward_cuda`` / ``forward_cpu``: in place, plus the fused KV write."""
    if hasattr(self, "sin_cos_cache"):
        return original(self, positions, query, key, offsets, fused_set_kv_buffer_arg)
    if offsets is not None:
        positions = positions + offsets
    cache = _cache(self, query)
    rotary_embedding(
        positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
    )
    if fused_set_kv_buffer_arg is not None:
        _store(fused_set_kv_buffer_arg, key, positions.numel())
    return query, key


def _mrope_served(self, positions) -> bool:
    """M-RoPE layouts ropekit serves: text positions, or (axes, T) with chunked or interleaved sections (not
    GLM's interleaving, which stays SGLang's)."""
    return positions.dim() == 1 or (
        bool(self.mrope_section) and not getattr(self, "mrope_interleaved_glm", 0)
    )


def mrope_forward_native(original, self, positions, query, key, fused_set_kv_buffer_arg=None):
    """SGLang's ``MRotaryEmbedding.forward_native``: positions (T,) or (axes, T), new tensors."""
    if not _mrope_served(self, positions):
        return original(self, positions, query, key, fused_set_kv_buffer_arg)
    _no_fused(fused_set_kv_buffer_arg)
    if positions.dim() == 1:
        cache = _cache(self, query)
        return apply_rope_with_cos_sin_cache(
            positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
        )
    return mrope_rotate(self, positions, query, key, inplace=False)


def mrope_forward_inplace(original, self, positions, query, key, fused_set_kv_buffer_arg=None):
    """SGLang's ``MRotaryEmbedding.forward_cuda`` / ``forward_cpu``: in place, plus the fused KV write."""
    if not _mrope_served(self, positions):
        return original(self, positions, query, key, fused_set_kv_buffer_arg)
    if positions.dim() == 1:
        cache = _cache(self, query)
        rotary_embedding(
            positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
        )
    else:
        mrope_rotate(self, positions, query, key, inplace=True)
    if fused_set_kv_buffer_arg is not None:
        _store(fused_set_kv_buffer_arg, key, positions.shape[-1])
    return query, key


_BASE = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding"
_MROPE = "sglang.srt.layers.rotary_embedding.mrope.MRotaryEmbedding"

# SGLang method (dotted path) -> ropekit's function, applied with HookType.AROUND: a call ropekit does not
# serve (SGLang's precomputed per-token rows, GLM's M-RoPE interleaving) goes to SGLang's own method.
TARGETS: dict[str, object] = {
    f"{_BASE}.forward_native": forward_native,
    f"{_BASE}.forward_cpu": forward_inplace,
    f"{_BASE}.forward_cuda": forward_inplace,
    f"{_MROPE}.forward_native": mrope_forward_native,
    f"{_MROPE}.forward_cpu": mrope_forward_inplace,
    f"{_MROPE}.forward_cuda": mrope_forward_inplace,
}

# SGLang's rotary classes whose forward stays SGLang's, and why.
LEFT: dict[str, str] = {
    "DeepseekScalingRotaryEmbedding.forward_native / forward_cpu": (
        "its own native and CPU paths; its forward_cuda is the base one, which ropekit serves"
    ),
    "MRotaryEmbedding with mrope_interleaved_glm": "GLM's interleaving; the hook hands these calls to SGLang",
    "Ernie4_5_VLRotaryEmbedding": "ERNIE 4.5-VL's M-RoPE layout in its own forward",
    "BailingMRotaryEmbedding": "Bailing's M-RoPE layout in its own forward",
    "Llama4VisionRotaryEmbedding": "its own forward() (complex cache), bypassing the forward_* dispatch",
    "DualChunkRotaryEmbedding": "dual-chunk attention's forward returns several differently-rotated queries",
    "Phi3LongRoPEScaledRotaryEmbedding": "a plain nn.Module with its own forward",
    "FourierRotaryEmbedding": "FoPE mixes frequencies per head in its own forward",
}

_REGISTERED = False


def register() -> None:
    """Register ropekit's forwards in SGLang's hook registry (SGLang's general-plugin hook). Idempotent;
    each call reads ``$ROPEKIT_NUMERICS`` again (:func:`ropekit.integrations.vllm.plugin_numerics`).

    Raises:
        ValueError: for a ROPEKIT_NUMERICS other than "exact", "hf" and "vllm".
    """
    global _REGISTERED
    plugin_numerics()
    if _REGISTERED:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in TARGETS.items():
        HookRegistry.register(target, hook, HookType.AROUND)
    _REGISTERED = True
    logger.info("ropekit: serving SGLang's %s", ", ".join(TARGETS))
    logger.info("ropekit: left to SGLang: %s", "; ".join(f"{name} ({why})" for name, why in LEFT.items()))
