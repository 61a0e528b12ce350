"""torchtitan override: its RoPE modules rotated by ropekit, turned on with ``--override.imports``.

torchtitan (0.3) keeps RoPE in ``torchtitan/models/common/rope.py``: :class:`ComplexRoPE` (adjacent pairs,
GPT-J / Meta style, a complex cache ``(max_seq_len, dim / 2)``) and :class:`CosSinRoPE` (rotate-half,
GPT-NeoX / HF style, a ``[cos | cos | sin | sin]`` cache ``(max_seq_len, 2 * dim)``), each called as
``rope(query, key, positions)``. This module registers one torchtitan override, :func:`rope`, that swaps
them, config node by config node, for subclasses rotated by ropekit's kernels::

    torchtitan ... --override.imports ropekit.integrations.torchtitan.rope

What changes, and what does not:

* The cache is ropekit's: :class:`ropekit.RopeConfig` computes the frequencies for each scaling option
  (``"none"``; ``"llama"`` = ropekit's ``llama3``; ``"yarn"`` with ``truncate``, applied when
  ``rope_factor > 1`` as in torchtitan, without the attention factor, which torchtitan folds into its
  softmax scale), with float64 angles, and stores them in the stock cache format, so ``module.cache``,
  its sharding declaration and its re-initialisation (``init_states``) are untouched. ``CosSinRoPE`` with
  ``"llama"`` scaling, which torchtitan refuses, is served.
* ``forward(query, key, positions)`` rotates through :func:`ropekit.apply_rotary_qk`: q and k
  ``(batch, seq, heads, dim)`` with positions None (rows 0 .. seq-1), ``(1, seq)`` (shared by the batch) or
  ``(batch, seq)``; or, as torchtitan's main branch after 0.3 passes them, packed ``(tokens, heads, dim)``
  with positions None or ``(tokens,)``. Out of place, in float32, returning q's and k's dtypes; gradients by
  the conjugate rotation.
* Errors keep torchtitan's contract inside torchtitan: what ropekit refuses (a position past the cache, a
  shape) is a :class:`TorchtitanRopeError`, both the ``RuntimeError`` torchtitan's modules raise and the
  ``ValueError`` ropekit's own callers catch.
* The config's length is ``max_seq_len`` (0.3) or ``max_context_length`` (its main branch after 0.3).
* DTensors as in the stock modules: plain positions with a DTensor query are this rank's rows
  (torchtitan's convention: ``DTensor.from_local`` on q's mesh, sharded alongside q), DTensor positions are
  used as they are, and the tables are replicated, never sharded (:mod:`ropekit.integrations.dtensor`).
  One difference: with positions None and q sharded on tokens, ropekit rotates by the global positions of
  each shard's tokens, where the stock module would start every shard at 0; torchtitan's context
  parallelism always passes positions.

Only this module imports torchtitan, and only torchtitan's ``--override.imports`` imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate
from torchtitan.config import derive, override
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE

import ropekit.integrations.dtensor  # noqa: F401  (DTensor rules for ropekit's ops)
from ropekit.config import RopeConfig
from ropekit.dtensor_inputs import is_dtensor, positions_placements
from ropekit.functional import apply_rotary_qk

__all__ = [
    "RopekitComplexRoPE",
    "RopekitCosSinRoPE",
    "TorchtitanRopeError",
    "rope",
    "rope_config",
]


class TorchtitanRopeError(ValueError, RuntimeError):
    """What the override refuses, raised as torchtitan's modules raise (``RuntimeError``: their bounds
    check is ``torch._assert_async``) and as ropekit raises (``ValueError``, naming the argument)."""


def context_length(cfg: RoPE.Config) -> int:
    """The config's cache length: ``max_seq_len`` in torchtitan 0.3, ``max_context_length`` after it."""
    for name in ("max_seq_len", "max_context_length"):
        if hasattr(cfg, name):
            return getattr(cfg, name)
    raise ValueError(
        f"cfg: expected a torchtitan RoPE config with max_seq_len or max_context_length, got {cfg!r}"
    )


def rope_config(cfg: ComplexRoPE.Config | CosSinRoPE.Config, *, interleaved: bool) -> RopeConfig:
    """The :class:`ropekit.RopeConfig` of a torchtitan RoPE config (its ``dim`` is the head width).

    Raises:
        ValueError: a scaling option torchtitan does not define, or values ropekit refuses (named).
    """
    scaling: dict | None
    if cfg.scaling == "none" or (cfg.scaling == "yarn" and not cfg.rope_factor > 1.0):
        scaling = None  # torchtitan applies YaRN only for rope_factor > 1
    elif cfg.scaling == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": cfg.scaling_factor,
            "low_freq_factor": cfg.low_freq_factor,
            "high_freq_factor": cfg.high_freq_factor,
            "original_max_position_embeddings": cfg.original_max_position_embeddings,
        }
    elif cfg.scaling == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": cfg.rope_factor,
            "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow,
            "original_max_position_embeddings": cfg.original_seq_len,
            "truncate": cfg.truncate,
            "attention_factor": 1.0,  # a pure rotation: torchtitan folds mscale into the softmax scale
        }
    else:
        raise ValueError(f"scaling: expected 'none', 'llama' or 'yarn', got {cfg.scaling!r}")
    return RopeConfig(cfg.dim, cfg.theta, interleaved=interleaved, scaling=scaling)


def _tables(module) -> tuple[torch.Tensor, torch.Tensor]:
    """ropekit's float32 cos and sin, (max_seq_len, dim / 2), on the current default device."""
    return rope_config(module.config, interleaved=module.interleaved).cos_sin(context_length(module.config))


