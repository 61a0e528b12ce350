"""Presets: the RoPE-relevant part of well-known models' published config.json, embedded as data.

Each entry keeps the keys exactly as the model's ``config.json`` on the Hugging Face Hub spells them (legacy
form included), with the file it came from, and is read through :mod:`ropekit.hf_config` like any other
config. ``RopeConfig.preset(name)`` builds the config; ``ropekit presets`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ropekit.hf_config import fope_basis_kwargs, indexer_rope_kwargs, rope_kwargs

__all__ = ["PRESETS", "Preset", "get_preset", "preset_kwargs"]


@dataclass(frozen=True)
class Preset:
    """One model's RoPE facts.

    Attributes:
        name: the preset's name.
        model: the Hugging Face repository.
        source: where the facts come from (a config.json on the Hub, or the model card for documented
            settings).
        config: the config.json keys that decide RoPE, as published.
        note: anything a user should know (documented settings that are not in config.json, quirks).
        part: which RoPE of the model the preset describes: "" for its attention, "indexer" for
            DeepSeek-V3.2's lightning indexer (read with :func:`ropekit.hf_config.indexer_rope_kwargs`),
            "fope_basis" for the frequency basis of a FoPE model (Intern-S1-Pro; read with
            :func:`ropekit.hf_config.fope_basis_kwargs`: the learned mixtures are the checkpoint's).
        layer_type: for models whose layers differ (Gemma 4, DeepSeek-V4), which layers' RoPE the preset
            describes; ``ropekit.model_rope(preset.config)`` gives every layer's.
    """

    name: str
    model: str
    source: str
    config: dict[str, Any]
    note: str = ""
    part: str = ""
    layer_type: str = ""


def _hub(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


# Phi-3-mini-128k's LongRoPE rescale factors, one per pair (head_dim 96 -> 48 pairs), as published in the
# April 2024 config.json of microsoft/Phi-3-mini-128k-instruct (microsoft/Phi-3-vision-128k-instruct ships the
# same lists). The July 2024 refresh of the mini model replaced them; see its config.json for those.
# fmt: off
_PHI3_LONG = [
    1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0799999237060547, 1.2299998998641968,
    1.2299998998641968, 1.2999999523162842, 1.4499999284744263, 1.5999999046325684, 1.6499998569488525,
    1.8999998569488525, 2.859999895095825, 3.68999981880188, 5.419999599456787, 5.489999771118164,
    5.489999771118164, 9.09000015258789, 11.579999923706055, 15.65999984741211, 15.769999504089355,
    15.789999961853027, 18.360000610351562, 21.989999771118164, 23.079999923706055, 30.009998321533203,
    32.35000228881836, 32.590003967285156, 35.56000518798828, 39.95000457763672, 53.840003967285156,
    56.20000457763672, 57.95000457763672, 59.29000473022461, 59.77000427246094, 59.920005798339844,
    61.190006256103516, 61.96000671386719, 62.50000762939453, 63.3700065612793, 63.48000717163086,
    63.48000717163086, 63.66000747680664, 63.850006103515625, 64.08000946044922, 64.760009765625,
    64.80001068115234, 64.81001281738281, 64.81001281738281,

]
_PHI3_SHORT = [
    1.05, 1.05, 1.05, 1.1, 1.1, 1.1, 1.2500000000000002, 1.2500000000000002, 1.4000000000000004,
    1.4500000000000004, 1.5500000000000005, 1.8500000000000008, 1.9000000000000008, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
    2.000000000000001, 2.000000000000001, 2.000000000000001, 2.1000000000000005, 2.1000000000000005, 2.2,
    2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3499999999999996, 2.3999999999999995,
    2.3999999999999995, 2.6499999999999986, 2.6999999999999984, 2.8999999999999977, 2.9499999999999975,
    3.049999999999997, 3.049999999999997, 3.049999999999997,
]
# fmt: on

_ENTRIES = [
    Preset(
        "llama-2-7b",
        "meta-llama/Llama-2-7b-hf",
        _hub("meta-llama/Llama-2-7b-hf"),
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rope_scaling": None,
        },
    ),
    Preset(
        "llama-3-8b",
        "meta-llama/Meta-Llama-3-8B",
        _hub("meta-llama/Meta-Llama-3-8B"),
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
            "rope_scaling": None,
        },
    ),
    Preset(
        "llama-3.1-8b",
        "meta-llama/Llama-3.1-8B",
        _hub("meta-llama/Llama-3.1-8B"),
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
        },
    ),
    Preset(
        "mistral-7b",
        "mistralai/Mistral-7B-v0.1",
        _hub("mistralai/Mistral-7B-v0.1"),
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "max_position_embeddings": 32768,
            "rope_theta": 10000.0,
        },
        note="v0.1; Mistral-7B-v0.3 raised rope_theta to 1e6.",
    ),
    Preset(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B-Instruct",
        _hub("Qwen/Qwen2.5-7B-Instruct") + " + the model card's 'Processing Long Texts' section",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "num_attention_heads": 28,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
        },
        note="config.json ships rope_scaling null; the model card documents adding this YaRN x4 block "
        "for inputs past 32768 tokens (131072 in all).",
    ),
    Preset(
        "qwen2-vl-7b",
        "Qwen/Qwen2-VL-7B-Instruct",
        _hub("Qwen/Qwen2-VL-7B-Instruct"),
        {
            "model_type": "qwen2_vl",
            "hidden_size": 3584,
            "num_attention_heads": 28,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        },
        note="M-RoPE, chunked sections: positions are (temporal, height, width).",
    ),
    Preset(
        "phi-3-mini-128k",
        "microsoft/Phi-3-mini-128k-instruct",
        _hub("microsoft/Phi-3-mini-128k-instruct") + " (April 2024 release)",
        {
            "model_type": "phi3",
            "hidden_size": 3072,
            "num_attention_heads": 32,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            "rope_scaling": {"long_factor": _PHI3_LONG, "short_factor": _PHI3_SHORT, "type": "longrope"},
        },
        note="LongRoPE: short factors up to 4096 tokens, long factors beyond; attention factor "
        "sqrt(1 + ln 32 / ln 4096) = 1.19.",
    ),
    Preset(
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        _hub("deepseek-ai/DeepSeek-V3"),
        {
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "num_attention_heads": 128,
            "qk_rope_head_dim": 64,
            "max_position_embeddings": 163840,
            "rope_theta": 10000,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
        },
        note="RoPE covers the 64-wide qk_rope_head_dim slice, pairs interleaved. mscale = mscale_all_dim "
        "makes the table factor 1.0; the model instead multiplies its softmax scale by "
        "(0.1 * mscale_all_dim * ln 40 + 1)^2.",
    ),
    Preset(
        "gpt-neox-20b",
        "EleutherAI/gpt-neox-20b",
        _hub("EleutherAI/gpt-neox-20b"),
        {
            "model_type": "gpt_neox",
            "hidden_size": 6144,
            "num_attention_heads": 64,
            "max_position_embeddings": 2048,
            "rotary_emb_base": 10000,
            "rotary_pct": 0.25,
        },
        note="rotary_pct 0.25: the first 24 of 96 features rotate.",
    ),
    Preset(
        "gpt-j-6b",
        "EleutherAI/gpt-j-6b",
        _hub("EleutherAI/gpt-j-6b"),
        {"model_type": "gptj", "n_embd": 4096, "n_head": 16, "n_positions": 2048, "rotary_dim": 64},
        note="Interleaved (GPT-J) pairing; 64 of 256 features rotate; base 10000 is fixed in the code.",
    ),
    Preset(
        "gemma-2-9b",
        "google/gemma-2-9b",
        _hub("google/gemma-2-9b"),
        {
            "model_type": "gemma2",
            "hidden_size": 3584,
            "num_attention_heads": 16,
            "head_dim": 256,
            "max_position_embeddings": 8192,
            "rope_theta": 10000.0,
        },
        note="head_dim 256 is explicit (hidden_size / heads would give 224).",
    ),
]

# DeepSeek-V3.2 keeps DeepSeek-V3's RoPE and adds the lightning indexer (128 wide, 64 heads, top 2048).
_DEEPSEEK_V32 = {
    **next(p.config for p in _ENTRIES if p.name == "deepseek-v3"),
    "model_type": "deepseek_v32",
    "qk_nope_head_dim": 128,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
}
# Llama 4 Scout's text and vision configs (meta-llama/Llama-4-Scout-17B-16E, config.json).
_LLAMA4_SCOUT_TEXT = {
    "model_type": "llama4_text",
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "head_dim": 128,
    "max_position_embeddings": 262144,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attn_temperature_tuning": 4,
    "floor_scale": 8192,
    "attn_scale": 0.1,
}
_LLAMA4_SCOUT_VISION = {
    "model_type": "llama4_vision_model",
    "hidden_size": 1408,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
    "rope_theta": 10000,
}

_ENTRIES += [
    Preset(
        "hunyuan-a13b",
        "tencent/Hunyuan-A13B-Instruct",
        _hub("tencent/Hunyuan-A13B-Instruct"),
        {
            "model_type": "hunyuan_v1_moe",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "head_dim": 128,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "alpha": 1000.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "type": "dynamic",
            },
        },
        note="Labelled 'dynamic', but the fixed alpha makes it static NTK: base 1e4 * 1000^(128/126) "
        "(rope_type 'ntk_alpha'); the other keys are unused.",
    ),
    Preset(
        "qwen2.5-7b-1m",
        "Qwen/Qwen2.5-7B-Instruct-1M",
        _hub("Qwen/Qwen2.5-7B-Instruct-1M"),
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "num_attention_heads": 28,
            "max_position_embeddings": 1010000,
            "rope_theta": 10000000.0,
            "dual_chunk_attention_config": {
                "chunk_size": 262144,
                "local_size": 8192,
                "original_max_position_embeddings": 262144,
            },
        },
        note="Dual chunk attention: keys at p mod 253952; RopeConfig.dual_chunk_cos_sin gives the key, "
        "intra, succ and inter tables.",
    ),
    Preset(
        "qwen3-vl-8b",
        "Qwen/Qwen3-VL-8B-Instruct",
        _hub("Qwen/Qwen3-VL-8B-Instruct"),
        {
            "model_type": "qwen3_vl_text",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_theta": 5000000,
            "rope_scaling": {
                "mrope_interleaved": True,
                "mrope_section": [24, 20, 20],
                "rope_type": "default",
            },
        },
        note="Interleaved M-RoPE; positions from ropekit.get_rope_index (videos one frame per timestamp).",
    ),
    Preset(
        "ernie-4.5-vl-28b-a3b",
        "baidu/ERNIE-4.5-VL-28B-A3B-PT",
        _hub("baidu/ERNIE-4.5-VL-28B-A3B-PT"),
        {
            "model_type": "ernie4_5_moe_vl",
            "hidden_size": 2560,
            "num_attention_heads": 20,
            "max_position_embeddings": 131072,
            "rope_theta": 500000,
            "freq_allocation": 20,
        },
        note="3-D RoPE, interleaved pairs: the first 44 pairs alternate height / width, the last 20 "
        "(freq_allocation) follow time (mrope_layout 'ernie', sections [22, 22, 20]).",
    ),
    Preset(
        "deepseek-v3.2",
        "deepseek-ai/DeepSeek-V3.2-Exp",
        _hub("deepseek-ai/DeepSeek-V3.2-Exp"),
        _DEEPSEEK_V32,
        note="MLA: the 64-wide rope slice, interleaved pairs; softmax_scale(192) includes "
        "(0.1 ln 40 + 1)^2. The indexer is the 'deepseek-v3.2-indexer' preset.",
    ),
    Preset(
        "deepseek-v3.2-indexer",
        "deepseek-ai/DeepSeek-V3.2-Exp",
        _hub("deepseek-ai/DeepSeek-V3.2-Exp"),
        _DEEPSEEK_V32,
        note="The lightning indexer: same tables as MLA, half pairing on the first 64 of 128 features, "
        "softmax scale 1/sqrt(128) without mscale^2.",
        part="indexer",
    ),
    Preset(
        "llama-4-scout",
        "meta-llama/Llama-4-Scout-17B-16E",
        _hub("meta-llama/Llama-4-Scout-17B-16E") + " (text_config)",
        _LLAMA4_SCOUT_TEXT,
        note="RoPE on 3 of every 4 layers (no_rope_layers); the NoPE layers scale queries by "
        "attention_temperature(positions) = 1 + 0.1 ln(1 + floor((p + 1) / 8192)).",
    ),
    Preset(
        "llama-4-scout-vision",
        "meta-llama/Llama-4-Scout-17B-16E",
        _hub("meta-llama/Llama-4-Scout-17B-16E") + " (vision_config)",
        _LLAMA4_SCOUT_VISION,
        note="2-D axial RoPE over the 24 x 24 patches (head_dim 88: 22 pairs per axis, interleaved); "
        "positions from ropekit.multiaxis.llama4_vision_positions(336, 14).",
    ),
    Preset(
        "hunyuan-ocr",
        "tencent/HunyuanOCR",
        _hub("tencent/HunyuanOCR") + " (text_config)",
        {
            "model_type": "hunyuan_vl",
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "head_dim": 128,
            "max_position_embeddings": 32768,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "alpha": 1000.0,
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "type": "xdrope",
                "xdrope_section": [16, 16, 16, 16],
            },
        },
        note="XD-RoPE: NTK-alpha frequencies (base 1e4 * 1000^(128/126)) over four chunked sections of 16 "
        "pairs, positions (4, batch, seq); the YaRN-style keys are unused. transformers 5.24 reads it as "
        "'dynamic' + alpha with mrope_section; its image-token rows are no rotation (vLLM's are; ropekit "
        "follows vLLM).",
    ),
]

# The 2026 models below are published as transformers 5.24 documents them: each config class's defaults are
# stated to match the checkpoint named (its @auto_docstring), and are copied here from those defaults; the
# Hub files themselves were not read.
_TRANSFORMERS_DEFAULTS = " (as transformers 5.24's {} defaults give it)"
_GEMMA4_E2B = {
    "model_type": "gemma4_text",
    "hidden_size": 2304,
    "num_attention_heads": 8,
    "num_hidden_layers": 30,
    "head_dim": 256,
    "global_head_dim": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5,
    "max_position_embeddings": 131072,
    "sliding_window": 512,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.25,
            "rope_theta": 1000000.0,
        },
    },
}
_DEEPSEEK_V4_FLASH = {
    "model_type": "deepseek_v4",
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_hidden_layers": 43,
    "head_dim": 512,
    "layer_types": ["heavily_compressed_attention"] * 2
    + ["heavily_compressed_attention", "compressed_sparse_attention"] * 20
    + ["heavily_compressed_attention"],
    "max_position_embeddings": 1048576,
    "sliding_window": 128,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.125},
    },
}
_ENTRIES += [
    Preset(
        "gemma-4-e2b-full",
        "google/gemma-4-e2b-it",
        _hub("google/gemma-4-e2b-it") + _TRANSFORMERS_DEFAULTS.format("Gemma4TextConfig"),
        _GEMMA4_E2B,
        note="Full-attention layers (every 6th, and the last): proportional RoPE on 512-wide heads "
        "(global_head_dim), the first 128 features rotating with theta 1e6 over the whole width.",
        layer_type="full_attention",
    ),
    Preset(
        "gemma-4-e2b-sliding",
        "google/gemma-4-e2b-it",
        _hub("google/gemma-4-e2b-it") + _TRANSFORMERS_DEFAULTS.format("Gemma4TextConfig"),
        _GEMMA4_E2B,
        note="Sliding-window layers (512 keys): default RoPE, theta 1e4, on 256-wide heads.",
        layer_type="sliding_attention",
    ),
    Preset(
        "ministral-3-8b",
        "mistralai/Ministral-3-8B-Base-2512",
        _hub("mistralai/Ministral-3-8B-Base-2512") + _TRANSFORMERS_DEFAULTS.format("Ministral3Config"),
        {
            "model_type": "ministral3",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "head_dim": 128,
            "max_position_embeddings": 262144,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16384,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
            },
        },
        note="YaRN x16 from 16384; every layer scales its queries by attention_temperature(positions) = "
        "1 + 0.1 ln(1 + floor(p / 16384)).",
    ),
    Preset(
        "mistral-small-4",
        "mistralai/Mistral-Small-4-119B-2603",
        _hub("mistralai/Mistral-Small-4-119B-2603") + _TRANSFORMERS_DEFAULTS.format("Mistral4Config"),
        {
            "model_type": "mistral4",
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "head_dim": 128,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "kv_lora_rank": 256,
            "rope_interleave": True,
            "max_position_embeddings": 1048576,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 128.0,
                "original_max_position_embeddings": 8192,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1,
                "partial_rotary_factor": 0.5,
            },
        },
        note="MLA: the 64-wide rope slice (partial_rotary_factor 0.5 of the 128-wide q/k head), interleaved "
        "pairs; softmax_scale(128) includes (0.1 ln 128 + 1)^2; queries scaled by "
        "1 + 0.1 ln(1 + floor(p / 8192)).",
    ),
    Preset(
        "deepseek-v4-main",
        "deepseek-ai/DeepSeek-V4-Flash-Base",
        _hub("deepseek-ai/DeepSeek-V4-Flash-Base") + _TRANSFORMERS_DEFAULTS.format("DeepseekV4Config"),
        _DEEPSEEK_V4_FLASH,
        note="Sliding-window-only layers: the trailing 64 of each 512-wide [nope | rope] head rotate, "
        "interleaved pairs, theta 1e4. The layer also rotates values and undoes it on the output.",
        layer_type="main",
    ),
    Preset(
        "deepseek-v4-compress",
        "deepseek-ai/DeepSeek-V4-Flash-Base",
        _hub("deepseek-ai/DeepSeek-V4-Flash-Base") + _TRANSFORMERS_DEFAULTS.format("DeepseekV4Config"),
        _DEEPSEEK_V4_FLASH,
        note="Compressed (CSA / HCA) layers and their compressors: compress_rope_theta 160000 on the same "
        "trailing 64 features. transformers' defaults carry no YaRN block; a checkpoint's rope_scaling "
        "would apply here only.",
        layer_type="compress",
    ),
]

# Intern-S1-Pro (transformers 5.24 has no model type for it; vLLM serves it as interns1_pro): the text
# config of internlm/Intern-S1-Pro's published config.json, as copied in the public repository
# muyaostudio/intern-s1-pro-vs-qwen3-235b-a22b (checkpoints/Intern-S1-Pro/config.json). vLLM's
# vllm/model_executor/models/interns1_pro.py turns its rope_scaling into rope_parameters with use_fope True
# (any FoPE key not None) and num_key_value_heads 4, served by FourierRotaryEmbedding.
_INTERN_S1_PRO = {
    "model_type": "interns1_pro",
    "text_config": {
        "model_type": "interns1_pro_text",
        "head_dim": 128,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "num_hidden_layers": 94,
        "max_position_embeddings": 262144,
        "rope_scaling": {
            "rope_type": "default",
            "fope_init_factor": 0.5,
            "fope_sep_head": True,
            "num_inv_freq": None,
        },
        "rope_theta": 5000000,
    },
}
_ENTRIES.append(
    Preset(
        "intern-s1-pro-fope-basis",
        "internlm/Intern-S1-Pro",
        _hub("internlm/Intern-S1-Pro") + " (text_config; FoPE per vLLM's interns1_pro.py)",
        _INTERN_S1_PRO,
        note="FoPE, not a rotation: the RopeConfig is its Fourier basis (theta 5e6 over 128-wide heads; "
        "num_inv_freq null keeps the frequencies above 2 pi / 262144). Each of the 4 key-value heads mixes "
        "it with learned (F, F) cos / sin coefficients from the checkpoint: "
        "ropekit.compat.vllm_variants.FourierRotaryEmbedding. RopeConfig.from_hf refuses the config.",
        part="fope_basis",
    )
)

PRESETS: dict[str, Preset] = {p.name: p for p in _ENTRIES}


def get_preset(name: str) -> Preset:
    """Look up a preset by name (case-insensitive).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if not isinstance(name, str) or name.lower() not in PRESETS:
        raise ValueError(f"name: unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name.lower()]


def preset_kwargs(name: str) -> dict[str, Any]:
    """RopeConfig keyword arguments for a preset."""
    preset = get_preset(name)
    if preset.part == "indexer":
        return indexer_rope_kwargs(preset.config)
    if preset.part == "fope_basis":
        return fope_basis_kwargs(preset.config)
    return rope_kwargs(preset.config, layer_type=preset.layer_type or None)
