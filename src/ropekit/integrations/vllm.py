"""ropekit inside vLLM: a general plugin that serves vLLM's rotary classes with ropekit's kernels.

Turned on by installing ropekit (the entry point ``vllm.general_plugins: ropekit =
ropekit.integrations.vllm:register`` is in its metadata) and, where a deployment filters plugins,
``VLLM_PLUGINS=ropekit``. vLLM calls :func:`register` in every process it starts, so it is idempotent.

How it plugs in: vLLM's supported door for an out-of-tree kernel,
``CustomOp.register_oot(_decorated_op_cls=..., name=...)``. ``CustomOp.__new__`` looks the class name up in
that registry, so ``get_rope(...)`` and every model that builds ``RotaryEmbedding(...)`` directly then build
ropekit's class instead. Each replacement *subclasses* vLLM's class: construction and the shape of the
``[cos | sin]`` cache (``cos_sin_cache``, (P, R), row p = [cos(p theta) | sin(p theta)]) stay vLLM's; its
numbers become ropekit's table for the same RoPE (:func:`exact_cache`: float64 angles, the rows a model
patched by :func:`ropekit.integrations.hf.patch` reads, so both rotate to the same bits), where ropekit proves
it is vLLM's table up to vLLM's float32 rounding; and the forward paths change:

* ``forward_cuda`` / ``forward_cpu`` (an enabled op: vLLM's default without Inductor, or
  ``--compilation_config.custom_ops '["+rotary_embedding"]'``) rotate query and key in place through
  ``torch.ops.ropekit.rotary_embedding`` (vLLM's op signature) and return them, as vLLM's
  ``ops.rotary_embedding`` path does;
* ``forward_native`` (a disabled op, traced by Inductor) returns new tensors and leaves its inputs alone, as
  vLLM's does. Both take vLLM's ``offsets`` form (added to the positions) where its class has it.

Both are :mod:`ropekit.compat.vllm`'s functions on the module's own cache: one piece of code serves
ropekit's vLLM-compatible API and vLLM itself. The math runs in float32 whatever the cache dtype (vLLM's
native path computes in the query's dtype), so in bfloat16 ropekit is as close or closer to the exact
rotation; in float32 the two agree bit for bit (docs/engines.md).

Which classes: :data:`ADAPTERS` maps a vLLM class name to the ropekit forwards that serve it exactly (a new
class is one line there); :data:`LEFT` names the rotary classes left to vLLM, with the reason, and
:func:`register` logs both once. A class missing from the installed vLLM is skipped and logged.

Fused QK-norm + RoPE: vLLM fuses them only inside an Inductor pass (``QKNormRoPEFusionPass``) that rewrites
the graph to ``torch.ops._C.fused_qk_norm_rope``, an op of vLLM's compiled extension; it is not a
``CustomOp`` and no plugin door reaches it (serving it would mean registering a kernel in vLLM's private
``_C`` namespace), so it stays vLLM's. ``ropekit.compat.vllm.fused_qk_norm_rope`` offers the same call
outside vLLM.

Numerics: ``ROPEKIT_NUMERICS`` (read by :func:`register`, in each process vLLM starts) picks the arithmetic
of every forward: "exact" (the default, above), or "vllm": the bits of vLLM's own ``forward_native``
(``x1 * cos - x2 * sin`` in the query's dtype, the cache cast to it), on every path, in place or not
("hf" is the same arithmetic). Llama 4's vision rotation computes in float32 in vLLM too: it stays "exact".
Under "vllm" / "hf" the cache keeps vLLM's own numbers (:func:`exact_cache` is not applied).

Nothing here imports vLLM until :func:`register` runs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from ropekit.compat.vllm import apply_rope_with_cos_sin_cache, rotary_embedding
from ropekit.compat.vllm_variants import _check_rows, check_patch_tokens
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary, apply_rotary_qk
from ropekit.schedules.mrope import mrope_axis_of_pair
from ropekit.validation import NUMERICS, describe

__all__ = [
    "ADAPTERS",
    "LEFT",
    "NUMERICS_ENV",
    "SCALINGS",
    "exact_cache",
    "mrope_rotate",
    "plugin_numerics",
    "register",
    "registered",
    "rope_config",
]

logger = logging.getLogger(__name__)

NUMERICS_ENV = "ROPEKIT_NUMERICS"  # the engine plugins' arithmetic (vLLM's and SGLang's register read it)
# The plugins' arithmetic in this process: set by register() from NUMERICS_ENV, read by every forward.
MODE = {"numerics": "exact"}


def plugin_numerics() -> str:
    """The engine plugins' arithmetic from ``$ROPEKIT_NUMERICS`` ("exact" when unset), stored for the
    forwards: "exact", or "vllm" / "hf" (one arithmetic: vLLM's and SGLang's ``forward_native`` bits).

    Raises:
        ValueError: naming ROPEKIT_NUMERICS, for any other value.
    """
    value = os.environ.get(NUMERICS_ENV, "exact")
    if value not in NUMERICS:
        raise ValueError(f"{NUMERICS_ENV}: expected one of {list(NUMERICS)}, got {value!r}")
    MODE["numerics"] = value
    return value


def _cache(module, query: torch.Tensor) -> torch.Tensor:
    """The module's [cos | sin] cache on the query's device (vLLM moves it with the model; a fallback)."""
    cache = module.cos_sin_cache
    return cache if cache.device == query.device else cache.to(query.device)


def _with_offsets(positions: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """vLLM's ``offsets`` form (DeepSeek, M-RoPE): per-token offsets added to the positions."""
    return positions if offsets is None else positions + offsets


