"""Reading Hugging Face model configs into :class:`ropekit.RopeConfig` keyword arguments.

This module sits below ``ropekit.config`` and returns plain dicts; ``RopeConfig.from_hf`` turns them into a
config (which is where schedule keys and values are validated). It understands both forms HF has used:

* legacy: top-level ``rope_theta`` + ``rope_scaling`` (with the old ``type`` alias),
  ``partial_rotary_factor``, GPT-NeoX's ``rotary_pct`` / ``rotary_emb_base``, GPT-J's ``rotary_dim``, and
  Phi-3's top-level ``original_max_position_embeddings`` (which wins over rope_scaling's, as in HF);
* v5: ``rope_parameters`` with ``rope_theta`` inside it, possibly nested per layer type
  (``{"full_attention": {...}, "sliding_attention": {...}}``) for models mixing sliding and full attention.
  Gemma 3's legacy ``rope_local_base_freq`` and ModernBERT's ``global_rope_theta`` / ``local_rope_theta``
  are read into the same per-layer-type form.

Model-specific forms read into ropekit's vocabulary: HunYuan's ``"dynamic"`` + ``alpha`` (rope_type
``ntk_alpha``), Qwen2.5-1M's ``dual_chunk_attention_config`` (``dual_chunk``), Llama 4's vision config
(``axial``, two sections) and its NoPE temperature (``floor_scale`` / ``attn_scale``), ERNIE 4.5-VL's M-RoPE
(``mrope_layout: "ernie"``, from ``mrope_section`` or Baidu's ``freq_allocation``); DeepSeek-V3.2's indexer
has its own reader, :func:`indexer_rope_kwargs`.

head_dim comes from ``head_dim`` (DeepSeek's ``qk_rope_head_dim`` first), else
hidden_size // num_attention_heads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ropekit.schedules import get_schedule
from ropekit.schedules.registry import STRUCTURAL_KEYS, RopeSpec, split_scaling
from ropekit.schedules.yarn import telechat3_attention_factor
from ropekit.validation import check_fraction, check_int, describe

__all__ = [
    "fope_basis_kwargs",
    "indexer_rope_kwargs",
    "layer_overrides",
    "layer_rope_kwargs",
    "layer_types",
    "load_hf_config",
    "rope_kwargs",
    "rope_layer_types",
    "with_derived_layer_types",
]

log = logging.getLogger(__name__)

# HF's default rope_theta when a config names none.
DEFAULT_THETA = 10000.0
# model_type values whose HF modeling code pairs features (2i, 2i+1) (GPT-J style) rather than (i, i + d/2).
INTERLEAVED_MODEL_TYPES = frozenset(
    {
        "gptj", "codegen", "cohere", "cohere2", "deepseek_v2",
        # ERNIE 4.5 (rotate_half_text) and Llama 4 (complex pairs, text and vision) pair (2i, 2i+1) too.
        "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text", "ernie4_5_moe_vl",
        "llama4", "llama4_text", "llama4_vision_model",
        # Found by proving ropekit.model_rope against each model's layers (tests/test_layer_rope.py).
        "cohere2_moe", "glm", "glm4", "glm4v", "glm_ocr", "helium", "openai_privacy_filter", "moonshine",
        "moonshine_streaming",
    }
)  # fmt: skip
# model_type values whose rotation ropekit's RopeConfig cannot describe: NanoChat's rotate_half flips the
# other sign, a rotation by -angle.
UNDESCRIBED_MODEL_TYPES = {
    "nanochat": "its rotate_half flips the other sign (a rotation by -angle)",
    # New or changed in transformers 5.25; the proof of tests/test_layer_rope.py measured these layers away
    # from the plan model_rope would give, so it refuses them rather than describe them wrongly.
    "ergo": "its sliding-attention layers' rotation differs from the plan read from its config (by 1.28)",
    "hy_v4": "its indexed-attention layers' interleaved rotation differs from the plan read from its config "
    "(by 1.51)",
}
# model_type values whose transformers config class derives ``layer_types`` when a config.json omits it
# (from sliding_window_pattern, use_sliding_window / max_window_layers, no_rope_layer_interval, ...): the
# default config of each has layer_types (transformers 5.25.0, the pinned version; tests/test_layer_rope.py
# checks it against transformers). Read without transformers, such a config.json is refused rather than
# planned as if every layer were alike.
DERIVES_LAYER_TYPES = frozenset(
    {
        "afmoe", "audioflamingo3", "axk2", "aya_vision", "bailing_hybrid", "beam", "cohere2",
        "cohere2_moe", "cohere2_vision", "cohere_compass", "cohere_compass_text", "cwm",
        "deepseek_ocr2_encoder", "deepseek_v32", "deepseek_v4", "diffusion_gemma",
        "diffusion_gemma_text", "dory", "dots1", "dots3_note", "dots3_note_text", "embedding_gemma2",
        "embedding_gemma2_text", "ergo", "exaone4", "exaone4_5", "exaone_moe", "fast_vlm", "flint",
        "fun_asr_nano", "gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4",
        "gemma4_text", "gemma4_unified", "gemma4_unified_assistant", "gemma4_unified_text", "glm5_next",
        "glm5_next_text", "glm_moe_dsa", "got_ocr2", "gpt_oss", "granite_swa", "granitemoe_swa",
        "granitemoehybrid", "hy_v4", "hy_v4_vl", "hy_v4_vl_text", "inkling2", "inkling2_loop",
        "inkling2_loop_text", "inkling2_text", "inkling_mm_model", "inkling_text", "internvl", "jev",
        "kimi_linear", "kolibri1", "kolibri1_1", "laguna", "lara_mini", "lfm2", "lfm2_vl", "lfm3",
        "lfm3_vl", "lfm3_vl_vision", "lighton_ocr", "llama4", "llama4_text", "llava_onevision",
        "llava_onevision1_5", "mellum", "mimo_v2_flash", "minicpm_ocr", "minicpmv4_6", "minicpmv4_7",
        "minimax", "minimax_m3_vl", "minimax_m3_vl_text", "ministral", "mistral_large4",
        "mistral_large4_text", "modernbert", "modernbert-decoder", "modernvbert",
        "moss_transcribe_diarize", "muse_glimmer", "muse_glimmer_assistant", "muse_glimmer_text",
        "muse_glimmer_vision", "muse_spark", "muse_spark_text", "muse_spark_vision", "musicflamingo",
        "neomme", "olmo3", "olmo_hybrid", "ovis2", "ovis2_5", "ovis2_5_vision", "pe_audio",
        "pe_audio_video", "pe_video", "pp_chart2table", "pp_doclayout_v2", "pp_doclayout_v3",
        "qianfan_ocr", "qwen2", "qwen2_5_omni_talker", "qwen2_5_omni_text", "qwen2_5_omni_thinker",
        "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_audio", "qwen2_moe", "qwen2_vl", "qwen2_vl_text",
        "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_asr",
        "qwen3_next", "qwen3_omni_moe_talker_code_predictor", "qwen4_exp", "qwen4_exp_text",
        "shieldgemma2", "smollm3", "step3p5", "step3p7", "t5_gemma_module", "t5gemma", "t5gemma2",
        "t5gemma2_decoder", "t5gemma2_encoder", "t5gemma2_text", "ultrabert", "ultravbert",
        "unlimited_ocr", "unlimited_ocr_text", "vaultgemma", "vibevoice", "vibevoice_asr",
        "video_llama_3", "zaya"
    }
)  # fmt: skip
# model_type values that read the rotary width from rope_parameters only, though their config has rotary_dim.
IGNORE_ROTARY_DIM = frozenset({"minimax_m2", "minimax_m3_vl", "neomme", "qwen4_exp"})
# M-RoPE sections HF's multimodal modules fall back to when a config omits them, and the layout the model type
# always uses (Qwen3-VL's module interleaves whatever mrope_interleaved says; ERNIE 4.5-VL alternates h / w
# and puts t last; None: the config's own mrope_interleaved decides).
MROPE_DEFAULTS = {
    "qwen2_vl": ([16, 24, 24], None),
    "qwen2_5_vl": ([16, 24, 24], None),
    "qwen3_vl": ([24, 20, 20], "interleaved"),
    "qwen3_vl_moe": ([24, 20, 20], "interleaved"),
    "ernie4_5_vl_moe": ([22, 22, 20], "ernie"),
    "ernie4_5_moe_vl": ([22, 22, 20], "ernie"),  # the type name in Baidu's own config.json
}
# MLA models whose attention multiplies the softmax scale by YaRN's mscale(f, mscale_all_dim)^2 and pairs its
# rotated slice (2i, 2i+1) unless rope_interleave is false.
MLA_MODEL_TYPES = frozenset(
    {
        "deepseek_v3", "deepseek_v32", "mistral4", "mistral_large4", "axk1", "axk2", "bailing_hybrid",
        "longcat_flash", "youtu", "glm_moe_dsa", "glm4_moe_lite", "dots3_note", "hy_v4_vl",
    }
)  # fmt: skip
# DeepSeek-V4 keys its RoPE parameters by rope label, not by layer type: its sliding-window layers rotate with
# "main" (rope_theta), the compressed ones with "compress" (compress_rope_theta); HF DeepseekV4Attention.
DEEPSEEK_V4_ROPE_LABELS = {
    "sliding_attention": "main",
    "compressed_sparse_attention": "compress",
    "heavily_compressed_attention": "compress",
}
# Gemma 4's full-attention layers are wider than its sliding ones: HF's Gemma4TextConfig gives them
# global_head_dim (512 unless the config names one) through its per_layer_config.
GEMMA4_GLOBAL_HEAD_DIM = 512
# Ministral 3 / Mistral 4 scale every query by position (llama_4_scaling_beta, inside rope_parameters).
POSITION_SCALING_KEY = "llama_4_scaling_beta"
# Keys HunYuan's "dynamic" + alpha configs publish that its NTK-alpha RoPE never reads.
HUNYUAN_UNUSED = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# Llama 4's defaults for the NoPE layers' query temperature (HF Llama4TextConfig).
LLAMA4_TEMPERATURE = {"floor_scale": 8192, "attn_scale": 0.1}
# Schedules that read original_max_position_embeddings; Phi-3 keeps it at the top level of config.json. When a
# config names none, HF fills it from max_position_embeddings, and so do we.
USES_ORIGINAL_LENGTH = frozenset({"llama3", "yarn", "longrope", "su"})


def load_hf_config(config: Any) -> dict[str, Any]:
    """Return the config as a plain dict, from a PretrainedConfig, a dict, a config.json path or its folder.

    Multimodal configs that keep the language model under ``text_config`` (v5 Qwen2-VL, ...) are unwrapped
    when the top level carries no RoPE keys.

    Raises:
        ValueError: for a path that does not exist or is not JSON, or an object of another type.
    """
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"config: expected a config.json file or a folder holding one, got {str(config)!r}"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"config: could not read {str(path)!r} as JSON ({err})") from None
    elif isinstance(config, Mapping):
        data = dict(config)
    elif callable(getattr(config, "to_dict", None)):
        data = config.to_dict()
    else:
        raise ValueError(
            "config: expected a PretrainedConfig, a dict, or a path to config.json, "
            f"got {type(config).__name__}"
        )
    if not isinstance(data, dict):
        raise ValueError(f"config: expected a JSON object, got {type(data).__name__}")
    return _language_config(data)


def _language_config(data: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` (multimodal models) or ``thinker_config.text_config``
    (Qwen-Omni), merged over the outer keys, when the outer level carries no RoPE keys itself."""
    for key in ("thinker_config", "text_config"):
        inner = data.get(key)
        if isinstance(inner, Mapping) and not _has_rope_keys(data):
            data = {**{k: v for k, v in data.items() if k != key}, **inner}
    return data


