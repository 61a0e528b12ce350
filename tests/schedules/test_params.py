"""Schedule parameters are read through validation's checks: a factor below 1 is refused for every
context-extension method, required keys may not be null, lengths are positive integers, flags are bools."""

from __future__ import annotations

import pytest

from ropekit import RopeConfig

LONG = [1.0] * 4


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 0.5},
        {"rope_type": "ntk", "factor": 0.5},
        {"rope_type": "dynamic", "factor": 0.5},
        {"rope_type": "yarn", "factor": 0.5},
        {"rope_type": "llama3", "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        {"rope_type": "longrope", "factor": 0.5, "short_factor": LONG, "long_factor": LONG},
    ],
)
def test_a_factor_below_one_is_refused_for_every_extension_method(scaling):
    with pytest.raises(ValueError, match=r"scaling\['factor'\]: expected a finite number >= 1, got 0.5"):
        RopeConfig(8, scaling=scaling, max_position_embeddings=64)


@pytest.mark.parametrize("rope_type", ["linear", "ntk", "dynamic", "yarn", "llama3"])
def test_a_factor_of_exactly_one_is_the_unscaled_schedule(rope_type):
    scaling = {"rope_type": rope_type, "factor": 1.0}
    if rope_type == "llama3":
        scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
    config = RopeConfig(8, scaling=scaling, max_position_embeddings=64)
    plain = RopeConfig(8)
    assert (config.inv_freq() - plain.inv_freq()).abs().max() < 1e-15


def test_yarn_needs_the_factor_key_as_transformers_does():
    with pytest.raises(ValueError, match=r"missing keys \['factor'\]"):
        RopeConfig(8, scaling={"rope_type": "yarn"}, max_position_embeddings=64)


@pytest.mark.parametrize("rope_type", ["linear", "ntk", "dynamic"])
def test_a_null_factor_is_refused_where_there_is_no_default(rope_type):
    with pytest.raises(ValueError, match=r"scaling\['factor'\]: expected a finite number >= 1, got None"):
        RopeConfig(8, scaling={"rope_type": rope_type, "factor": None}, max_position_embeddings=64)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            {"original_max_position_embeddings": 0},
            r"original_max_position_embeddings'\]: expected a positive",
        ),
        (
            {"original_max_position_embeddings": 16.0},
            r"original_max_position_embeddings'\]: expected a positive",
        ),
        ({"truncate": 1}, r"scaling\['truncate'\]: expected a bool, got 1"),
        ({"mscale": -1.0}, r"scaling\['mscale'\]: expected a finite number >= 0, got -1.0"),
        ({"beta_fast": 0}, r"scaling\['beta_fast'\]: expected a finite number > 0, got 0"),
    ],
)
def test_bad_yarn_values_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        RopeConfig(8, scaling={"rope_type": "yarn", "factor": 2.0, **extra}, max_position_embeddings=64)