def _yarn(module) -> dict:
    """vLLM's YaRN classes: the ramp over ``max_position_embeddings`` (their original length), mscale in
    the rows."""
    return {
        "rope_type": "yarn",
        "factor": module.scaling_factor,
        "original_max_position_embeddings": module.max_position_embeddings,
        "beta_fast": module.beta_fast,
        "beta_slow": module.beta_slow,
        "truncate": getattr(module, "truncate", True),  # DeepSeek's class has none: vLLM's ramp truncates
        "attention_factor": module.mscale,
    }


def _one_linear_factor(module) -> dict:
    factors = module.scaling_factors
    if len(factors) != 1:  # vLLM stacks one cache per LoRA factor: not one RoPE
        raise ValueError(f"scaling_factors: expected one linear factor, got {factors!r}")
    return {"rope_type": "linear", "factor": factors[0]}


# vLLM class name -> its RoPE in ropekit's scaling vocabulary, read from the module's constructor attributes
# (None: unscaled). DynamicNTK's length is its trained one (RopeConfig's max_position_embeddings below).
# Not here, so vLLM's cache stays: NTKScalingRotaryEmbedding (vLLM's fixed NTK also divides every frequency
# by factor^(2/d): not ropekit's "ntk", and no HF model uses it).
SCALINGS: dict[str, Callable[[Any], dict | None]] = {
    "RotaryEmbedding": lambda m: None,
    "LinearScalingRotaryEmbedding": _one_linear_factor,
    "DynamicNTKScalingRotaryEmbedding": lambda m: {"rope_type": "dynamic", "factor": m.scaling_factor},
    "DynamicNTKAlphaRotaryEmbedding": lambda m: {"rope_type": "ntk_alpha", "alpha": m.scaling_alpha},
    "YaRNScalingRotaryEmbedding": _yarn,
    "DeepseekScalingRotaryEmbedding": _yarn,
    "Llama3RotaryEmbedding": lambda m: {
        "rope_type": "llama3",
        "factor": m.scaling_factor,
        "low_freq_factor": m.low_freq_factor,
        "high_freq_factor": m.high_freq_factor,
        "original_max_position_embeddings": m.orig_max_position,
    },
    # vLLM widens rotary_dim to head_size and zero-pads the frequencies past rope_angles.
    "Gemma4RotaryEmbedding": lambda m: {
        "rope_type": "proportional",
        "partial_rotary_factor": 2 * m.rope_angles / m.head_size,
    },
    # The cache is 1-D (each axis picks its rows at lookup): plain, or YaRN when scaled.
    "MRotaryEmbedding": lambda m: None if m.scaling_factor is None else _yarn(m),
}