def _has_rope_keys(d: Mapping[str, Any]) -> bool:
    keys = ("rope_theta", "rope_scaling", "rope_parameters", "rotary_emb_base", "rotary_pct", "rotary_dim")
    return any(d.get(k) is not None for k in keys)


def _mapping(d: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    """A copy of d[key] when it is a dict, None when absent or null; anything else is a ValueError."""
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"config[{key!r}]: expected a dict such as {{'rope_type': 'linear', 'factor': 4.0}} or null, "
            f"got {describe(value)}"
        )
    return dict(value)


def _per_layer_parameters(d: Mapping[str, Any]) -> dict[str, Any] | None:
    """The per-layer-type RoPE dicts, or None for a model with one RoPE for every layer."""
    params = _mapping(d, "rope_parameters")
    if (
        isinstance(params, Mapping)
        and params
        and all(v is None or isinstance(v, Mapping) for v in params.values())
    ):
        return {k: None if v is None else dict(v) for k, v in params.items()}
    scaling = _mapping(d, "rope_scaling") or {}
    if d.get("rope_local_base_freq") is not None:  # Gemma 3: scaling applies to the global layers only
        return {
            "full_attention": {**scaling, "rope_theta": d.get("rope_theta", 1_000_000.0)},
            "sliding_attention": {"rope_type": "default", "rope_theta": d["rope_local_base_freq"]},
        }
    if d.get("global_rope_theta") is not None or d.get("local_rope_theta") is not None:  # ModernBERT
        return {
            "full_attention": {**scaling, "rope_theta": d.get("global_rope_theta", 160_000.0)},
            "sliding_attention": {**scaling, "rope_theta": d.get("local_rope_theta", DEFAULT_THETA)},
        }
    return None


