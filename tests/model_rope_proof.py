"""Prove :func:`ropekit.model_rope` against the layers transformers builds from the same config.

A tiny model is built from the model type's config (``ropekit.tools.hf_coverage.tiny_config``, fp32), with a
few sizes changed so that every per-layer difference shows within 12 tokens: Llama 4's chunks and
temperature floor, Ministral 3 / Mistral 4's temperature length, and Gemma 4's full-attention heads twice as
wide as its sliding ones. One forward pass on token ids then records, per decoder layer:

* each call of the layer's RoPE function (``ropekit.integrations.hf`` finds and records them), which is
  re-run on random q / k and compared with ropekit rotating by the layer's ``RopeConfig`` (its own tables,
  pairing, rotated slice); a layer whose function is never called is a NoPE layer;
* the attention mask and the query the attention function receives (a recording attention implementation
  registered with transformers), from which the sliding window, the chunk and the per-position query
  temperature are read.

:func:`prove` returns the list of disagreements (empty when every layer agrees) and what it could not
measure.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

import ropekit
from ropekit.integrations import hf, hf_probe
from ropekit.tools import hf_coverage

SEQ = hf.PROBE_TOKENS
CHUNK = 4  # Llama 4's attention_chunk_size in the tiny model
FLOOR = 2  # Llama 4's floor_scale, and Ministral 3 / Mistral 4's temperature length
# Module names of towers that are not the decoder (their RoPE is not model_rope's).
NOT_DECODER = re.compile(r"vision|visual|audio|talker|code2wav|mtp|speech|image")
ENCODER = re.compile(r"(?:^|\.)encoder\.")  # an encoder-decoder's encoder: model_rope plans the decoder
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)\.")
PROBE_IMPL = "ropekit_probe"
# Children of an attention module that change the query's norm between its projection and the attention
# (q_norm, q_b_norm, qk_norm, query_norm; q_a_layernorm sits before the projection and does not).
QUERY_NORM = re.compile(r"^(q|qk|query)_(?!a_).*norm|^(q|qk|query)_?norm|^q_ln")


def _normalises_query(module: torch.nn.Module) -> bool:
    return any(QUERY_NORM.search(name) for name, _ in module.named_children())


@dataclass
class Observed:
    """What one decoder layer did in the probe forward."""

    rotations: list = field(default_factory=list)  # (module name, function, Call)
    masks: list = field(default_factory=list)  # attention_mask tensors the attention function received
    windows: list = field(default_factory=list)  # the sliding_window keyword it received
    query_scale: torch.Tensor | None = None  # (B, S) |query at attention| / |query projection|


def _tweak(d: dict) -> dict:
    """The tiny config dict with per-layer differences made visible within SEQ tokens."""
    for key, value in d.items():
        if isinstance(value, dict) and key.endswith("_config") and not key.startswith(("vision", "audio")):
            _tweak(value)
    if isinstance(d.get("attention_chunk_size"), int) and "layer_types" in d:
        d["attention_chunk_size"] = CHUNK
    if d.get("attn_temperature_tuning"):
        d["floor_scale"] = FLOOR
    for params in hf_coverage._rope_dicts(d.get("rope_parameters")):
        if params.get("llama_4_scaling_beta") is not None:
            params["original_max_position_embeddings"] = FLOOR
    for params in hf_coverage._rope_dicts(d.get("rope_parameters")):
        sections = params.get("mrope_section")
        if (
            d.get("model_type", "").startswith("qwen3_vl")
            and isinstance(sections, list)
            and len(sections) == 3
        ):
            # Qwen3-VL interleaves t, h, w: h and w need 3 * section <= pairs (HF truncates silently)
            quarter = sum(sections) // 4
            params["mrope_section"] = [sum(sections) - 2 * quarter, quarter, quarter]
    if d.get("model_type") == "mimo_v2_flash":  # 0.334 of 48 is 16 features (of 16, an odd 5)
        d["head_dim"] = 48
    if d.get("model_type") == "moonshine":  # 16-wide heads: 0.9 of them is an even 14 (of 8, an odd 7)
        d["encoder_num_attention_heads"] = d["decoder_num_attention_heads"] = 4
        d["encoder_num_key_value_heads"] = d["decoder_num_key_value_heads"] = 4
    if d.get("model_type") == "moonshine_streaming" and d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d["num_attention_heads"]  # the class declares it, to_dict() writes None
    if d.get("model_type") == "dia":  # its decoder's cross-attention reads the (shrunk) encoder's states
        d["decoder_config"].update(
            cross_hidden_size=d["encoder_config"]["hidden_size"],
            cross_num_attention_heads=4,
            cross_num_key_value_heads=4,
            cross_head_dim=16,
        )
    if d.get("model_type") == "deepseek_v4":  # 64-wide heads whose trailing 8 rotate (its 512 and 64)
        d["head_dim"], d["qk_rope_head_dim"] = 64, 8
    if (
        str(d.get("model_type")).startswith("gemma4")
        and "per_layer_config" in d
        and isinstance(d.get("head_dim"), int)
        and d.get("layer_types")
    ):
        # Gemma 4: full-attention heads twice as wide as the sliding ones (its published 512 vs 256)
        d["per_layer_config"] = {
            str(i): {"head_dim": 2 * d["head_dim"]}
            for i, t in enumerate(d["layer_types"])
            if t == "full_attention"
        }
    return d


def tiny_config(model_type: str) -> Any:
    """The model type's tiny config (hf_coverage's) with the per-layer differences made visible."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type].from_dict(_tweak(hf_coverage.tiny_config(model_type).to_dict()))
    except Exception as err:  # the tiny sizes do not fit this config class
        raise NotBuilt(f"{model_type}: no tiny config ({type(err).__name__}: {_short(err)})") from None