def rope_config(module) -> RopeConfig:
    """The :class:`ropekit.RopeConfig` whose table a vLLM rotary module's ``cos_sin_cache`` holds.

    Raises:
        ValueError: a class or a setting ropekit does not read (named).
    """
    name = _vllm_name(module)
    if name not in SCALINGS:
        raise ValueError(f"module: vLLM's {name} has no RopeConfig in ropekit's plugin")
    length = getattr(module, "max_trained_positions", module.max_position_embeddings)
    return RopeConfig(
        module.head_size,
        float(module.base),
        rotary_dim=module.rotary_dim,
        interleaved=not module.is_neox_style,
        scaling=SCALINGS[name](module),
        max_position_embeddings=length,
    )


def _vllm_name(module) -> str:
    """The name of the vLLM class a module is (or a ropekit class stands in for)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("vllm.")).__name__


def exact_cache(module) -> torch.Tensor | None:
    """ropekit's [cos | sin] table for the module's RoPE, shaped and typed like its ``cos_sin_cache``: angles
    in float64, rounded to float32, then to the cache's dtype (the rows a patched HF model reads, so the two
    rotate q and k to the same bits); None, with the reason logged, where ropekit cannot prove it is the
    module's own table up to vLLM's float32 rounding of the angles (p * theta formed in float32: about
    p * 2^-24 radians at row p), and vLLM's cache stays.
    """
    cache = getattr(module, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or not cache.dtype.is_floating_point:
        return None
    try:
        config = rope_config(module)
        rows = cache.shape[0]
        seq_len = rows if config.length_dependent else None
        cos, sin = config.cos_sin(rows, seq_len=seq_len, device=cache.device)  # float32, (P, R/2) each
    except ValueError as err:
        logger.info("ropekit: %s keeps vLLM's cos_sin_cache: %s", type(module).__name__, err)
        return None
    ours = torch.cat([cos, sin], dim=-1).to(cache.dtype)  # (P, R) = [cos | sin]
    if ours.shape != cache.shape:
        logger.info(
            "ropekit: %s keeps vLLM's cos_sin_cache: ropekit's table is %s, vLLM's %s",
            type(module).__name__, tuple(ours.shape), tuple(cache.shape),
        )  # fmt: skip
        return None
    scale = float(cache.abs().max()) if cache.numel() else 1.0
    row = torch.arange(rows, device=cache.device, dtype=torch.float64)[:, None]  # (P, 1)
    bound = 4 * scale * (torch.finfo(cache.dtype).eps + torch.finfo(torch.float32).eps * (1 + row))
    excess = (ours.double() - cache.double()).abs() - bound  # (P, R)
    if cache.numel() and float(excess.max()) > 0:
        logger.info(
            "ropekit: %s keeps vLLM's cos_sin_cache: ropekit's table differs past float32 rounding "
            "(by %.3g over the bound)", type(module).__name__, float(excess.max()),
        )  # fmt: skip
        return None
    return ours


class CacheForwards:
    """vLLM's ``RotaryEmbedding`` forward: row ``positions[t]`` of the [cos | sin] cache rotates token t.

    Serves every class whose forward is that lookup and which differs from ``RotaryEmbedding`` only in how it
    fills its cache (scaled frequencies, a YaRN mscale baked into the rows, ...). The constructor is vLLM's;
    the cache it built then holds :func:`exact_cache`'s rows where ropekit proves them.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # numerics "vllm" / "hf" ask for vLLM's own bits: its cache, cast to the model dtype, stays
        cache = exact_cache(self) if MODE["numerics"] == "exact" else None
        if cache is not None:
            self.cos_sin_cache = cache  # the registered buffer, replaced: vLLM moves it with the model

    def forward_native(self, positions, query, key=None, offsets=None):
        positions = _with_offsets(positions, offsets)
        cache = _cache(self, query)
        return apply_rope_with_cos_sin_cache(
            positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
        )

    def forward_cuda(self, positions, query, key=None, offsets=None):
        positions = _with_offsets(positions, offsets)
        cache = _cache(self, query)
        rotary_embedding(
            positions, query, key, self.head_size, cache, self.is_neox_style, numerics=MODE["numerics"]
        )
        return query, key

    forward_cpu = forward_cuda