def rope_layer_types(config: Any) -> list[str]:
    """The layer types that carry their own RoPE parameters ([] when one RoPE serves every layer).

    Example:
        >>> {t: RopeConfig.from_hf(cfg, layer_type=t) for t in rope_layer_types(cfg)}  # doctest: +SKIP
    """
    nested = _per_layer_parameters(load_hf_config(config))
    return [] if nested is None else sorted(k for k, v in nested.items() if v is not None)


def _head_dim(d: Mapping[str, Any]) -> int:
    keys = ("head_dim",) if _model_type(d) == "deepseek_v4" else ("qk_rope_head_dim", "head_dim")
    # attention_head_dim: Zamba 2's attention heads (2 * hidden_size / heads wide; HF maps head_dim to it),
    # where its kv_channels is hidden_size / heads
    for key in (*keys, "attention_head_dim", "kv_channels"):
        if d.get(key) is not None:
            return check_int(f"config[{key!r}]", d[key])
    hidden_key = next((k for k in ("hidden_size", "n_embd", "d_model") if d.get(k) is not None), None)
    heads_key = next((k for k in ("num_attention_heads", "n_head", "n_heads") if d.get(k) is not None), None)
    if hidden_key is None or heads_key is None:
        found = (("hidden_size", hidden_key), ("num_attention_heads", heads_key))
        missing = [k for k, v in found if v is None]
        raise ValueError(
            f"config: cannot tell the head width; expected 'head_dim', or 'hidden_size' and "
            f"'num_attention_heads' (missing {missing})"
        )
    heads = check_int(f"config[{heads_key!r}]", d[heads_key])  # True is not one head
    hidden = check_int(f"config[{hidden_key!r}]", d[hidden_key])
    if hidden % heads:
        raise ValueError(
            f"config['hidden_size']: expected a multiple of num_attention_heads ({heads!r}), got {hidden!r}"
        )
    return hidden // heads