def build(model_type: str, config: Any = None) -> torch.nn.Module:
    """The tiny model: the first candidate class that builds and runs on token ids.

    Candidates, in order: hf_coverage's list (a causal-LM or image-text-to-text head, a causal LM over the
    text config, the bare model), then the decoder classes of the model type's own modeling file that take
    input_ids and are built from the config or its ``text_config`` (Gemma 3n's text model, whose multimodal
    classes need timm; Voxtral Realtime's text model; CSM's backbone). The plan is always read from the model
    type's config, so a decoder built from its ``text_config`` proves what model_rope reads through it.
    """
    config = tiny_config(model_type) if config is None else config
    candidates = [(cls, cfg) for cls, cfg, _ in hf_coverage._model_classes(model_type, config)]
    candidates += [c for c in _decoder_classes(config) if c not in candidates]
    reasons = []
    for cls, cfg in candidates:
        why = hf_coverage._token_model(cls)
        if why and _audio_encoder_decoder(cls):
            why = None  # Moonshine: audio into the encoder, token ids into the decoder model_rope plans
        if why:
            reasons.append(why)
            continue
        try:
            torch.manual_seed(0)
            model = cls(cfg).eval()
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name and p.dim() == 1:
                        p.uniform_(0.5, 1.5)
        except Exception as err:  # the next candidate
            reasons.append(f"{cls.__name__}: {type(err).__name__}: {_short(err)}")
            continue
        for inputs in _inputs(model):
            try:
                with torch.no_grad():
                    model(**inputs)
            except Exception as err:  # other inputs, then the next candidate
                reasons.append(f"{cls.__name__}: {type(err).__name__}: {_short(err)}")
                continue
            model.__dict__[INPUTS_ATTR] = inputs
            return model
    if not candidates:
        reasons.append("transformers maps no model class to it and its modeling file has no decoder class")
    raise NotBuilt(f"{model_type}: no tiny model runs on token ids ({'; '.join(reasons)})")


INPUTS_ATTR = "_ropekit_proof_inputs"  # the inputs the built model ran on
AUDIO_SAMPLES = 4000  # raw audio samples per sequence for an audio encoder-decoder's encoder


def _audio_encoder_decoder(cls: Any) -> bool:
    parameters = inspect.signature(cls.forward).parameters
    return (
        "decoder_input_ids" in parameters and "input_values" in parameters and "input_ids" not in parameters
    )