def mrope_rotate(module, positions, query, key, offsets=None, *, inplace):
    """M-RoPE with positions (axes, T) on a [cos | sin] cache, for vLLM's and SGLang's ``MRotaryEmbedding``
    (``mrope_section``, ``mrope_interleaved``, ``head_size``, ``is_neox_style``, ``cos_sin_cache``): each
    frequency pair takes the cache row of its own axis (Qwen2-VL's chunked sections, Qwen3-VL's interleaved
    layout), then ropekit rotates with those per-token rows. Returns (query, key) rotated, new unless inplace.
    """
    positions = _with_offsets(positions, offsets)
    cache = _cache(module, query)
    tokens = query.shape[0] if query.dim() > 0 else -1
    if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != tokens:
        raise ValueError(
            f"positions: expected (3, {tokens}) M-RoPE positions (temporal, height, width of each of query's "
            f"{tokens} tokens), got shape {tuple(positions.shape)}"
        )
    if key is not None and (key.dim() == 0 or key.shape[0] != tokens):
        raise ValueError(
            f"key: expected query's {tokens} tokens on its first axis, got shape {tuple(key.shape)}"
        )
    if positions.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_rows("positions", positions, cache.shape[0])  # a ValueError, not the gather's IndexError
    half = cache.shape[1] // 2
    axis = mrope_axis_of_pair(module.mrope_section, bool(module.mrope_interleaved)).to(cache.device)
    rows = cache[positions]  # (axes, T, R)
    index = axis.expand(1, rows.shape[1], half)  # (1, T, R/2)
    cos, sin = rows[..., :half].gather(0, index)[0], rows[..., half:].gather(0, index)[0]  # (T, R/2) each
    q = query.view(1, tokens, -1, module.head_size)  # (1, T, Hq, D)
    flags = dict(
        interleaved=not module.is_neox_style, inplace=inplace, per_token=True, numerics=MODE["numerics"]
    )
    if key is None:
        return apply_rotary(q, cos, sin, **flags).view(query.shape), None
    k = key.view(1, tokens, -1, module.head_size)  # (1, T, Hk, D)
    q, k = apply_rotary_qk(q, k, cos, sin, **flags)
    return q.view(query.shape), k.view(key.shape)


class MRopeForwards(CacheForwards):
    """vLLM's ``MRotaryEmbedding``: positions (T,) as :class:`CacheForwards`, positions (axes, T) through
    :func:`mrope_rotate`.
    """

    def forward_native(self, positions, query, key=None, offsets=None):
        if positions.dim() == 1:
            return CacheForwards.forward_native(self, positions, query, key, offsets)
        return mrope_rotate(self, positions, query, key, offsets, inplace=False)

    def forward_cuda(self, positions, query, key=None, offsets=None):
        if positions.dim() == 1:
            return CacheForwards.forward_cuda(self, positions, query, key, offsets)
        mrope_rotate(self, positions, query, key, offsets, inplace=True)
        return query, key

    forward_cpu = forward_cuda


class Llama4VisionForwards:
    """vLLM's ``Llama4VisionRotaryEmbedding``: query and key (B, S, H, D), token s of every image rotated by
    row s of a complex cache (S, 1, D/2) (2-D patch frequencies, the class token's row the identity), pairs
    (2i, 2i+1). ropekit reads the cache's real and imaginary parts as its cos and sin tables.
    """

    def _tables(self, query):
        cache = self.cos_sin_cache
        if not torch.is_complex(cache):
            raise ValueError(
                f"cos_sin_cache: expected vLLM's complex (S, 1, D/2) cache, got {describe(cache)}"
            )
        cache = cache.to(query.device)[:, 0]  # (S, D/2)
        return cache.real.contiguous(), cache.imag.contiguous()

    def forward_native(self, query, key=None):
        cos, sin = self._tables(query)
        # vLLM's forward views the cache against each input: one row per patch and the class token
        for name, t in (("query", query), ("key", key)):
            if t is not None:
                check_patch_tokens(name, t, cos.shape[0], 2 * cos.shape[1])
        if key is None:
            return apply_rotary(query, cos, sin, interleaved=True), None
        return apply_rotary_qk(query, key, cos, sin, interleaved=True)

    forward_cuda = forward_native
    forward_cpu = forward_native


