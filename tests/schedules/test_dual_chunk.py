"""Dual chunk attention RoPE (Qwen2.5-1M) against the published definition in vLLM's
``vllm/model_executor/layers/rotary_embedding/dual_chunk_rope.py``: keys at p mod chunk_len; queries at
r, min(r + chunk_len, chunk_size), min(2 chunk_len - 1, chunk_size), r + chunk_len and r + chunk_size."""

from __future__ import annotations

import pytest
import torch

from ropekit import RopeConfig
from ropekit.schedules import dual_chunk_positions

CHUNK, LOCAL = 16, 5  # chunk_len 11


def _config(**overrides):
    scaling = {"rope_type": "dual_chunk", "chunk_size": CHUNK, "local_size": LOCAL, **overrides}
    return RopeConfig(32, 1e6, scaling=scaling)


def test_positions_follow_the_published_definition_token_by_token():
    positions = torch.arange(0, 100)
    got = dual_chunk_positions(positions, CHUNK, LOCAL)
    chunk_len = CHUNK - LOCAL
    for p in range(100):
        r = p % chunk_len
        assert got.key[p] == got.intra[p] == r
        assert got.succ[p] == min(r + chunk_len, CHUNK)
        assert got.inter[p] == min(2 * chunk_len - 1, CHUNK)
        assert got.succ_critical[p] == r + chunk_len
        assert got.inter_critical[p] == r + CHUNK


def test_tables_are_the_plain_tables_at_each_roles_positions():
    config = _config()
    positions = torch.randint(0, 10_000, (2, 7))
    tables = config.dual_chunk_cos_sin(positions, dtype=torch.float64)
    plain = RopeConfig(32, 1e6)
    for role, pos in zip(tables._fields, dual_chunk_positions(positions, CHUNK, LOCAL), strict=True):
        cos, sin = getattr(tables, role)
        want_cos, want_sin = plain.cos_sin(pos, dtype=torch.float64)
        assert cos.shape == (2, 7, 16)
        torch.testing.assert_close(cos, want_cos, rtol=0, atol=0)
        torch.testing.assert_close(sin, want_sin, rtol=0, atol=0)


def test_intra_chunk_scores_depend_only_on_the_distance_and_keys_never_exceed_the_chunk():
    config = _config()
    q, k = torch.randn(32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)

    def rotate(x, cos, sin):  # half pairing, (i, i + d/2)
        x1, x2 = x[..., :16], x[..., 16:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def score(qp, kp):
        t = config.dual_chunk_cos_sin(torch.tensor([qp, kp]), dtype=torch.float64)
        return rotate(q, t.intra[0][0], t.intra[1][0]) @ rotate(k, t.key[0][1], t.key[1][1])

    chunk_len = CHUNK - LOCAL
    # the same distance inside two different chunks gives the same score
    torch.testing.assert_close(score(3, 1), score(3 + 5 * chunk_len, 1 + 5 * chunk_len))
    assert int(dual_chunk_positions(torch.arange(10**6), CHUNK, LOCAL).key.max()) == chunk_len - 1


def test_qwen25_1m_preset_and_from_hf_read_dual_chunk_attention_config():
    config = RopeConfig.preset("qwen2.5-7b-1m")
    assert config.rope_type == "dual_chunk"
    assert (config.scaling["chunk_size"], config.scaling["local_size"]) == (262144, 8192)
    assert config.base == 1e7 and config.head_dim == 128
    tables = config.dual_chunk_cos_sin(torch.tensor([0, 253952, 1_000_000]))
    torch.testing.assert_close(tables.key[0][0], tables.key[0][1])  # 253952 = chunk_len: back to 0


def test_dual_chunk_cos_sin_on_another_rope_type_is_a_value_error():
    with pytest.raises(ValueError, match="rope_type: dual_chunk_cos_sin needs rope_type 'dual_chunk'"):
        RopeConfig(32).dual_chunk_cos_sin(torch.arange(4))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"local_size": CHUNK}, r"scaling\['local_size'\]: expected less than chunk_size"),
        ({"chunk_size": 0}, r"scaling\['chunk_size'\]: expected a positive integer"),
        ({"local_size": -1}, r"scaling\['local_size'\]: expected an integer >= 0"),
        ({"original_max_position_embeddings": 1.5}, r"scaling\['original_max_position_embeddings'\]"),
    ],
)
def test_bad_sizes_are_value_errors_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        _config(**overrides)


@pytest.mark.parametrize(
    ("positions", "match"),
    [(torch.tensor([1.5]), "positions: expected an integer tensor"), (torch.tensor([-1]), "positions >= 0")],
)
def test_bad_positions_are_value_errors(positions, match):
    with pytest.raises(ValueError, match=match):
        _config().dual_chunk_cos_sin(positions)