def _inputs(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """Inputs to try for one forward: token ids (2, SEQ), then (2, SEQ, codebooks) for a model that sums one
    embedding per audio codebook (CSM's backbone, Kyutai's speech-to-text: their ``audio_tokens_offsets``)."""
    ids = hf._token_ids(model, torch.device("cpu"))  # (2, SEQ)
    choices = [ids]
    for module in model.modules():
        offsets = getattr(module, "audio_tokens_offsets", None)
        if isinstance(offsets, torch.Tensor) and offsets.dim() == 1:
            sizes = [getattr(model.config, k, None) for k in ("codebook_size", "codebook_vocab_size")]
            smallest = min([s for s in sizes if isinstance(s, int)] + [int(ids.max()) + 1])
            choices.append((ids % smallest)[..., None].expand(-1, -1, offsets.numel()))  # (2, SEQ, codebooks)
            break
    extra = {}
    if getattr(model.config, "is_encoder_decoder", False):
        extra["decoder_input_ids"] = ids
    decoder = getattr(model.config, "decoder_config", None)
    if "decoder_input_ids" in extra and isinstance(getattr(decoder, "num_channels", None), int):
        # Dia's decoder reads one audio code per channel: (B, S, channels) below its vocabulary
        codes = (ids % decoder.vocab_size)[..., None].expand(-1, -1, decoder.num_channels)
        extra["decoder_input_ids"] = codes.contiguous()
    if any(type(m).__name__.endswith("AdaRmsNorm") for m in model.modules()):
        # Voxtral Realtime's text layers scale their MLP input by a time conditioning (t_cond), which its
        # multimodal model computes from the audio delay; zeros leave the attention as it is.
        extra["t_cond"] = torch.zeros(2, 1, model.config.get_text_config().hidden_size)  # (B, 1, hidden)
    if "image_encoder_embeddings" in inspect.signature(model.forward).parameters:
        # IDEFICS needs one image for its gated cross-attention layers: one image of 4 encoder states
        width = model.config.vision_config.embed_dim
        image = torch.randn(2, 1, 4, width, generator=torch.Generator().manual_seed(0))  # (B, images, 4, W)
        extra["image_encoder_embeddings"] = image
        extra["image_attention_mask"] = torch.ones(2, SEQ, 1, dtype=torch.long)  # (B, S, images)
    if _audio_encoder_decoder(type(model)):
        audio = torch.randn(2, AUDIO_SAMPLES, generator=torch.Generator().manual_seed(0))  # (B, samples)
        return [{"input_values": audio, "decoder_input_ids": x} for x in choices]
    return [{"input_ids": x, **extra} for x in choices]


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 200 else text[:200] + "..."


def _decoder_classes(config: Any) -> list[tuple[Any, Any]]:
    """(class, config) for the model classes of config's modeling file that take input_ids and are built from
    config or its text_config, causal-LM heads first."""
    import importlib

    from transformers import PreTrainedModel

    module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    configs = [config] + [c for c in (getattr(config, "text_config", None),) if c is not None]
    found = []
    for cfg in configs:
        for cls in vars(module).values():
            if (
                isinstance(cls, type)
                and issubclass(cls, PreTrainedModel)
                and cls.__module__ == module.__name__
                and getattr(cls, "config_class", None) is type(cfg)
                and "input_ids" in inspect.signature(cls.forward).parameters
            ):
                found.append((cls, cfg))
    text = getattr(config, "text_config", None)
    if text is not None:  # the text config's own classes (PE Audio's ModernBERT text encoder)
        import transformers
        from transformers.models.auto import modeling_auto as auto

        for mapping in (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_MAPPING_NAMES):
            name = mapping.get(text.model_type)
            cls = getattr(transformers, name, None) if isinstance(name, str) else None
            if cls is not None and (cls, text) not in found:
                found.append((cls, text))
    return sorted(found, key=lambda c: not c[0].__name__.endswith("ForCausalLM"))


class NotBuilt(Exception):
    """The model type has no tiny model that runs on token ids (a vision or audio tower, or a config the
    tiny sizes do not fit; docs/integrations.md lists them)."""


def _encoder_decoder(model: torch.nn.Module) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def _layer_of(name: str, encoder_decoder: bool = False) -> int | None:
    """The decoder layer index in a module name, None for other towers (and an encoder-decoder's encoder)."""
    if NOT_DECODER.search(name) or (encoder_decoder and ENCODER.search(name)):
        return None
    found = LAYER_INDEX.search(name + ".")
    return None if found is None else int(found[1])


@contextlib.contextmanager
def _recording_attention(model: torch.nn.Module, observed: dict[int, Observed]):
    """While inside, the model's attention runs through a recorder in front of transformers' eager code."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    names = {id(m): n for n, m in model.named_modules()}

    def record(module, query, key, value, attention_mask, **kwargs):
        index = _layer_of(names.get(id(module), ""), _encoder_decoder(model))
        if index is not None:
            seen = observed.setdefault(index, Observed())
            seen.masks.append(attention_mask)
            seen.windows.append(kwargs.get("sliding_window"))
            projected = getattr(module, "_ropekit_projected", None)
            if projected is not None and not _normalises_query(module):
                q = query.transpose(1, 2).flatten(2)  # (B, S, H * D)
                if q.shape == projected.shape:
                    seen.query_scale = q.norm(dim=-1) / projected.norm(dim=-1)  # (B, S)
        # The model's own eager attention where it has one (softcapping, sinks), else transformers' SDPA.
        own = getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)
        try:
            return own(module, query, key, value, attention_mask, **kwargs)
        except RuntimeError:
            # Unlimited-OCR's module-level eager function is its vision tower's (no grouped-query repeat):
            # its text layers only run through SDPA.
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    hooks = []
    for module in model.modules():
        projection = getattr(module, "q_proj", None) or getattr(module, "q_b_proj", None)
        if isinstance(projection, torch.nn.Linear):

            def keep(proj, args, out, owner=module):
                owner._ropekit_projected = out.detach()

            hooks.append(projection.register_forward_hook(keep))
    AttentionInterface.register(PROBE_IMPL, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_IMPL, eager_mask)
    previous = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in previous:
            previous[id(config)] = (config, config._attn_implementation)
            config._attn_implementation = PROBE_IMPL
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for config, impl in previous.values():
            config._attn_implementation = impl
        for module in model.modules():
            module.__dict__.pop("_ropekit_projected", None)


def observe(model: torch.nn.Module) -> dict[int, Observed]:
    """Per decoder layer index, what its RoPE function and attention received in one forward pass."""
    observed: dict[int, Observed] = {}
    candidates = hf._candidate_layers(model)
    calls: dict = {}
    with _recording_attention(model, observed), torch.no_grad():
        for _, layer, functions in candidates:
            recorders = {
                n: hf._recorder(calls, (id(layer), n), hf.model_function(f)) for n, f in functions.items()
            }
            hf._replace_functions(layer, functions, recorders)
        try:
            model(**model.__dict__[INPUTS_ATTR])
        finally:
            for _, layer, _ in candidates:
                hf._restore_functions(layer)
    for name, layer, functions in candidates:
        index = _layer_of(name, _encoder_decoder(model))
        if index is None:
            continue
        for fn_name, fn in functions.items():
            call = calls.get((id(layer), fn_name))
            if call is not None:
                observed.setdefault(index, Observed()).rotations.append((name, hf.model_function(fn), call))
    return observed


def _layout(x: torch.Tensor, signature: hf_probe.Signature, call: hf_probe.Call) -> str | None:
    if signature.unsqueeze is not None:
        return {1: "bhsd", 2: "bshd"}.get(hf_probe.Signature.get(call.args, call.kwargs, signature.unsqueeze))
    if x.shape[2] == SEQ and x.shape[1] != SEQ:
        return "bhsd"
    return "bshd" if x.shape[1] == SEQ else None


def rotation_difference(rope: ropekit.RopeConfig, fn: Any, call: hf_probe.Call) -> tuple[float, str]:
    """Largest |model's function - ropekit with `rope`| / output scale on random q / k of the recorded shapes,
    and how ropekit's output was read ("direct", or "deinterleaved" for DeepSeek's [evens, odds] layout)."""
    signature = hf_probe.Signature.of(fn)
    args, kwargs = hf_probe._probe_inputs(signature, call, torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = fn(*args, **kwargs)
    theirs = [theirs] if isinstance(theirs, torch.Tensor) else [t for t in theirs if t is not None]
    xs = [hf_probe.Signature.get(args, kwargs, s) for s in signature.rotated]
    xs = [x for x in xs if isinstance(x, torch.Tensor)]
    if len(xs) != len(theirs):
        return float("inf"), f"{len(xs)} inputs, {len(theirs)} outputs"
    cos, sin = rope.cos_sin(torch.arange(SEQ), dtype=torch.float64)  # (S, R/2)
    scale = max(t.abs().max().item() for t in theirs)
    best, how = float("inf"), "no layout"
    for reading in ("direct", "deinterleaved"):
        worst = 0.0
        for x, want in zip(xs, theirs, strict=True):
            layout = _layout(x, signature, call)
            if layout is None or x.dim() != 4:
                return float("inf"), f"q of shape {tuple(x.shape)}"
            view = x.transpose(1, 2) if layout == "bhsd" else x  # (B, S, H, D)
            got = ropekit.apply_rotary(
                view.double(),
                cos,
                sin,
                interleaved=rope.interleaved,
                rotary_position=rope.rotary_position,
            )
            if reading == "deinterleaved":  # (x0, x1, x2, ...) rotated, written out as [evens, odds]
                if not rope.interleaved or rope.rotary_dim != rope.head_dim:
                    break
                got = got.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            got = got.transpose(1, 2) if layout == "bhsd" else got
            if got.shape != want.shape:
                worst = float("inf")
                break
            worst = max(worst, (got - want.double()).abs().max().item() / max(scale, 1e-12))
        else:
            if worst < best:
                best, how = worst, reading
    return best, how


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """(S, S) bool: which keys each query of the first sequence may see, from a 4-D mask."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (SEQ, SEQ):
        return None
    m = mask[0, 0]
    return m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2


