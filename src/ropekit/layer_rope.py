"""A whole model's RoPE, layer by layer, read from its Hugging Face config.

:func:`model_rope` returns one :class:`LayerRope` per decoder layer: the layer's :class:`RopeConfig` (or None
where the layer applies no RoPE), the attention window it sees (``sliding_window``, ``attention_chunk_size``)
and the per-position query temperature its attention multiplies in. It reads what transformers' own modeling
code reads:

* ``layer_types`` and per-layer-type ``rope_parameters`` (Gemma 2/3/3n/4, OLMo 3, ModernBERT, ...); a type
  whose parameters are null applies no RoPE; a layer type that is not softmax attention ("conv",
  "mamba", "linear_attention", ...) has none either;
* DeepSeek-V4's ``main`` / ``compress`` parameters (sliding-window layers rotate with ``main``, the
  compressed ones with ``compress``);
* ``per_layer_config`` / ``global_head_dim`` (Gemma 4's wider full-attention heads);
* ``no_rope_layers`` (Llama 4, SmolLM3): ``no_rope_layers[i]`` is 1 where layer i *uses* RoPE (both models'
  attention reads ``use_rope = config.no_rope_layers[layer_idx]``). Llama 4 replaces an empty list by its
  default (every ``no_rope_layer_interval``-th layer is NoPE); SmolLM3 only replaces a missing one;
* temperatures: Llama 4's ``floor_scale`` / ``attn_scale`` on its NoPE layers (``attn_temperature_tuning``),
  Ministral 3 / Mistral 4's ``llama_4_scaling_beta`` on every layer (:mod:`ropekit.schedules.softmax`).

* hybrids, from their own keys (Jamba's ``attn_layer_period`` / ``offset``, Bamba's ``attn_layer_indices``,
  RecurrentGemma's ``block_types``, Zamba 2's and Nemotron-H's ``layers_block_type``, ZAYA's "hybrid" layers,
  Muse's ``layer_rope_theta``): the layers that are not attention get type "mamba", "recurrent", "mlp" or
  "moe" and no RoPE;
* an encoder-decoder's decoder (``decoder`` / ``decoder_config``, Moonshine's ``decoder_*`` keys).

Nested configs are unwrapped as :func:`ropekit.hf_config.load_hf_config` does (``text_config``,
``thinker_config.text_config``). Vision and audio towers (:data:`NOT_TOKEN_STACKS`) are refused.
tests/test_layer_rope.py proves each entry against the layer transformers builds from the same config
(tests/model_rope_proof.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ropekit.config import FrozenScaling, RopeConfig
from ropekit.hf_config import (
    DEEPSEEK_V4_ROPE_LABELS,
    LLAMA4_TEMPERATURE,
    POSITION_SCALING_KEY,
    layer_overrides,
    layer_rope_kwargs,
    load_hf_config,
    with_derived_layer_types,
)
from ropekit.schedules.softmax import attention_temperature, check_temperature
from ropekit.validation import check_int, describe

__all__ = ["LayerRope", "model_rope"]

# Keys that hold the number of decoder layers, in the order HF's configs use them.
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
# Layer types that are not softmax attention: no RoPE, no window.
NON_ATTENTION = ("linear_attention", "conv", "mamba", "recurrent", "mlp", "moe", "ssm", "deltanet")
# Models that rotate only their sliding-window layers (their attention: `if self.sliding_window is not None`).
SLIDING_ONLY = frozenset({"cohere2", "cohere2_moe", "flint", "afmoe"})
# Models that rotate every layer when the config has no sliding window, else only the sliding layers
# (`if self.sliding_window is None or self.is_sliding`).
SLIDING_ONLY_WITH_WINDOW = frozenset({"exaone4", "exaone4_5", "exaone_moe", "kolibri1"})
# Models whose layer layout is not read from the keys above: which layers attend, or rotate, comes from keys
# model_rope does not interpret, so it refuses them rather than guess (RopeConfig.from_hf reads their RoPE).
UNREAD_LAYOUTS = {
    "zamba": "a shared attention block",
    # CLVP's encoders rotate max(projection_dim / (2 heads), 32) features of q, k and the values too
    "clvp_encoder": "its rotary width from projection_dim, values rotated as well",
    "hrm": "its recurrence over layer stacks",
}
# Hybrids: which layers attend comes from their own keys (transformers' ``layers_block_type`` properties);
# the other layers (Mamba, recurrent, MLP / MoE) get layer type "mamba", "recurrent", "mlp" or "moe" and no
# RoPE. Jamba's and Nemotron-H's attention layers apply no RoPE (their modeling code defines
# apply_rotary_pos_emb and never calls it); Zamba 2's shared attention rotates only with use_mem_rope.
HYBRID_NOPE = frozenset({"jamba", "nemotron_h"})
# transformers 5.24's model types whose RoPE rotates image patches, video or audio frames, keypoints or time
# series patches (vision and audio towers, codecs, speech recognisers): their forward takes no token ids and
# their positions are not a decoder's, so model_rope refuses them rather than give a plan no one proved (a
# multimodal model's own config is read through its language model's text_config instead).
NOT_TOKEN_STACKS = frozenset(
    {
        "cohere_compass_vision", "cosmos3_edge_vision", "exaone4_5_vision", "gemma3n_audio", "gemma3n_vision",
        "gemma4_audio", "gemma4_vision", "glm4v_moe_vision", "glm4v_vision", "glm_image_vision",
        "glm_image_vqmodel", "glm_ocr_vision", "glmasr_encoder", "granite_docling_vision",
        "hunyuan_vl_vision", "hy_v4_vl_vision", "lasr_ctc", "lasr_encoder", "lightglue", "mimi",
        "mimi_decoder", "mimi_encoder",
        "muse_glimmer_assistant", "muse_glimmer_vision", "muse_spark_audio", "muse_spark_vision",
        "nemotron3_5_transcribe_asr_audio", "nemotron3_5_transcribe_audio",
        "nemotron3_5_transcribe_word_timestamp", "nemotron3_diarization", "nemotron3_diarization_audio",
        "nemotron_asr_streaming", "nemotron_asr_streaming_encoder", "neucodec", "parakeet_ctc",
        "parakeet_encoder", "parakeet_rnnt", "parakeet_tdt", "pe_audio_encoder",
        "pe_audio_video_encoder", "pe_video_encoder", "pixtral", "pocket_tts_audio_tokenizer",
        "pocket_tts_audio_tokenizer_decoder", "pocket_tts_audio_tokenizer_encoder", "qwen2_5_vl_vision",
        "qwen3_5_moe_vision", "qwen3_5_vision", "qwen3_vl_moe_vision", "qwen3_vl_vision", "qwen4_exp_vision",
        "timesfm2_5", "voxtral_realtime_encoder", "xcodec2", "dinov3_vit", "sapiens2", "efficientloftr",
    }
)  # fmt: skip
# Models whose config names a sliding_window that transformers' modeling code never applies (Moshi's and
# Kyutai speech-to-text's decoders build a plain causal mask and keep the window unused).
NO_WINDOW = frozenset({"moshi", "kyutai_speech_to_text"})
# ZAYA's layer types: attention beside its CCA mixer, full or sliding-window (their rope_parameters are keyed
# by these names).
ZAYA_TYPES = ("hybrid", "hybrid_sliding")
# Models whose attention_chunk_size chunks their "chunked_attention" layers (Llama 4).
CHUNKED = "chunked_attention"
SLIDING = "sliding_attention"
# The layer types a config may name (layer_types, layers_block_type): transformers 5.25's
# ALLOWED_LAYER_TYPES, the legacy names it remaps (mamba, attention, deepseek_sparse_attention,
# qwen_sparse_attention), and the non-attention blocks of released hybrids. Anything else is a typo that
# transformers refuses; read as a layer without RoPE it would make a plan silently wrong.
KNOWN_LAYER_TYPES = frozenset(
    {
        "full_attention", "sliding_attention", "chunked_attention", "window_attention", "indexed_attention",
        "compressed_sparse_attention", "heavily_compressed_attention", "minimax_m3_sparse",
        "reference_sliding_attention", "linear_attention", "sparse", "dense", "attention",
        "deepseek_sparse_attention", "qwen_sparse_attention", *ZAYA_TYPES, *NON_ATTENTION,
    }
)  # fmt: skip


@dataclass(frozen=True)
class LayerRope:
    """One decoder layer's RoPE and attention window.

    Attributes:
        index: the layer's index in the decoder.
        layer_type: its entry of the config's ``layer_types`` ("full_attention", "sliding_attention", ...),
            or None when the config has none.
        rope: the layer's RoPE, or None for a layer that applies none (NoPE, or no attention at all).
        sliding_window: how many keys (the query's own included) a query sees, or None (no window).
        attention_chunk_size: the chunk a query attends within (Llama 4's chunked layers), or None.
        temperature: the scaling keys its query temperature comes from (see :meth:`attention_temperature`),
            or None.
        shared_kv: True where the layer's one key-value tensor is both key and value (DeepSeek-V4): the
            values are rotated with the keys, and the attention output is rotated back by the query's
            position (:func:`ropekit.rotate_shared_kv`, then :func:`ropekit.unrotate_output`). A layer
            wired from ``rope`` alone (q and k rotated, values not, output as it is) is silently wrong there.
    """

    index: int
    layer_type: str | None
    rope: RopeConfig | None
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    temperature: FrozenScaling | None = None
    shared_kv: bool = False

    def attention_temperature(self, positions: torch.Tensor) -> torch.Tensor:
        """The factor this layer multiplies the query at each position by (float32, shaped like positions;
        ones for a layer without one).

        Raises:
            ValueError: for positions that are not an integer tensor, or negative (as every rotation
                refuses them).
        """
        return attention_temperature(self.temperature, positions, torch.float32)


def model_rope(config: Any) -> list[LayerRope]:
    """Every decoder layer's RoPE, window and query temperature, from a Hugging Face config.

    Args:
        config: a ``PretrainedConfig``, a dict, a config.json path or the folder holding it; multimodal
            configs are read through their language model's config.

    Returns:
        one :class:`LayerRope` per decoder layer, in order.

    Raises:
        ValueError: naming the key, for a config without a layer count, ``layer_types`` /
            ``no_rope_layers`` whose length is not the layer count, a layer type transformers does not know
            (naming the layer), a window, chunk size or NoPE interval that is not a positive integer, a
            layer type without RoPE parameters, or anything :meth:`RopeConfig.from_hf` refuses.

    Example:
        >>> for layer in ropekit.model_rope("google/gemma-4/config.json"):  # doctest: +SKIP
        ...     print(layer.index, layer.layer_type, layer.rope and layer.rope.head_dim)
    """
    d = _dory_layers(with_derived_layer_types(_decoder(load_hf_config(config))))
    if d.get("model_type") in NOT_TOKEN_STACKS:
        raise ValueError(
            f"config['model_type']: {d['model_type']!r} is a vision or audio tower (its RoPE rotates "
            "patches, frames or keypoints, not a decoder's token positions); model_rope reads language "
            "models (pass the multimodal model's config: its text_config is read)"
        )
    if _model_type(d) in UNREAD_LAYOUTS:
        raise ValueError(
            f"config['model_type']: model_rope does not read which layers of a {d['model_type']!r} model "
            f"attend or rotate ({UNREAD_LAYOUTS[_model_type(d)]}); RopeConfig.from_hf reads its RoPE"
        )
    count = _layer_count(d)
    types = _layer_types(d, count)
    uses_rope = _uses_rope(d, count)
    llama4 = _model_type(d) == "llama4" and d.get("attn_temperature_tuning", True)
    layers, built = [], {}
    for index in range(count):
        layer_type = None if types is None else types[index]
        overrides = layer_overrides(d, index, layer_type)
        rope = None
        if uses_rope[index] and _is_attention(layer_type) and _rotates(d, layer_type):
            rope = _layer_rope(d, layer_type, overrides, built)
        temperature = None
        if llama4 and rope is None and _is_attention(layer_type):
            temperature = FrozenScaling({k: d.get(k, v) for k, v in LLAMA4_TEMPERATURE.items()})
            check_temperature(temperature)  # no RopeConfig checks it where every layer is NoPE
        elif rope is not None and rope.scaling and rope.scaling.get(POSITION_SCALING_KEY) is not None:
            keys = (POSITION_SCALING_KEY, "original_max_position_embeddings")
            temperature = FrozenScaling({k: rope.scaling[k] for k in keys})
        layers.append(
            LayerRope(
                index=index,
                layer_type=layer_type,
                rope=rope,
                sliding_window=_sliding_window(d, layer_type),
                attention_chunk_size=_chunk_size(d, layer_type),
                temperature=temperature,
                shared_kv=rope is not None and _model_type(d) == "deepseek_v4",
            )
        )
    return layers


def _decoder(d: dict[str, Any]) -> dict[str, Any]:
    """An encoder-decoder config's decoder: its ``decoder`` / ``decoder_config`` sub-config (T5Gemma,
    T5Gemma 2, Dia) merged over the outer keys, or Moonshine's ``decoder_*`` keys. The plan describes the
    decoder's self-attention layers (their cross-attention applies no RoPE)."""
    if not d.get("is_encoder_decoder"):
        return d
    for key in ("decoder", "decoder_config"):
        inner = d.get(key)
        if isinstance(inner, Mapping):
            outer = {k: v for k, v in d.items() if k not in ("encoder", "encoder_config", key)}
            return {**outer, **inner}
    prefixed = {k.removeprefix("decoder_"): v for k, v in d.items() if k.startswith("decoder_")}
    if (
        "num_hidden_layers" in prefixed
    ):  # Moonshine: decoder_num_hidden_layers, decoder_num_attention_heads, ...
        return {**d, **prefixed}
    return d


def _dory_layers(d: dict[str, Any]) -> dict[str, Any]:
    """Dory's released config.json lists an "mlp" block after each attention block and counts both in
    num_hidden_layers; DoryConfig takes every other entry and half the count, and so does the plan."""
    types = d.get("layer_types")
    if _model_type(d) != "dory" or not isinstance(types, (list, tuple)) or "mlp" not in types:
        return d
    count = d.get("num_hidden_layers")
    return {
        **d,
        "layer_types": list(types)[::2],
        "num_hidden_layers": count // 2 if isinstance(count, int) else count,
    }


def _model_type(d: Mapping[str, Any]) -> str:
    return str(d.get("model_type") or "").removesuffix("_text")


def _layer_count(d: Mapping[str, Any]) -> int:
    blocks = d.get("layers_block_type")
    if _model_type(d) == "nemotron_h" and isinstance(blocks, (list, tuple)) and blocks:
        return len(blocks)  # NemotronHConfig: its length overrides num_hidden_layers
    count = next((d[k] for k in LAYER_COUNT_KEYS if d.get(k) is not None), None)
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise ValueError(
            f"config: expected the number of decoder layers in one of {list(LAYER_COUNT_KEYS)} "
            f"(a positive integer), got {describe(count)}"
        )
    return count


def _per_layer_list(d: Mapping[str, Any], key: str, count: int) -> list | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise ValueError(
            f"config[{key!r}]: expected one entry per decoder layer ({count}), got {describe(value)}"
        )
    return list(value)


def _layer_types(d: Mapping[str, Any], count: int) -> list | None:
    """Per layer, its type: ``layer_types``, or for hybrids what their own keys say (as transformers 5.24's
    config properties derive it)."""
    model_type = _model_type(d)
    if model_type == "jamba":  # JambaConfig.layers_block_type
        period = check_int("config['attn_layer_period']", d.get("attn_layer_period", 8))
        offset = check_int(
            "config['attn_layer_offset']", d.get("attn_layer_offset", 4), minimum=0, maximum=period - 1,
            expected=f"an integer in [0, attn_layer_period) = [0, {period}) (as JambaConfig checks)",
        )  # fmt: skip
        return ["full_attention" if i % period == offset else "mamba" for i in range(count)]
    if model_type == "bamba":  # BambaConfig.layers_block_type
        indices = d.get("attn_layer_indices") or []
        if not isinstance(indices, (list, tuple)) or not all(isinstance(i, int) for i in indices):
            raise ValueError(
                f"config['attn_layer_indices']: expected a list of layer indices, got {describe(indices)}"
            )
        return ["full_attention" if i in indices else "mamba" for i in range(count)]
    if model_type == "recurrent_gemma":  # RecurrentGemmaConfig.layers_block_type: block_types repeated
        blocks = d.get("block_types") or ["recurrent", "recurrent", "attention"]
        if not isinstance(blocks, (list, tuple)) or not set(blocks) <= {"recurrent", "attention"}:
            raise ValueError(
                f"config['block_types']: expected a list of 'recurrent' / 'attention', got {describe(blocks)}"
            )
        return [SLIDING if blocks[i % len(blocks)] == "attention" else "recurrent" for i in range(count)]
    if model_type in ("zamba2", "nemotron_h") and d.get("layer_types") is None:
        types = _known_types(d, "layers_block_type", count)
        # transformers' names: "linear_attention" is a Mamba-2 mixer, "hybrid" Zamba 2's shared attention
        # block before one
        names = {"linear_attention": "mamba", "hybrid": "hybrid_attention"}
        return None if types is None else [names.get(t, t) for t in types]
    return _known_types(d, "layer_types", count)


def _known_types(d: Mapping[str, Any], key: str, count: int) -> list | None:
    """config[key]'s per-layer types, each one transformers knows (a typo is no layer without RoPE)."""
    types = _per_layer_list(d, key, count)
    for index, entry in enumerate(types or ()):
        if not isinstance(entry, str) or entry not in KNOWN_LAYER_TYPES:
            raise ValueError(
                f"config[{key!r}][{index}]: layer {index}'s type is not a layer type transformers knows; "
                f"expected one of {sorted(KNOWN_LAYER_TYPES)}, got {describe(entry)}"
            )
    return types


def _uses_rope(d: Mapping[str, Any], count: int) -> list[bool]:
    """Per layer, whether it rotates: no_rope_layers[i] == 1 means layer i uses RoPE (Llama 4, SmolLM3);
    layer_rope_theta[i] == 0 means layer i is NoPE (Muse Glimmer / Spark: their decoder passes no position
    embeddings there; the other layers all rotate with rope_parameters' theta, whatever value they list)."""
    thetas = d.get("layer_rope_theta")
    if thetas is not None:
        thetas = _per_layer_list(d, "layer_rope_theta", count)
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and t >= 0 for t in thetas):
            raise ValueError(
                "config['layer_rope_theta']: expected a non-negative number per layer (0: NoPE), "
                f"got {thetas!r}"
            )
        return [t != 0 for t in thetas]
    flags = d.get("no_rope_layers")
    interval = d.get("no_rope_layer_interval")
    if flags is None or (not flags and _model_type(d) == "llama4"):
        if flags is None and _model_type(d) not in ("llama4", "smollm3"):
            return [True] * count
        interval = check_int("config['no_rope_layer_interval']", 4 if interval is None else interval)
        return [(i + 1) % interval != 0 for i in range(count)]
    flags = _per_layer_list(d, "no_rope_layers", count)
    if any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise ValueError(
            f"config['no_rope_layers']: expected 1 (the layer uses RoPE) or 0 (NoPE) per layer, got {flags!r}"
        )
    return [bool(f) for f in flags]