def _local_cache(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a plain tensor: a DTensor cache must be replicated (ropekit never shards a table)."""
    if not isinstance(cache, DTensor):
        return cache
    if any(type(p) is not Replicate for p in cache.placements):
        raise TorchtitanRopeError(
            f"cache: expected a replicated RoPE cache (every rank may read any row), got placements "
            f"{tuple(cache.placements)}"
        )
    return cache.to_local()


def _rotate(module, query, key, cos, sin, positions):
    """The module's rotation with torchtitan's error contract (:class:`TorchtitanRopeError`)."""
    try:
        if query.dim() == 3:
            return _rotate_packed(module, query, key, cos, sin, positions)
        return _rotate_batched(module, query, key, cos, sin, positions)
    except TorchtitanRopeError:
        raise
    except ValueError as error:
        raise TorchtitanRopeError(str(error)) from error


def _rotate_packed(module, query, key, cos, sin, positions):
    """Packed (tokens, heads, dim) q and k, positions None or (tokens,): one sequence of a batch of one."""
    if key.dim() != 3:
        raise ValueError(
            f"key: expected (tokens, heads, dim) like query {tuple(query.shape)}, got {tuple(key.shape)}"
        )
    if positions is not None:
        if positions.dim() != 1 or positions.shape[0] != query.shape[0]:
            raise ValueError(
                f"positions: expected ({query.shape[0]},) (one per token of the packed query "
                f"{tuple(query.shape)}), got {tuple(positions.shape)}"
            )
        positions = positions.unsqueeze(0)
    q, k = _rotate_batched(module, query.unsqueeze(0), key.unsqueeze(0), cos, sin, positions)
    return q.squeeze(0), k.squeeze(0)


def _rotate_batched(module, query, key, cos, sin, positions):
    """apply_rotary_qk with torchtitan's positions: None, (1, seq) or (batch, seq), this rank's rows when
    plain and query is a DTensor."""
    if positions is not None and is_dtensor(query) and not is_dtensor(positions):
        # torchtitan's convention (its _maybe_wrap_positions): plain positions hold this rank's rows.
        positions = _per_token(positions, query.to_local().shape[0])
        alongside = positions_placements(query.placements, query.dim())
        if alongside is not None:  # else apply_rotary_qk refuses q's placements by name
            positions = DTensor.from_local(positions, query.device_mesh, alongside, run_check=False)
    elif positions is not None:
        positions = _per_token(positions, query.shape[0])
    return apply_rotary_qk(query, key, cos, sin, positions=positions, interleaved=module.interleaved)


def _per_token(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """(1, seq) positions shared by the batch as a (batch, seq) view; anything else as it is (checked by
    apply_rotary_qk)."""
    if positions.dim() == 2 and positions.shape[0] == 1 and batch != 1:
        return positions.expand(batch, positions.shape[1])  # (batch, seq)
    return positions


class RopekitComplexRoPE(ComplexRoPE):
    """torchtitan's :class:`ComplexRoPE` (adjacent pairs: GPT-J / Meta), rotated by ropekit.

    The cache keeps the stock format (complex64, ``(max_seq_len, dim / 2)``), holding ropekit's angles.
    """

    interleaved = True  # adjacent pairs (2i, 2i + 1): the complex multiplication of Meta's code

    @dataclass(kw_only=True, slots=True)
    class Config(ComplexRoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        cos, sin = _tables(self)
        return torch.complex(cos, sin)  # (max_seq_len, dim / 2) complex64: cos + i sin

    def forward(self, query, key, positions=None):
        pairs = torch.view_as_real(_local_cache(self.cache))  # (max_seq_len, dim / 2, 2)
        return _rotate(self, query, key, pairs[..., 0], pairs[..., 1], positions)


class RopekitCosSinRoPE(CosSinRoPE):
    """torchtitan's :class:`CosSinRoPE` (rotate-half: GPT-NeoX / HF), rotated by ropekit.

    The cache keeps the stock format (``(max_seq_len, 2 * dim)``: cos and sin, each written for both halves),
    holding ropekit's angles; "llama" scaling, which the stock module refuses, is served.
    """

    interleaved = False  # halves (i, i + dim / 2)

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        cos, sin = _tables(self)
        return torch.cat([cos, cos, sin, sin], dim=-1)  # (max_seq_len, 2 * dim)

    def forward(self, query, key, positions=None):
        cache = _local_cache(self.cache)
        half = cache.shape[-1] // 4
        # Row views of unit stride: the kernels read them in place.
        return _rotate(self, query, key, cache[:, :half], cache[:, 2 * half : 3 * half], positions)


@override(target=RoPE.Config, description="ropekit: ComplexRoPE and CosSinRoPE rotated by ropekit")
def rope(cfg: RoPE.Config) -> RoPE.Config:
    """The override factory (``--override.imports ropekit.integrations.torchtitan.rope``): a config of
    exactly ``ComplexRoPE`` or ``CosSinRoPE`` becomes ropekit's; a subclass with another cache contract
    (Qwen3.5's M-RoPE, say) is returned as it is, and stays torchtitan's."""
    if type(cfg) is ComplexRoPE.Config:
        rope_config(cfg, interleaved=True)  # refuse a config ropekit cannot serve when the tree is built
        return derive(cfg, RopekitComplexRoPE.Config)
    if type(cfg) is CosSinRoPE.Config:
        rope_config(cfg, interleaved=False)
        return derive(cfg, RopekitCosSinRoPE.Config)
    return cfg