def _rope_parameters(d: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The one RoPE parameter dict that applies (rope_theta inside), in HF's v5 vocabulary."""
    nested = _per_layer_parameters(d)
    if nested is not None:
        if layer_type is None:
            raise ValueError(
                f"layer_type: this config has per-layer-type RoPE parameters {sorted(nested)}; "
                "pass one of them (RopeConfig.from_hf(config, layer_type=...))"
            )
        if layer_type not in nested and _model_type(d) == "deepseek_v4":
            layer_type = DEEPSEEK_V4_ROPE_LABELS.get(layer_type, layer_type)
        if layer_type not in nested:
            raise ValueError(f"layer_type: expected one of {sorted(nested)}, got {layer_type!r}")
        if nested[layer_type] is None:
            raise ValueError(
                f"layer_type: {layer_type!r} layers use no RoPE (their rope_parameters are null)"
            )
        params, where = nested[layer_type], f"config['rope_parameters'][{layer_type!r}]"
    else:
        declared = d.get("layer_types") or []
        if layer_type is not None and layer_type not in declared:
            raise ValueError(
                f"layer_type: this config uses one RoPE for every layer; expected None"
                f"{' or one of ' + str(sorted(set(declared))) if declared else ''}, got {layer_type!r}"
            )
        # HF: rope_scaling, when set, replaces rope_parameters.
        where = "config['rope_scaling']" if _mapping(d, "rope_scaling") else "config['rope_parameters']"
        params = _mapping(d, "rope_scaling") or _mapping(d, "rope_parameters") or {}
    theta = d.get("rope_theta", d.get("rotary_emb_base", DEFAULT_THETA))
    params.setdefault("rope_theta", DEFAULT_THETA if theta is None else theta)
    partial = d.get("partial_rotary_factor", d.get("rotary_pct"))
    if partial is not None:
        params.setdefault("partial_rotary_factor", partial)
    kind = params.get("rope_type", params.get("type", "default"))
    if d.get("model_type") == "phi3" and kind == "yarn":  # Phi-3's early configs; HF reads them as longrope
        kind = "longrope"
    params.pop("type", None)
    params["rope_type"] = kind
    model_type = _model_type(d)
    if (
        kind == "xdrope"
    ):  # HunYuan-VL's config.json: NTK-alpha over four chunked sections (as transformers reads it)
        kind = params["rope_type"] = "dynamic"
    if params.get("xdrope_section") is not None:  # its legacy name for mrope_section
        params.setdefault("mrope_section", params.pop("xdrope_section"))
    if kind == "telechat3-yarn":  # YaRN with 0.07 ln(factor) + 1 in the tables (vLLM 0.11's TeleChat3 class)
        kind = params["rope_type"] = "yarn"
        if isinstance(params.get("factor"), (int, float)):
            attn = params.pop("attn_factor", 1.0)
            params.setdefault("attention_factor", telechat3_attention_factor(params["factor"], attn))
    if kind == "dynamic" and params.get("alpha"):  # HunYuan: a fixed alpha makes it static NTK
        kind = params["rope_type"] = "ntk_alpha"
        # HunYuan's configs carry YaRN-style keys next to alpha; its modeling code reads alpha only.
        for key in HUNYUAN_UNUSED:
            params.pop(key, None)
    if kind == "default" and isinstance(d.get("dual_chunk_attention_config"), Mapping):  # Qwen2.5-1M
        dca = d["dual_chunk_attention_config"]
        kind = params["rope_type"] = "dual_chunk"
        params.update({k: dca[k] for k in ("chunk_size", "local_size") if k in dca})
        if dca.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = dca["original_max_position_embeddings"]
    if model_type in MROPE_DEFAULTS:
        section, layout = MROPE_DEFAULTS[model_type]
        if MROPE_DEFAULTS[model_type][1] == "ernie" and d.get("freq_allocation") is not None:
            # Baidu's own config.json: freq_allocation pairs follow t, the rest alternate h / w.
            half = (_head_dim(d) // 2 - d["freq_allocation"]) // 2
            section = [half, half, d["freq_allocation"]]
        params.setdefault("mrope_section", section)
        if layout == "interleaved":
            params["mrope_interleaved"] = True
        elif layout is not None:
            params.pop("mrope_interleaved", None)
            params["mrope_layout"] = layout
    if model_type == "llama4_vision_model":  # 2-D axial: patch column and row, each its own frequencies
        per_axis = _head_dim(d) // 4
        kind = params["rope_type"] = "axial"
        params["mrope_section"] = [per_axis, per_axis]
    if model_type == "llama4" and d.get("attn_temperature_tuning", True):
        params.update({key: d.get(key, default) for key, default in LLAMA4_TEMPERATURE.items()})
    if params.get(POSITION_SCALING_KEY) is not None and (
        params.get("original_max_position_embeddings") is None
        or "original_max_position_embeddings" not in get_schedule(kind).optional | get_schedule(kind).required
    ):
        raise ValueError(
            f"{where}: {POSITION_SCALING_KEY} scales queries by position over the rope_parameters' "
            f"original_max_position_embeddings, which rope_type {kind!r} does not carry; ropekit reads it "
            "with "
            "the schedules that take that key (yarn, llama3, longrope)"
        )
    if kind in USES_ORIGINAL_LENGTH:
        if d.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        elif d.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    return _known_keys(params, where)


def _model_type(d: Mapping[str, Any]) -> str:
    """The config's model_type without the ``_text`` suffix of a multimodal model's language config."""
    return str(d.get("model_type") or "").removesuffix("_text")


def with_derived_layer_types(d: dict[str, Any]) -> dict[str, Any]:
    """d with the ``layer_types`` its transformers config class derives when a config.json omits it (an
    older release's config.json; Qwen2's use_sliding_window / max_window_layers, Gemma 2's alternation, ...),
    as ``from_pretrained`` would build it; d itself when it has them or its model type derives none.

    A config transformers itself refuses to build is returned as it is (ropekit's own checks then name the
    key; a warning says layer_types could not be derived).

    Raises:
        ValueError: layer_types omitted for a model type that derives them, and transformers is not
            installed to derive them.
    """
    model_type = d.get("model_type")
    if d.get("layer_types") is not None or not isinstance(model_type, str):
        return d
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        if model_type in DERIVES_LAYER_TYPES:
            raise ValueError(
                f"config['layer_types']: not given, and a {model_type!r} config derives it from its other "
                "keys when transformers builds it; install transformers or pass the PretrainedConfig "
                "(or a config with layer_types)"
            ) from None
        return d
    if model_type not in CONFIG_MAPPING:
        return d
    try:
        built = CONFIG_MAPPING[model_type].from_dict(dict(d))
    except Exception as err:  # a config transformers refuses: ropekit's own checks name the bad key
        if model_type in DERIVES_LAYER_TYPES:
            log.warning(
                "config['layer_types'] not given and transformers could not build the %r config to derive it "
                "(%s); reading the config as it is",
                model_type,
                err,
            )
        return d
    built_dict = built.to_dict()
    derived = built_dict.get("layer_types")  # a config key as config.json holds it, not a property
    if derived is None:
        return d
    # The count the types were derived for (Dory's class counts its blocks, not config.json's entries).
    count = {k: built_dict[k] for k in ("num_hidden_layers",) if k in built_dict}
    return {**d, **count, "layer_types": list(derived)}


def layer_types(config: Any) -> list[str] | None:
    """The config's ``layer_types`` (one per decoder layer), or None when it has none."""
    d = load_hf_config(config)
    return None if d.get("layer_types") is None else list(d["layer_types"])


def layer_overrides(d: Mapping[str, Any], index: int, layer_type: str | None) -> dict[str, Any]:
    """The keys that layer `index` changes over the config (HF's ``per_layer_config``: Gemma 4's wider
    full-attention heads), or {} for a layer like every other.

    Gemma 4's config.json names ``global_head_dim`` instead; HF turns it into the same per-layer head width.
    """
    per_layer = d.get("per_layer_config")
    if per_layer is not None:
        if not isinstance(per_layer, Mapping):
            raise ValueError(
                f"config['per_layer_config']: expected a dict {{layer index: keys it changes}}, "
                f"got {describe(per_layer)}"
            )
        for key, value in per_layer.items():
            if str(key).isdigit() and int(key) == index:
                if not isinstance(value, Mapping):
                    raise ValueError(
                        f"config['per_layer_config'][{key!r}]: expected a dict of keys the layer changes, "
                        f"got {describe(value)}"
                    )
                return dict(value)
        return {}
    if _model_type(d) in ("gemma4", "gemma4_unified") and layer_type == "full_attention":
        return {"head_dim": d.get("global_head_dim") or GEMMA4_GLOBAL_HEAD_DIM}
    return {}


def _type_overrides(d: Mapping[str, Any], layer_type: str | None) -> dict[str, Any]:
    """The per-layer keys every layer of `layer_type` shares (a ValueError when they differ)."""
    if layer_type is None:
        return layer_overrides(d, -1, None)
    declared = d.get("layer_types") or []
    if _model_type(d) == "deepseek_v4":
        return {}
    found = [layer_overrides(d, i, t) for i, t in enumerate(declared) if t == layer_type]
    if not found:
        return layer_overrides(d, -1, layer_type)
    if any(f != found[0] for f in found):
        raise ValueError(
            f"layer_type: the {layer_type!r} layers of this config differ among themselves "
            f"(per_layer_config); read them one by one with ropekit.model_rope(config)"
        )
    return found[0]


def _known_keys(params: dict[str, Any], where: str) -> dict[str, Any]:
    """Check the keys against the schedule as HF does: a missing required key is an error, an unknown one is
    logged and dropped (Hub configs carry stray keys that HF ignores too)."""
    if not isinstance(params["rope_type"], str):
        raise ValueError(f"{where}['rope_type']: expected a string, got {describe(params['rope_type'])}")
    sched = get_schedule(params["rope_type"])
    missing = sorted(sched.required - params.keys())
    if missing:
        raise ValueError(
            f"{where}: rope_type {params['rope_type']!r} requires the keys {missing}, which are missing "
            f"(it takes {sorted(sched.required)}, optionally {sorted(sched.optional)})"
        )
    unknown = sorted(params.keys() - sched.required - sched.optional - STRUCTURAL_KEYS)
    if unknown:
        log.warning(
            "%s: ignoring keys %s, which rope_type %r does not use (it takes %s)",
            where,
            unknown,
            params["rope_type"],
            sorted(sched.required | sched.optional),
        )
    return {key: value for key, value in params.items() if key not in unknown}


def rope_kwargs(config: Any, *, layer_type: str | None = None) -> dict[str, Any]:
    """RopeConfig keyword arguments for a Hugging Face config.

    Args:
        config: a ``PretrainedConfig``, a dict, a config.json path or the folder holding it.
        layer_type: for per-layer-type RoPE (see :func:`rope_layer_types`), which entry to read;
            "indexer" on a config with ``index_head_dim`` (DeepSeek-V3.2) reads the lightning indexer's RoPE
            (:func:`indexer_rope_kwargs`).

    Returns:
        dict with head_dim, base, rotary_dim, interleaved, scaling and max_position_embeddings.

    Raises:
        ValueError: when the head width cannot be found, layer_type is missing or unknown, or a value has the
            wrong type. Schedule keys and values are checked by RopeConfig itself.
    """
    d = load_hf_config(config)
    if layer_type == "indexer" and d.get("index_head_dim") is not None:  # DeepSeek-V3.2's lightning indexer
        return indexer_rope_kwargs(d)
    return layer_rope_kwargs(d, layer_type, _type_overrides(d, layer_type))


# Keys that make a RoPE FoPE (vLLM's InternS1-Pro model sets use_fope when any of the last three is not None).
FOPE_KEYS = ("use_fope", "fope_init_factor", "fope_sep_head", "num_inv_freq")


def layer_rope_kwargs(d: Mapping[str, Any], layer_type: str | None, overrides: Mapping[str, Any]) -> dict:
    """:func:`rope_kwargs` for one layer: the loaded config `d` with that layer's `overrides` (see
    :func:`layer_overrides`) and its entry of per-layer-type RoPE parameters."""
    d = {**d, **overrides}
    head_dim = _head_dim(d)
    raw = [d[k] for k in ("rope_parameters", "rope_scaling") if isinstance(d.get(k), Mapping)]
    fope = [k for r in raw for k in FOPE_KEYS if r.get(k) is not None and r.get(k) is not False]
    if fope:
        raise ValueError(
            f"config['rope_parameters']: {fope} make this RoPE FoPE (Intern-S1-Pro; vLLM's "
            "FourierRotaryEmbedding): learned per-head mixtures of the Fourier basis, not a rotation a "
            "RopeConfig describes; use ropekit.compat.vllm_variants.FourierRotaryEmbedding (its frequency "
            "basis is fope_basis_kwargs(config))"
        )
    params = _rope_parameters(d, layer_type)
    base = params.pop("rope_theta")
    model_type = _model_type(d)
    if model_type in UNDESCRIBED_MODEL_TYPES:
        raise ValueError(
            f"config['model_type']: {model_type!r} cannot be described by a RopeConfig: "
            f"{UNDESCRIBED_MODEL_TYPES[model_type]}"
        )
    rotary_dim = d.get("rotary_dim")
    if model_type in IGNORE_ROTARY_DIM:
        rotary_dim = None
    elif rotary_dim is not None:  # '64' or 63.5 was read as no rotary_dim: the whole head rotated
        rotary_dim = check_int("config['rotary_dim']", rotary_dim)
    rotary_position = "first"
    if model_type in MLA_MODEL_TYPES and isinstance(d.get("qk_rope_head_dim"), int):
        rotary_dim = head_dim = _mla_rope_width(d, params)
    elif model_type == "deepseek_v4":
        # [nope | rope] heads of head_dim features: the trailing partial_rotary_factor of them rotate.
        head_dim, rotary_position = d["head_dim"], "last"
    if params["rope_type"] != "proportional":  # proportional reads the factor itself, over the full width
        partial = params.pop("partial_rotary_factor", None)
        if partial is not None and rotary_dim is None:
            check_fraction("config['partial_rotary_factor']", partial)
            rotary_dim = int(head_dim * partial)
    interleaved = (
        model_type in INTERLEAVED_MODEL_TYPES
        or model_type == "deepseek_v4"
        or (model_type in MLA_MODEL_TYPES and d.get("rope_interleave", True) is not False)
    )
    if model_type == "llama4_vision_model":
        rotary_dim = 4 * (head_dim // 4)
    max_positions = d.get("max_position_embeddings", d.get("n_positions"))
    scaling = None if params == {"rope_type": "default"} else params
    kwargs = {
        "head_dim": head_dim,
        "base": base,
        "rotary_dim": rotary_dim,
        "interleaved": bool(interleaved),
        "scaling": scaling,
        "max_position_embeddings": max_positions,
    }
    if rotary_position != "first":
        kwargs["rotary_position"] = rotary_position
    return kwargs


def _mla_rope_width(d: Mapping[str, Any], params: dict[str, Any]) -> int:
    """An MLA model's rotated slice (qk_rope_head_dim), checked against the partial_rotary_factor HF reads.

    MLA heads are [nope | rope]; like DeepSeek-V3's, the RopeConfig describes the rotated slice itself. Where
    rope_parameters give the rotated part as a fraction of the whole q/k head (Mistral 4: of
    qk_nope_head_dim + qk_rope_head_dim; dots3: of head_dim), it must come to qk_rope_head_dim.
    """
    rope = check_int("config['qk_rope_head_dim']", d.get("qk_rope_head_dim"))
    nope = check_int(
        "config['qk_nope_head_dim']", d.get("qk_nope_head_dim") or 0, minimum=0, expected="an integer >= 0"
    )
    partial = params.pop("partial_rotary_factor", None)
    whole = (
        d.get("head_dim") if isinstance(d.get("head_dim"), int) and d.get("head_dim") > rope else rope + nope
    )
    if partial is not None and int(whole * partial) != rope:
        raise ValueError(
            f"config['rope_parameters']['partial_rotary_factor']: {partial!r} of the {whole}-wide q/k "
            f"head is {int(whole * partial)} features, but the model rotates qk_rope_head_dim = {rope}"
        )
    if _model_type(d) == "mistral4" and params["rope_type"] == "default" and nope:
        raise ValueError(
            "config['rope_parameters']['rope_type']: Mistral 4's 'default' RoPE in transformers builds its "
            f"frequencies over the whole {rope + nope}-wide head (it ignores partial_rotary_factor), which "
            f"does not fit the {rope} features it rotates; ropekit will not guess which one is meant"
        )
    return rope


def fope_basis_kwargs(config: Any) -> dict[str, Any]:
    """RopeConfig keyword arguments for the frequency basis of a FoPE config: its RoPE with the FoPE keys
    dropped (theta_i = base^(-2i / D) over the head, of which FoPE keeps the first num_inv_freq, or those
    above 2 pi / max_position_embeddings, and mixes them with learned coefficients)."""
    d = load_hf_config(config)
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(key), Mapping):
            d[key] = {k: v for k, v in d[key].items() if k not in FOPE_KEYS}
    return rope_kwargs(d)


def indexer_rope_kwargs(config: Any) -> dict[str, Any]:
    """RopeConfig keyword arguments for DeepSeek-V3.2's lightning indexer, beside its MLA attention.

    The indexer rotates with the same cos/sin tables as MLA (same schedule and table factor) but pairs the
    halves (i, i + d/2) where MLA interleaves, rotates the *first* qk_rope_head_dim features of its
    index_head_dim-wide heads, and scores with 1 / sqrt(index_head_dim) only (Hugging Face
    ``DeepseekV32Indexer``). So the DeepSeek keys mscale / mscale_all_dim become the explicit YaRN
    ``attention_factor`` they imply for the tables, and :meth:`RopeConfig.softmax_scale` then adds no
    mscale^2.

    Raises:
        ValueError: for a config without index_head_dim or qk_rope_head_dim.
    """
    d = load_hf_config(config)
    for key in ("index_head_dim", "qk_rope_head_dim"):
        if not isinstance(d.get(key), int):
            raise ValueError(
                f"config[{key!r}]: expected the indexer's width (an integer), got {describe(d.get(key))}"
            )
    kwargs = rope_kwargs(d)
    scaling = kwargs["scaling"]
    if scaling is not None and scaling.get("mscale_all_dim"):
        # the tables' factor (RopeConfig.attention_scaling), from the schedule itself: this module sits below
        # RopeConfig (config.py reads configs through it) and never builds one. No width enters the factor.
        schedule, params = split_scaling(scaling)
        widths = d["qk_rope_head_dim"], d["index_head_dim"]
        spec = RopeSpec(kwargs["base"], *widths, kwargs["max_position_embeddings"], params)
        if schedule.validate is not None:
            schedule.validate(spec)
        table_factor = float(schedule.fn(spec, None)[1])
        scaling = {k: v for k, v in scaling.items() if k not in ("mscale", "mscale_all_dim")}
        scaling["attention_factor"] = table_factor
    return {
        **kwargs,
        "head_dim": d["index_head_dim"],
        "rotary_dim": d["qk_rope_head_dim"],
        "interleaved": False,
        "scaling": scaling,
    }