def _rotates(d: Mapping[str, Any], layer_type: str | None) -> bool:
    """False for the layers of a type the model's attention leaves without RoPE."""
    model_type = _model_type(d)
    if model_type in HYBRID_NOPE or (model_type == "zamba2" and not d.get("use_mem_rope")):
        return False
    if model_type in SLIDING_ONLY or (model_type in SLIDING_ONLY_WITH_WINDOW and d.get("sliding_window")):
        return layer_type == SLIDING
    return True


def _is_attention(layer_type: str | None) -> bool:
    return (
        layer_type is None
        or layer_type in ZAYA_TYPES
        or ("attention" in layer_type and not any(layer_type.startswith(n) for n in NON_ATTENTION))
    )


def _layer_rope(
    d: Mapping[str, Any], layer_type: str | None, overrides: dict, built: dict
) -> RopeConfig | None:
    """The layer's RopeConfig (configs that agree are built once and shared), None for null parameters."""
    params = d.get("rope_parameters")
    entry = layer_type
    nested = (
        isinstance(params, Mapping)
        and params
        and all(v is None or isinstance(v, Mapping) for v in params.values())
    )
    if _model_type(d) == "deepseek_v4":
        entry = DEEPSEEK_V4_ROPE_LABELS.get(layer_type, layer_type)
    elif layer_type is not None and not nested and not _has_typed_bases(d):
        entry = None  # one RoPE for every layer type
    if nested and entry is None:
        raise ValueError(
            f"config['layer_types']: the config has per-layer-type rope_parameters {sorted(params)} but no "
            "layer_types saying which layer is which"
        )
    if nested and entry in params and params[entry] is None:
        return None
    key = (entry, repr(sorted(overrides.items())))
    if key not in built:
        built[key] = RopeConfig._from_hf_kwargs(layer_rope_kwargs(d, entry, overrides))
    return built[key]


