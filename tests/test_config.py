"""RopeConfig core: defaults, inv_freq, attention_scaling, cos_sin shapes and float64 angles.

Scaling schedules and HF configs are tested under tests/schedules and tests/test_hf_config.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ropekit import RopeConfig
from ropekit import reference as ref


def test_defaults():
    config = RopeConfig(64)
    assert (config.head_dim, config.base, config.rotary_dim) == (64, 10000.0, 64)
    assert (config.interleaved, config.scaling, config.max_position_embeddings) == (False, None, None)
    assert config.rope_type == "default" and not config.length_dependent
    assert config.attention_scaling() == 1.0


def test_config_is_frozen_and_compares_by_value():
    config = RopeConfig(64, rotary_dim=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.base = 1e6
    assert config == RopeConfig(64, 10000.0, rotary_dim=32)
    assert config != RopeConfig(64, 10000.0, rotary_dim=32, interleaved=True)


@given(st.integers(1, 64).map(lambda h: 2 * h), st.floats(1.5, 1e7))
def test_inv_freq_is_float64_base_to_the_minus_2i_over_rotary_dim(rotary_dim, base):
    inv_freq = RopeConfig(rotary_dim + 2, base, rotary_dim=rotary_dim).inv_freq()
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == (rotary_dim // 2,)
    np.testing.assert_allclose(inv_freq.numpy(), ref.inv_freq(rotary_dim, base), rtol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_cos_sin_of_int_n_is_the_table_for_arange_n(dtype):
    config = RopeConfig(16, rotary_dim=12)
    cos, sin = config.cos_sin(5, dtype=dtype)
    assert cos.shape == sin.shape == (5, 6) and cos.dtype == sin.dtype == dtype
    angle = torch.arange(5, dtype=torch.float64)[:, None] * config.inv_freq()[None, :]  # (5, 6)
    # Angles and cos/sin in float64, then one cast: exactly the float64 values rounded to dtype.
    assert torch.equal(cos, torch.cos(angle).to(dtype))
    assert torch.equal(sin, torch.sin(angle).to(dtype))


def test_cos_sin_keeps_the_shape_of_a_positions_tensor():
    positions = torch.tensor([[0, 3, 7], [2, 2, 9]])
    cos, sin = RopeConfig(8).cos_sin(positions)
    assert cos.shape == sin.shape == (2, 3, 4)
    full_cos, full_sin = RopeConfig(8).cos_sin(10)
    assert torch.equal(cos, full_cos[positions]) and torch.equal(sin, full_sin[positions])


def test_large_positions_are_accurate_because_angles_are_float64():
    """Near m = 1e6, float32 angles are off by up to 1/32 rad; the cast-after-float64 table by < 1e-7."""
    config = RopeConfig(64)
    m = 1_000_003
    cos, _ = config.cos_sin(torch.tensor([m]))
    exact = np.cos(m * ref.inv_freq(64))
    np.testing.assert_allclose(cos[0].double().numpy(), exact, atol=1e-7)
    naive = torch.cos(torch.tensor([float(m)]) * config.inv_freq().float())
    assert np.max(np.abs(naive.double().numpy() - exact)) > 1e-3  # what float32 angles would give


def test_cos_sin_lands_on_the_requested_device_and_has_unit_norm():
    cos, sin = RopeConfig(8).cos_sin(300, dtype=torch.float64, device="cpu")
    assert cos.device.type == "cpu"
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos), rtol=0, atol=1e-15)


LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 2.0, 2.5],
    "long_factor": [3.0, 3.5, 4.0, 4.5],
    "original_max_position_embeddings": 16,
}


def test_config_with_a_scaling_dict_is_hashable_and_equal_configs_hash_equal():
    a = RopeConfig(8, scaling={"rope_type": "linear", "factor": 4.0})
    b = RopeConfig(8, scaling={"factor": 4, "rope_type": "linear"})  # key order and int/float do not matter
    c = RopeConfig(8, scaling={"rope_type": "linear", "factor": 2.0})
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    nested = RopeConfig(8, scaling=LONGROPE, max_position_embeddings=64)
    assert hash(nested) == hash(RopeConfig(8, scaling=dict(LONGROPE), max_position_embeddings=64))


def test_scaling_is_read_only():
    config = RopeConfig(8, scaling={"rope_type": "linear", "factor": 4.0})
    with pytest.raises(TypeError):
        config.scaling["factor"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        config.scaling.update({"factor": 1.0})  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.scaling = None  # type: ignore[misc]
    assert config.scaling == {"rope_type": "linear", "factor": 4.0}


def test_mutating_the_source_dict_changes_nothing():
    source = {k: list(v) if isinstance(v, list) else v for k, v in LONGROPE.items()}
    config = RopeConfig(8, scaling=source, max_position_embeddings=64)
    short, long = config.inv_freq(seq_len=8).clone(), config.inv_freq(seq_len=64).clone()
    source["short_factor"][0] = 100.0
    source["long_factor"].append(9.0)
    source["rope_type"] = "linear"
    assert config.rope_type == "longrope"
    assert config.scaling["short_factor"] == (1.0, 1.5, 2.0, 2.5)  # lists are stored as tuples
    assert config == RopeConfig(8, scaling=LONGROPE, max_position_embeddings=64)
    torch.testing.assert_close(config.inv_freq(seq_len=8), short, rtol=0, atol=0)
    torch.testing.assert_close(config.inv_freq(seq_len=64), long, rtol=0, atol=0)


def test_config_survives_pickle_deepcopy_and_json_through_to_dict():
    import copy
    import json
    import pickle

    config = RopeConfig(8, scaling=LONGROPE, max_position_embeddings=64)
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    plain = config.scaling.to_dict()
    assert plain == LONGROPE and isinstance(plain["short_factor"], list)
    plain["short_factor"][0] = 7.0  # a mutable copy: the config is untouched
    assert config.scaling["short_factor"][0] == 1.0
    assert json.loads(json.dumps(plain)) == plain


@given(
    factor=st.floats(1.0, 64.0),
    original=st.integers(16, 1 << 20),
    extra=st.fixed_dictionaries({}, optional={"beta_fast": st.floats(32.0, 64.0), "mscale": st.floats(0, 2)}),
    as_list=st.booleans(),
)
def test_configs_built_from_equal_dicts_are_equal_and_hash_equal(factor, original, extra, as_list):
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original, **extra}
    a = RopeConfig(8, scaling=scaling)
    b = RopeConfig(8, scaling=dict(reversed(list(scaling.items()))))
    assert a == b and hash(a) == hash(b)
    section = [1, 1, 2] if as_list else (1, 1, 2)
    c = RopeConfig(8, scaling={"rope_type": "default", "mrope_section": section})
    assert c == RopeConfig(8, scaling={"rope_type": "default", "mrope_section": [1, 1, 2]})
    assert hash(c) == hash(RopeConfig(8, scaling={"rope_type": "default", "mrope_section": (1, 1, 2)}))


def test_dual_chunk_tables_of_meta_positions_are_meta_and_a_device_with_values_is_a_value_error():
    """Issue 24: dual_chunk_cos_sin with meta positions was "Tensor.item() cannot be called on meta tensors".
    As cos_sin: meta positions give meta tables (shapes only); asked for tables on a device with values, meta
    positions (which have none) are a ValueError naming them."""
    scaling = {"rope_type": "dual_chunk", "chunk_size": 16, "local_size": 5}
    config = RopeConfig(32, 1e6, scaling=scaling)
    positions = torch.arange(6, device="meta").view(2, 3)
    tables = config.dual_chunk_cos_sin(positions)
    for cos, sin in tables:
        assert cos.is_meta and sin.is_meta and cos.shape == sin.shape == (2, 3, 16)
    for call in (config.dual_chunk_cos_sin, config.cos_sin):
        with pytest.raises(ValueError, match=r"^positions: expected a tensor with values.* got a meta"):
            call(positions, device="cpu")


def test_seq_len_zero_is_an_empty_sequence_as_in_transformers_and_negative_is_refused():
    """Issue 24: seq_len=0 was refused where transformers' init functions take it (``if seq_len and ...``:
    no sequence longer than the original length, so longrope's short factors and dynamic NTK's base)."""
    longrope = RopeConfig(
        16, scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                     "original_max_position_embeddings": 64, "factor": 4.0},
    )  # fmt: skip
    dynamic = RopeConfig(16, scaling={"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=64)
    for config in (longrope, dynamic):
        assert torch.equal(config.inv_freq(seq_len=0), config.inv_freq(seq_len=1))
        assert config.attention_scaling(0) == config.attention_scaling(1)
        with pytest.raises(ValueError, match=r"^seq_len: expected an integer >= 0 or None, got -1"):
            config.inv_freq(seq_len=-1)


def test_cos_sin_of_a_dynamic_length_exports_without_specializing_it():
    """Under torch.export the rows are one piece, not a loop over a symbolic length (which pinned a dynamic
    sequence length to the traced one: RotaryEmbedding's rows past its first 2048, docs/export.md)."""
    config = RopeConfig(16, max_position_embeddings=4096)

    class Rows(torch.nn.Module):
        def forward(self, positions):
            return config.cos_sin(positions)

    seq = torch.export.Dim("seq", min=2, max=4096)
    program = torch.export.export(Rows(), (torch.arange(8)[None],), dynamic_shapes={"positions": {1: seq}})
    positions = torch.arange(3000, 3020)[None]
    for got, want in zip(program.module()(positions), config.cos_sin(positions), strict=True):
        assert torch.equal(got, want)
