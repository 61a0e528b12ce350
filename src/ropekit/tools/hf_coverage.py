"""Measure :func:`ropekit.integrations.hf.patch` on every RoPE model type of the installed transformers.

A tool: it regenerates the coverage table of docs/integrations.md.

For each model type whose modeling code defines a RoPE rotation function, a tiny random model is built from
its config class (:func:`tiny_config`: few layers, small widths and vocabulary, M-RoPE sections and layer-type
lists fitted to the new sizes), run on the same token ids before and after patching (fp32), and, for models
that generate, asked for a few greedy tokens with the KV cache. While the patched model runs, the model's own
rotation functions raise if called, so "equal" means ropekit did the rotating.

Regenerate the table in docs/integrations.md (minutes; nothing is downloaded)::

    python -m ropekit.tools.hf_coverage --write docs/integrations.md

Statuses: ``no RoPE applied`` (the modeling file defines a rotation function that no layer calls, as
Jamba's does), ``patched`` (outputs within 1e-4 of the output scale, generation identical), ``refused`` (the
proof at patch time found a layer ropekit does not reproduce; the reason is the ValueError's), ``not a token
model`` (its forward takes no input_ids: the RoPE lives in a vision or audio stack, which ``patch`` does not
probe), ``not instantiable`` (the tiny model could not be built or run unpatched; the error is given), and
``unequal`` (patched, but the outputs differ: the target is that this never happens).

``--numerics hf --dtype bfloat16`` (or float32) checks ``patch(model, numerics="hf")`` instead: the model is
cast to that dtype and "patched" then means bit-identical outputs (tolerance 0) and greedy generation.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ropekit.integrations import hf

__all__ = ["Row", "check_model_type", "render", "rope_model_types", "tiny_config"]

# A representative subset, one per variant the issue lists; `make test` checks these.
REPRESENTATIVE = (
    "llama", "cohere", "glm", "gptj", "gpt_neox", "phi", "deepseek_v2", "deepseek_v3", "minicpm3",
    "qwen2_vl", "qwen3_vl", "llama4_text", "gemma3_text", "gpt_oss", "modernbert", "esm",
    "deepseek_v4", "gemma4_text", "olmo3",  # trailing rope slices; per-layer-type tables, patched per layer
)  # fmt: skip
TOLERANCE = 1e-4  # max |patched - unpatched| / max |unpatched|, fp32
SEQ = 12
ROTATION_DEF = re.compile(r"^def (_?apply_\w*(?:rotary|rope)\w*)\(", re.M)
# Rotation functions for image patches or audio frames; a model type with only these keeps RoPE out of its
# token stack and is not enumerated.
VISION_ONLY = re.compile(r"vision|2d|time|multidimensional")
# Integer config fields and the size a tiny model gets, when the default is larger.
SIZES = {
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2, "depth": 1,
    "encoder_layers": 2, "decoder_layers": 2, "num_decoder_layers": 2,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64, "out_hidden_size": 64,
    "intermediate_size": 128, "ffn_dim": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "n_inner": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "topk_group": 1, "n_group": 1, "first_k_dense_replace": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "num_expert_group": 1, "num_experts_per_token": 2, "index_head_dim": 16, "index_n_heads": 4,
    "attention_hidden_size": 128, "attention_head_dim": 32, "mamba_headdim": 16,
    "audio_hidden_size": 64, "text_hidden_size": 64, "condition_dim": 64, "codebook_dim": 64,
    "adapter_in_dim": 64, "adapter_out_dim": 64, "adapter_input_size": 64,
    "vocab_size": 512, "sliding_window": 8, "rotary_dim": 8, "num_kv_shared_layers": 0,
}  # fmt: skip
VOCAB = SIZES["vocab_size"]
# Qwen4-Exp's attention layers build their sparse indexer only from all five of these (None by default).
QWEN4_EXP_INDEXER = {
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
    "indexer_compress_ratio": 4,
}  # fmt: skip
# Defaults that leave a config without RoPE or unusable as a model: the value the config class needs. A fix
# goes into the text config when there is one (the outer config when only it has the key); a sub-config
# (`*_config`) is updated key by key.
FIXES: dict[str, dict[str, Any]] = {
    "esm": {"position_embedding_type": "rotary"},  # ESM-2 is rotary; the class default is ESM-1b's absolute
    "esmc": {"num_key_value_heads": 4},  # no grouped-query attention
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # an attention layer among the two
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "step3p7": {"sliding_window": 8},
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "diffusion_gemma": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "dots3_note": {"head_dim": 24},  # its sliding-window layers: qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 24},
    "qwen4_exp": QWEN4_EXP_INDEXER,
    "qwen4_exp_text": QWEN4_EXP_INDEXER,
    "dory": {  # a layer before, in and after the recurrent section
        "num_hidden_layers": 3,
        "n_input_layers": 1,
        "n_recurrent_layers": 1,
        "n_output_layers": 1,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    },
    "cohere_compass": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    },
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares (the rotary
    # module takes rope_parameters), and clamps q/k/v to clip_qkv even when it is None (the default); the
    # released DBRX config sets both.
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # HRM's config stores the inflated num_hidden_layers = num_layers_per_stack * H_cycles * (L_cycles + 1)
    # (one cache slot per attention call of the recurrence) next to the real per-stack count.
    "hrm_text": {
        "num_layers_per_stack": 1,
        "H_cycles": 2,
        "L_cycles": 3,
        "num_hidden_layers": 1 * 2 * (3 + 1),
    },
    # Chameleon's model maps image tokens through the checkpoint's vocabulary map, None by default; a map
    # with only the image placeholder (no image codes) serves text.
    "chameleon": {"vocabulary_map": {"<image>": 8}},
    # T5Gemma2's encoder MLP reads dropout_rate, which T5Gemma2TextConfig does not declare (the
    # encoder-decoder config passes it down).
    "t5gemma2_encoder": {"dropout_rate": 0.0},
    # Apertus 1.5 places image codes, then audio codes, at fixed offsets of the token vocabulary: codebooks
    # and offsets that fit the tiny vocabulary, image codes right before audio codes.
    "apertus1p5": {
        "vision_config": {"codebook_size": 64},
        "audio_config": {"codebook_size": 64},
        "image_token_offset": VOCAB - 160,
        "audio_token_offset": VOCAB - 96,
    },
    # Granite 4 Vision injects (window-downsampled) vision features at listed decoder layers; neither the list
    # nor the window ratio has a default: values that fit the tiny model.
    "granite4_vision": {
        "deepstack_layer_map": [[-1, 0]],
        "spatial_target_layers": [0, 1, 0, 1],
        "downsample_rate": "1/2",
    },
    # DeepSeek-V4's heads are [nope | rope]: 64 of 512 rotate (partial_rotary_factor 0.125); the shrunk MLA
    # head (qk_rope_head_dim, 8) would leave one rotated feature. 8 of 64 keep the published ratio.
    "deepseek_v4": {"head_dim": 64},
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2]}},  # layers of the 2-layer vision tower
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # Hybrids whose defaults have no attention layer (or no RoPE): one RoPE attention layer of the two.
    "bamba": {"attn_layer_indices": [1]},
    # to_dict() keeps the full model's hybrid layer ids, which from_dict() sets over the ones __post_init__
    # derives from layers_block_type (["linear_attention", "hybrid"] once shrunk).
    # RoPE in the shared attention block is off by default (use_mem_rope): turned on, it is what is measured.
    "zamba2": {"hybrid_layer_ids": [1], "use_mem_rope": True},
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention"],
        "position_embedding_type": "rope",
    },
}
DEFAULT_MROPE_SECTION = [16, 24, 24]  # Qwen2-VL's, the fallback HF's M-RoPE modules use
# A modeling file's own fallback sections: rope_parameters.get("mrope_section", [22, 22, 20]).
MROPE_DEFAULT = re.compile(r"""["']mrope_section["'],\s*(\[[\d,\s]+\])""")


@dataclass
class Row:
    """One model type's result."""

    model_type: str
    status: str  # "patched", "refused", "not a token model", "not instantiable", "unequal"
    detail: str
    layers: int = 0
    model_rope_tables: bool = False  # every patched layer reads ropekit's tables from model_rope
    door: str = ""  # patched: "kernels", "module globals" or both (hf.patch_doors), else ""


def rope_model_types() -> dict[str, list[str]]:
    """{model type: rotation functions its modeling code defines} for types with a base model class.

    Model types whose only rotation functions are for vision or audio positions (2-D patches, time) are left
    out: their token stack, if any, has no RoPE.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    found = {}
    for model_type in CONFIG_MAPPING_NAMES:
        folder = root / model_type_to_module_name(model_type)
        if model_type not in MODEL_MAPPING_NAMES or not folder.is_dir():
            continue
        names = set()
        for path in folder.glob("modeling_*.py"):
            names |= set(ROTATION_DEF.findall(path.read_text()))
        if any(not VISION_ONLY.search(n) for n in names):
            found[model_type] = sorted(names)
    return found


def _fit_sections(sections: list[int], half: int) -> list[int]:
    """M-RoPE sections scaled to sum to `half` (the rotary half-width of the tiny model)."""
    total = sum(sections)
    fitted = [max(1, round(s * half / total)) for s in sections]
    fitted[-1] += half - sum(fitted)
    return fitted


def _fit_layer_list(values: list, old_layers: int, new_layers: int) -> list:
    """A per-layer list cut to new_layers while keeping every kind it had (sliding and full, ...)."""
    kinds = list({repr(v): v for v in values}.values())  # entries may be lists (Moonshine Streaming's)
    if len(kinds) >= new_layers:
        return kinds[:new_layers]
    return [kinds[i % len(kinds)] for i in range(new_layers)] if len(kinds) > 1 else values[:new_layers]


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    old_layers = next(
        (d[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(d.get(k), int)), 0
    )
    out = {}
    for key, value in d.items():
        if isinstance(value, dict) and (key.endswith("_config") or "model_type" in value):
            out[key] = _shrink(value)
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool) and value > SIZES[key]:
            out[key] = SIZES[key]
        elif (
            key in ("num_experts_per_tok", "n_group", "topk_group", "n_routed_experts", "n_shared_experts")
            and value is None
        ):
            out[key] = SIZES[key]  # DeepSeek-V2's defaults leave its router without a top-k
        else:
            out[key] = value
    new_layers = next(
        (out[k] for k in ("num_hidden_layers", "num_layers", "n_layer") if k in out), old_layers
    )
    for key, value in out.items():
        if isinstance(value, list) and old_layers and len(value) == old_layers and new_layers < old_layers:
            out[key] = _fit_layer_list(value, old_layers, new_layers)
    if "hidden_size" in out and "head_dim" in d and isinstance(d["head_dim"], int):
        out["head_dim"] = min(d["head_dim"], SIZES["head_dim"])
    if isinstance(
        out.get("qk_rope_head_dim"), int
    ):  # MLA: head_dim names the rope head or the whole q/k head
        whole = d.get("head_dim") is not None and d.get("head_dim") == d.get("qk_head_dim")
        if whole:  # Mistral 4: rope is half of a q/k head (partial_rotary_factor 0.5)
            out["qk_nope_head_dim"] = out["qk_rope_head_dim"]
        if "qk_head_dim" in out:
            out["qk_head_dim"] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)
        out["head_dim"] = out["qk_head_dim"] if whole else out["qk_rope_head_dim"]
    heads = out.get("num_attention_heads")
    if "head_dim" in out and out["head_dim"] is None and isinstance(out.get("hidden_size"), int) and heads:
        out["head_dim"] = out["hidden_size"] // heads
    if "num_key_value_heads" in out and out["num_key_value_heads"] is None and heads:
        out["num_key_value_heads"] = heads
    if isinstance(out.get("mamba_d_head"), int) and isinstance(out.get("mamba_n_heads"), int):
        # Mamba-2 mixers need n_heads * d_head = expand * hidden_size
        out["mamba_d_head"] = min(out["mamba_d_head"], 16)
        out["mamba_n_heads"] = out.get("mamba_expand", 2) * out.get("hidden_size", 64) // out["mamba_d_head"]
        if isinstance(out.get("mamba_n_groups"), int):
            out["mamba_n_groups"] = 1
        if isinstance(out.get("mamba_d_ssm"), int):
            out["mamba_d_ssm"] = out["mamba_n_heads"] * out["mamba_d_head"]
    per_layer = out.get("per_layer_config")
    if isinstance(per_layer, dict) and per_layer and new_layers:
        # Layers configured apart (Gemma 4's full-attention layers): keep one of them, as the last layer. A
        # wider head keeps its ratio to the shrunk head_dim (Gemma 4's 512 of 256: 32 of 16), else the tiny
        # model would lose the layers' different widths.
        first = sorted(per_layer)[0]
        kept = _shrink(per_layer[first]) if isinstance(per_layer[first], dict) else per_layer[first]
        wide, narrow = (per_layer[first] or {}).get("head_dim"), d.get("head_dim")
        if isinstance(kept, dict) and isinstance(wide, int) and isinstance(narrow, int) and wide != narrow:
            kept["head_dim"] = out["head_dim"] * wide // narrow
        out["per_layer_config"] = {str(new_layers - 1).zfill(len(str(first))): kept}
    if isinstance(out.get("kv_lora_rank"), int) and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out.get("num_attention_heads")  # MLA: one latent k/v per head
    if "vocab_size" in out and out["vocab_size"] is None:
        out["vocab_size"] = VOCAB
    if "pad_token_id" in out and out["pad_token_id"] is None and "vocab_size" in out:
        out["pad_token_id"] = 0  # ESM's mask is input_ids != pad_token_id
    head_dim = out.get("head_dim") or out.get("hidden_size", 64) // max(1, out.get("num_attention_heads", 4))
    for params in _rope_dicts(out.get("rope_parameters")):
        sections = params.get("mrope_section")
        if isinstance(sections, list) and sections:
            rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
            params["mrope_section"] = _fit_sections(sections, rotary // 2)
    for key, value in list(out.items()):  # token ids past the tiny vocabulary land at its end
        if "token" in key and isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[key] = VOCAB - 1 - sum(1 for k in out if "token" in k and k < key)
    return out


def _rope_dicts(params: Any) -> Iterator[dict]:
    if isinstance(params, dict):
        if any(isinstance(v, dict) for v in params.values()):
            for v in params.values():
                if isinstance(v, dict):
                    yield v
        else:
            yield params


def tiny_config(model_type: str) -> Any:
    """The model type's default config, shrunk to a model that builds and runs in about a second."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    shrunk = _shrink(config_class().to_dict())
    text = shrunk.get("text_config")
    for key, value in FIXES.get(model_type, {}).items():  # the text config's, unless only the outer has it
        outer = isinstance(text, dict) and key not in text and key in shrunk
        _merge(shrunk if outer or not isinstance(text, dict) else text, {key: value})
    source = _modeling_source(model_type)
    if "mrope_section" in source:
        default = MROPE_DEFAULT.search(source)
        _add_mrope_sections(shrunk, json.loads(default[1]) if default else DEFAULT_MROPE_SECTION)
    return config_class.from_dict(shrunk)


def _merge(d: dict, fixes: dict) -> None:
    """d updated with fixes, sub-config dicts (``attn_config``) updated key by key rather than replaced."""
    for key, value in fixes.items():
        if key.endswith("_config") and isinstance(value, dict) and isinstance(d.get(key), dict):
            _merge(d[key], value)
        else:
            d[key] = value


def _modeling_source(model_type: str) -> str:
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = Path(transformers.__file__).parent / "models" / model_type_to_module_name(model_type)
    return "".join(p.read_text() for p in folder.glob("modeling_*.py"))


def _add_mrope_sections(d: dict, default: list[int]) -> None:
    """Give M-RoPE models that rely on the modeling default sections ones that fit the tiny head.

    `default` is the modeling code's fallback; its proportions are kept (ERNIE 4.5 VL's [22, 22, 20] stacks
    the first two sections, which must stay equal).
    """
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config") and not key.startswith(("vision", "audio")):
            _add_mrope_sections(value, default)
    head_dim = d.get("head_dim") or d.get("hidden_size", 64) // max(1, d.get("num_attention_heads", 4))
    for params in _rope_dicts(d.get("rope_parameters")):
        if "mrope_section" not in params and "hidden_size" in d and "rope_type" in params:
            rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
            params["mrope_section"] = _fit_sections(default, rotary // 2)


def _model_classes(model_type: str, config: Any) -> list[tuple[Any, Any, bool]]:
    """(class, config, whether it generates) to try in turn: a causal-LM or image-text-to-text head, a causal
    LM over the text config of a multimodal config, then the bare model."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    def lookup(mapping):
        name = mapping.get(model_type)
        name = name[0] if isinstance(name, (list, tuple)) else name
        return getattr(transformers, name) if name and hasattr(transformers, name) else None

    causal, multimodal = (
        lookup(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        lookup(auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES),
    )
    text = getattr(config, "text_config", None)
    tries = [(multimodal, config, True)]
    tries += [(causal, text, True)] if text is not None else [(causal, config, True)]
    tries.append((lookup(auto.MODEL_MAPPING_NAMES), config, False))
    return [t for t in tries if t[0] is not None]


def _seeded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) from a fixed RNG state: diffusion models draw noise inside forward."""
    torch.manual_seed(1)
    return fn(*args, **kwargs)


def _tokens(out: Any) -> torch.Tensor | None:
    """generate()'s token ids (some models return an output object holding them)."""
    out = getattr(out, "sequences", out)
    return out if isinstance(out, torch.Tensor) else None


def _main_output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    values = out.to_tuple() if hasattr(out, "to_tuple") else out if isinstance(out, tuple) else (out,)
    return next(v for v in values if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def _model_functions_raise(model: torch.nn.Module) -> Iterator[None]:
    """While inside, the model's own rotation functions behind every stand-in raise when called."""

    def called(*args, **kwargs):
        raise AssertionError("the model's own rotation function ran on a patched layer")

    swapped = []
    for module in model.modules():
        for stand_in in module.__dict__.get(hf.STAND_INS_ATTR, {}).values():
            fn = stand_in.__wrapped_model_function__
            if fn.__code__.co_freevars or any(fn is f for f, _ in swapped):
                continue
            swapped.append((fn, fn.__code__))
            fn.__code__ = called.__code__
    try:
        yield
    finally:
        for fn, code in swapped:
            fn.__code__ = code


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:240]}"


def _token_model(cls: Any) -> str | None:
    """Why cls cannot run on token ids alone, or None when it can."""
    parameters = inspect.signature(cls.forward).parameters
    if "input_ids" not in parameters:
        return f"{cls.__name__}.forward takes no input_ids"
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    required = [
        n
        for n, p in parameters.items()
        if p.default is p.empty and n not in ("self", "input_ids") and p.kind in kinds
    ]
    return f"{cls.__name__}.forward requires {required}" if required else None


def _inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    ids = hf._token_ids(model, torch.device("cpu"))
    inputs = {"input_ids": ids}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def _build(model_type: str) -> tuple[torch.nn.Module, bool]:
    """The first of :func:`_model_classes` that builds and runs unpatched, with random norm scales.

    Raises:
        NotATokenModel: when no class takes token ids alone.
        Exception: the last error when none builds and runs.
    """
    from transformers import CONFIG_MAPPING

    classes = _model_classes(model_type, CONFIG_MAPPING[model_type]())
    if not classes:
        raise ValueError(f"no model class for {model_type!r}")
    reasons = [_token_model(cls) for cls, _, _ in classes]
    if all(reasons):
        raise NotATokenModel(reasons[-1])
    tries = _model_classes(model_type, tiny_config(model_type))
    error: Exception | None = None
    for (cls, cfg, generates), reason in zip(tries, reasons, strict=True):
        if reason:
            continue
        try:
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():  # zero-initialised norms (Gemma) would hide whole layers
                for name, p in model.named_parameters():
                    if "norm" in name and p.dim() == 1:
                        p.uniform_(0.5, 1.5)
                model(**_inputs(model))
            return model, generates and hasattr(model, "generate")
        except Exception as err:
            error = err
    raise error


class NotATokenModel(Exception):
    """The model type's classes all need inputs other than token ids (pixels, audio)."""


def check_model_type(
    model_type: str, time_limit: int = 300, *, numerics: str = "exact", dtype: torch.dtype = torch.float32
) -> Row:
    """Build, run, patch, run again and compare one model type (see the module docstring); with numerics
    "hf", the model in ``dtype`` patched with ``numerics="hf"`` must give bit-identical outputs."""
    try:
        with _time_limit(time_limit):
            return _check(model_type, numerics, dtype)
    except TimeoutError as err:
        return Row(model_type, "not instantiable", _short(err))
    except Exception as err:  # after patching: the patched model failed where the unpatched one ran
        return Row(model_type, "unequal", f"the patched model raised {_short(err)}")


def _check(model_type: str, numerics: str = "exact", dtype: torch.dtype = torch.float32) -> Row:
    try:
        model, generates = _build(model_type)
        model = model.to(dtype)
    except NotATokenModel as err:
        return Row(model_type, "not a token model", str(err))
    except Exception as err:
        return Row(model_type, "not instantiable", f"building or running the tiny model: {_short(err)}")
    inputs = _inputs(model)
    ids = inputs["input_ids"]
    gen_kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=int(ids[0, 0]))
    try:
        with torch.no_grad():
            want = _main_output(_seeded(model, **inputs))
    except Exception as err:
        return Row(model_type, "not instantiable", f"running the tiny model unpatched: {_short(err)}")
    want_tokens = None
    if generates:
        try:
            with torch.no_grad():
                want_tokens = _tokens(_seeded(model.generate, ids[:, : SEQ // 2], **gen_kw))
        except Exception:
            want_tokens = None
    try:
        layers = hf.patch(model, numerics=numerics)
    except ValueError as err:
        reason = " ".join(str(err).split())[:300]
        if "nothing to patch" in reason:  # the modeling file defines a rotation its layers never call
            return Row(model_type, "no RoPE applied", reason)
        return Row(model_type, "refused", reason)
    conventions = sorted(
        {
            re.sub(r", through [a-z ]+,", ",", p.replace(", backend auto", ""))
            for fns in hf.patched_layers(model).values()
            for p in fns.values()
        }
    )
    door = " + ".join(sorted(hf.DOORS[d] for d in hf.patch_doors(model)))
    kept = ""
    try:
        with _model_functions_raise(model):
            got, got_tokens = _patched_outputs(model, inputs, want_tokens is not None, gen_kw)
    except AssertionError as err:
        if "the model's own rotation function ran" not in str(err):
            raise
        # A call form the probe never recorded (another rank or table shape in the same layer, as
        # Qwen4-exp's indexer rotates its pooled keys) goes to the model's own function: said, not hidden.
        kept = "; some calls keep the model's own function (a call form the probe did not record)"
        got, got_tokens = _patched_outputs(model, inputs, want_tokens is not None, gen_kw)
    scale = want.abs().max().item()
    diff = (got - want).abs().max().item() / max(scale, 1e-12)
    equal_tokens = want_tokens is None or torch.equal(got_tokens, want_tokens)
    generation = "generation not checked" if want_tokens is None else "greedy generation identical"
    detail = (
        f"{layers} layers; {'; '.join(conventions)}; max diff {diff:.1e} of output scale; {generation}{kept}"
    )
    tolerance = TOLERANCE if numerics == "exact" else 0.0  # "hf": the model's own bits
    if not math.isfinite(diff) or diff > tolerance or not equal_tokens:
        if not equal_tokens:
            detail += " (generation differs)"
        return Row(model_type, "unequal", detail, layers)
    ropes = hf.layer_ropes(model)
    on_model_rope = bool(ropes) and set(ropes) == set(hf.patched_layers(model))
    return Row(model_type, "patched", detail, layers, on_model_rope, door)


def _patched_outputs(model, inputs: dict, generates: bool, gen_kw: dict) -> tuple:
    """The patched model's main output and, for models that generate, its greedy tokens."""
    ids = inputs["input_ids"]
    with torch.no_grad():
        got = _main_output(_seeded(model, **inputs))
        tokens = _tokens(_seeded(model.generate, ids[:, : SEQ // 2], **gen_kw)) if generates else None
    return got, tokens


def render(rows: list[Row], seconds: float) -> str:
    """The markdown section for docs/integrations.md."""
    import transformers

    counts = {
        s: sum(r.status == s for r in rows) for s in ("patched", "refused", "unequal", "not instantiable")
    }
    tokens = [r for r in rows if r.status not in ("not a token model", "no RoPE applied")]
    unused = sum(r.status == "no RoPE applied" for r in rows)
    doors: dict[str, int] = {}
    for row in rows:
        if row.status == "patched":
            doors[row.door] = doors.get(row.door, 0) + 1
    both = "kernels + module globals"
    mixed = f", and {doors[both]} through both (some layers each way)" if doors.get(both) else ""
    lines = [
        "<!-- generated by `python -m ropekit.tools.hf_coverage --write docs/integrations.md`; "
        "do not edit by hand -->",
        "",
        f"Measured on transformers {transformers.__version__}, torch {torch.__version__}, fp32, in "
        f"{seconds / 60:.0f} min: **{counts['patched']} patched / {len(tokens)} enumerated** model types "
        "whose "
        f"token stack uses RoPE ({100 * counts['patched'] / max(1, len(tokens)):.0f}%), "
        f"{sum(r.model_rope_tables for r in rows if r.status == 'patched')} of them with every patched layer "
        "on ropekit's tables from `model_rope` (the others keep the model's own tables, where `model_rope` "
        "refuses the config or a table is not proved equal; the rotation is ropekit's in every case); "
        f"{counts['unequal']} patched with a difference above tolerance; {counts['refused']} refused by the "
        f"proof; {counts['not instantiable']} not instantiable as a tiny model. A further "
        f"{len(rows) - len(tokens)} model types keep RoPE only in a vision or audio stack (their forward "
        "takes "
        "no token ids), which `patch` does not probe, and "
        f"{unused} define a rotation function that no layer calls (no RoPE applied).",
        "",
        f"Of the patched types, {doors.get('kernels', 0)} are patched through the `kernels` door (each "
        "attention layer's own kernels function module, as `kernels.kernelize` installs a kernel) and "
        f"{doors.get('module globals', 0)} through a copy of the layer's forward with its globals rebound "
        "(the generic patch, for the functions transformers keeps plain: those that differ from Llama's, "
        f"such as partial rotary inside the function, interleaved, complex or conjugate forms){mixed}.",
        "",
        "| model type | status | door | detail |",
        "| --- | --- | --- | --- |",
    ]
    for row in sorted(rows, key=lambda r: r.model_type):
        detail = row.detail.replace("|", "\\|")
        lines.append(f"| `{row.model_type}` | {row.status} | {row.door} | {detail} |")
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- coverage begin -->", "<!-- coverage end -->"


def write(path: Path, table: str) -> None:
    """Replace the text between the coverage markers in `path` (append the markers if missing)."""
    text = path.read_text()
    if BEGIN not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ropekit.tools.hf_coverage", description=__doc__)
    parser.add_argument("--write", type=Path, help="markdown file whose coverage section is replaced")
    parser.add_argument("--only", nargs="*", help="model types to check (default: all enumerated)")
    parser.add_argument(
        "--numerics", choices=("exact", "hf"), default="exact", help="patch(numerics=...); hf: bit-identical"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    types = args.only or list(rope_model_types())
    start = time.perf_counter()
    rows = []
    for model_type in types:
        row = check_model_type(model_type, numerics=args.numerics, dtype=getattr(torch, args.dtype))
        rows.append(row)
        print(f"{row.model_type}: {row.status}: {row.detail}", file=sys.stderr, flush=True)
    table = render(rows, time.perf_counter() - start)
    if args.write:
        write(args.write, table)
    else:
        print(table)
    return 1 if any(r.status == "unequal" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
