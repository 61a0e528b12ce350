"""Peers' call conventions, mapped onto the ropekit core: change the import, keep the call.

One module per peer, each a thin mapping of that peer's public signature and semantics (which tensors it
modifies, which it returns) onto :func:`ropekit.apply_rotary` / :func:`ropekit.apply_rotary_qk` /
:class:`ropekit.RotaryEmbedding`. None adds math of its own; each docstring names the peer function it mirrors
and every difference. docs/compat.md has the one-line migration for each.

- :mod:`ropekit.compat.flash_attn`: ``apply_rotary_emb``, ``apply_rotary_emb_qkv_``, ``apply_rotary_emb_kv_``,
  ``RotaryEmbedding``
- :mod:`ropekit.compat.hf`: ``apply_rotary_pos_emb`` (transformers 5.x)
- :mod:`ropekit.compat.liger`: ``liger_rotary_pos_emb`` (and ``_vision``, ``_gpt_oss``), ``LigerRopeFunction``
- :mod:`ropekit.compat.vllm`: ``rotary_embedding`` (vLLM's op, registered as
  ``torch.ops.ropekit.rotary_embedding``), FlashInfer's ``apply_rope_with_cos_sin_cache`` (and ``_inplace``),
  ``RotaryEmbedding``, ``get_rope`` and ``fused_qk_norm_rope``
- :mod:`ropekit.compat.flashinfer`: ``rope_quantize_fp8``, ``mla_rope_quantize_fp8``,
  ``rope_quantize_fp8_append_paged_kv_cache`` (on :mod:`ropekit.fused`), ``apply_rope_with_cos_sin_cache``
- :mod:`ropekit.compat.torchtune`: ``RotaryPositionalEmbeddings``, ``Llama3ScaledRoPE``,
  ``Phi3RotaryPositionalEmbeddings``, ``VisionRotaryPositionalEmbeddings``
- :mod:`ropekit.compat.rotary_embedding_torch`: lucidrains' ``RotaryEmbedding``, ``apply_rotary_emb``
- :mod:`ropekit.compat.megatron`: ``apply_rotary_pos_emb``, ``apply_rotary_pos_emb_with_cos_sin`` (sbhd)
- :mod:`ropekit.compat.transformer_engine`: ``apply_rotary_pos_emb`` (sbhd / bshd / thd),
  ``apply_fused_qkv_rotary_pos_emb``
"""

from ropekit.compat import (
    flash_attn,
    flashinfer,
    hf,
    liger,
    megatron,
    rotary_embedding_torch,
    torchtune,
    transformer_engine,
    vllm,
)

__all__ = [
    "flash_attn",
    "flashinfer",
    "hf",
    "liger",
    "megatron",
    "rotary_embedding_torch",
    "torchtune",
    "transformer_engine",
    "vllm",
]