def _has_typed_bases(d: Mapping[str, Any]) -> bool:
    """Legacy per-layer-type bases (Gemma 3's rope_local_base_freq, ModernBERT's global / local theta)."""
    return any(
        d.get(k) is not None for k in ("rope_local_base_freq", "global_rope_theta", "local_rope_theta")
    )


def _sliding_window(d: Mapping[str, Any], layer_type: str | None) -> int | None:
    if d.get("model_type") in NO_WINDOW:
        return None
    window = d.get("sliding_window")
    if _model_type(d) == "recurrent_gemma":  # its attribute_map: sliding_window -> attention_window_size
        window = d.get("attention_window_size", window)
    key = "attention_window_size" if _model_type(d) == "recurrent_gemma" else "sliding_window"
    if _model_type(d) == "modernbert" and d.get("local_attention") is not None:
        # Bidirectional: a query sees local_attention // 2 keys each side; HF passes half the window + 1.
        window = check_int("config['local_attention']", d["local_attention"]) // 2 + 1
    if window is None or d.get("use_sliding_window") is False:
        return None  # an unused window is not read (Qwen2-MoE publishes 0 beside use_sliding_window false)
    window = check_int(f"config[{key!r}]", window)
    if layer_type in (None, SLIDING, ZAYA_TYPES[1]) or _model_type(d) == "deepseek_v4":
        return window
    return None


def _chunk_size(d: Mapping[str, Any], layer_type: str | None) -> int | None:
    size = d.get("attention_chunk_size")
    if size is None:
        return None
    size = check_int("config['attention_chunk_size']", size)
    return size if layer_type == CHUNKED else None