def expected_allowed(layer: ropekit.layer_rope.LayerRope) -> torch.Tensor:
    """(S, S) bool: the lower triangle a query sees under the layer's window and chunk (k <= q)."""
    q = torch.arange(SEQ)[:, None]
    k = torch.arange(SEQ)[None, :]
    allowed = k <= q
    if layer.sliding_window is not None:
        allowed &= q - k < layer.sliding_window
    if layer.attention_chunk_size is not None:
        allowed &= q // layer.attention_chunk_size == k // layer.attention_chunk_size
    return allowed


TOLERANCE = 1e-5  # fp32 model tables (angles formed in fp32) against ropekit's float64, relative to |q|


def prove(model_type: str) -> tuple[list[str], list[str]]:
    """(disagreements, things not measured) between model_rope and the tiny model's layers."""
    config = tiny_config(model_type)
    layers = ropekit.model_rope(config)  # before building: a refused config need not run
    model = build(model_type, config)
    observed = observe(model)
    problems, unmeasured = [], []
    lower = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
    for layer in layers:
        seen = observed.get(layer.index, Observed())
        where = f"{model_type} layer {layer.index} ({layer.layer_type})"
        direct = [r for r in seen.rotations if _depth(r[0]) == min(_depth(n) for n, _, _ in seen.rotations)]
        if layer.rope is None and direct:
            problems.append(f"{where}: model_rope says no RoPE, the layer calls {direct[0][1].__name__}")
        if layer.rope is not None and not direct:
            problems.append(f"{where}: model_rope gives {layer.rope}, the layer applies no RoPE")
        for name, fn, call in direct:
            if layer.rope is None:
                continue
            diff, how = rotation_difference(layer.rope, fn, call)
            if not diff <= TOLERANCE:
                problems.append(
                    f"{where}: {name}.{fn.__name__} differs from {layer.rope} by {diff:.3g} ({how})"
                )
        for name, fn, _ in seen.rotations:
            if all(name != n for n, _, _ in direct):
                unmeasured.append(f"{where}: {name}.{fn.__name__} (a sub-module with its own positions)")
        if _encoder_decoder(model):  # T5Gemma 2's merged attention: [self keys | encoder keys]
            seen.masks = [
                m[..., :SEQ] if isinstance(m, torch.Tensor) and m.dim() == 4 else m for m in seen.masks
            ]
        masks = [_allowed(m) for m in seen.masks]
        if not seen.masks and layer.rope is not None:
            unmeasured.append(f"{where}: attention not reached through the attention interface")
        for got in masks:
            if got is not None and (got & ~lower).any():
                unmeasured.append(f"{where}: a bidirectional mask (windows read only from causal masks)")
                continue
            if got is None:
                window = seen.windows[0] if seen.windows else None
                if window != layer.sliding_window and layer.attention_chunk_size is None:
                    problems.append(
                        f"{where}: sliding_window {window} passed, model_rope says {layer.sliding_window}"
                    )
                continue
            want = expected_allowed(layer)
            if not torch.equal(got & lower, want):
                problems.append(
                    f"{where}: the mask lets a query see {got.sum().item()} keys, model_rope's window "
                    f"{layer.sliding_window} / chunk {layer.attention_chunk_size} would let it see "
                    f"{want.sum().item()}"
                )
        want_scale = layer.attention_temperature(torch.arange(SEQ))
        if seen.query_scale is not None:
            # Relative to position 0, where every temperature is 1: a constant factor on the query (YaRN's in
            # the tables, LongCat's q-LoRA scale) is the model's own and not a temperature.
            got_scale = seen.query_scale[0] / seen.query_scale[0, :1]
            if not torch.allclose(got_scale, want_scale, rtol=1e-5, atol=1e-5):
                problems.append(
                    f"{where}: query temperature {got_scale.tolist()}, model_rope {want_scale.tolist()}"
                )
        elif not torch.equal(want_scale, torch.ones(SEQ)):
            unmeasured.append(f"{where}: query temperature (a norm sits between projection and attention)")
    return problems, unmeasured


def _depth(name: str) -> int:
    return name.count(".")