# vLLM class name -> the ropekit forwards that serve it exactly. The replacement class is built from the two
# at register() time (vLLM is not imported before), forwards first.
ADAPTERS: dict[str, type] = {
    "RotaryEmbedding": CacheForwards,
    "LinearScalingRotaryEmbedding": CacheForwards,
    "NTKScalingRotaryEmbedding": CacheForwards,
    "DynamicNTKScalingRotaryEmbedding": CacheForwards,
    "DynamicNTKAlphaRotaryEmbedding": CacheForwards,
    "YaRNScalingRotaryEmbedding": CacheForwards,
    "DeepseekScalingRotaryEmbedding": CacheForwards,
    "Llama3RotaryEmbedding": CacheForwards,
    "Gemma4RotaryEmbedding": CacheForwards,
    "MRotaryEmbedding": MRopeForwards,
    "Llama4VisionRotaryEmbedding": Llama4VisionForwards,
}

# vLLM's rotary classes that stay vLLM's, and why.
LEFT: dict[str, str] = {
    "Phi3LongRoPEScaledRotaryEmbedding": (
        "a plain nn.Module in vLLM 0.33, not a CustomOp: CustomOp.register_oot cannot reach it"
    ),
    "DualChunkRotaryEmbedding": (
        "dual-chunk attention's forward returns several differently-rotated query parts, not one rotation; "
        "its constructor also needs a CUDA device"
    ),
    "DeepseekV4ScalingRotaryEmbedding": (
        "DeepSeek-V4's forward rotates the last rotary_dim features, with an inverse flag, on a float32 cache"
    ),
    "FourierRotaryEmbedding": "FoPE mixes frequencies per head in its own forward_native, not a cache lookup",
    "MRotaryEmbeddingInterleaved": (
        "openPangu's layout reorders the cache columns in its own forward() (bypassing CustomOp dispatch)"
    ),
    "BailingMRotaryEmbedding": "Bailing's M-RoPE layout has its own forward",
    "Ernie4_5_VLRotaryEmbedding": "ERNIE 4.5-VL's M-RoPE layout has its own forward",
    "fused_qk_norm_rope": (
        "an Inductor pattern pass rewrites to torch.ops._C.fused_qk_norm_rope, vLLM's compiled op: "
        "no plugin door"
    ),
}

_REGISTERED: dict[str, type] = {}


def registered() -> dict[str, type]:
    """vLLM class name -> the ropekit class this process registered in its place (empty before register())."""
    return dict(_REGISTERED)


def register() -> None:
    """Register ropekit's class for every vLLM rotary class in :data:`ADAPTERS` (vLLM's general-plugin hook).

    Idempotent: a class already registered by this module is left as it is; a name another plugin registered
    first is left to that plugin (logged). The replacement keeps vLLM's op name (``rotary_embedding``), so
    ``--compilation_config.custom_ops '["+rotary_embedding"]'`` switches it as it switches vLLM's class.
    Each call reads ``$ROPEKIT_NUMERICS`` again (:func:`plugin_numerics`).

    Raises:
        ValueError: for a ROPEKIT_NUMERICS other than "exact", "hf" and "vllm".
    """
    from vllm.model_executor import custom_op
    from vllm.model_executor.layers import rotary_embedding as vllm_rope

    plugin_numerics()
    replaced, absent = [], []
    for name, forwards in ADAPTERS.items():
        if name in _REGISTERED:
            continue
        base = getattr(vllm_rope, name, None)
        if base is None:
            absent.append(name)
            continue
        other = custom_op.op_registry_oot.get(name)
        if other is not None:
            logger.warning("ropekit: vLLM's %s is already replaced by %s; left as it is", name, other)
            continue
        op_name = base.name  # the in-tree op's switch name ("rotary_embedding")
        cls = type(f"Ropekit{name}", (forwards, base), {"__module__": __name__, "__doc__": forwards.__doc__})
        custom_op.CustomOp.register_oot(_decorated_op_cls=cls, name=name)
        cls.name = op_name  # register_oot names it after the key; keep vLLM's custom_ops switch working
        _REGISTERED[name] = cls
        replaced.append(name)
    if replaced:
        logger.info("ropekit: serving vLLM's %s (numerics %r)", ", ".join(replaced), MODE["numerics"])
        logger.info("ropekit: left to vLLM: %s", "; ".join(f"{name} ({why})" for name, why in LEFT.items()))
    if absent:
        logger.info("ropekit: not in this vLLM, skipped: %s", ", ".join(absent))
