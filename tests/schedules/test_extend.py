"""The one (method, factor, original length) -> scaling map shared by extend_context, inspect and the demo."""

import pytest
import torch

from ropekit import RopeConfig
from ropekit.schedules import EXTEND_METHODS, extension_scaling, ntk_base


@pytest.mark.parametrize("method", [m for m in EXTEND_METHODS if m != "longrope"])
def test_extension_scaling_builds_a_config_that_reaches_original_times_factor(method):
    scaling, max_positions = extension_scaling(method, 4.0, 4096)
    config = RopeConfig(128, 10000.0, scaling=scaling, max_position_embeddings=max_positions)
    assert config.rope_type == method
    assert max_positions == (4096 if method == "dynamic" else 16384)


def test_extension_scaling_is_a_setting_not_an_accumulation():
    assert extension_scaling("yarn", 4.0, 4096) == extension_scaling("yarn", 4.0, 4096)
    assert extension_scaling("yarn", 4.0, 4096)[0]["original_max_position_embeddings"] == 4096


def test_longrope_carries_its_factor_in_max_positions_and_its_lists_in_params():
    scaling, max_positions = extension_scaling(
        "longrope", 2.0, 64, short_factor=[1.0] * 4, long_factor=[2.0] * 4
    )
    assert "factor" not in scaling and max_positions == 128
    RopeConfig(8, 10000.0, scaling=scaling, max_position_embeddings=max_positions)


def test_ntk_base_divides_the_lowest_frequency_by_exactly_factor():
    d, base, factor = 64, 10000.0, 8.0
    new = ntk_base(base, factor, d)
    lowest = lambda b: b ** (-(d - 2) / d)  # noqa: E731
    assert lowest(new) == pytest.approx(lowest(base) / factor, rel=1e-12)
    ntk = RopeConfig(d, base, scaling={"rope_type": "ntk", "factor": factor}).inv_freq()
    torch.testing.assert_close(ntk, RopeConfig(d, new).inv_freq(), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="rope", factor=2.0, original_max_position_embeddings=8), "method"),
        (dict(method="yarn", factor=0.5, original_max_position_embeddings=8), "factor.*>= 1"),
        (dict(method="yarn", factor="2", original_max_position_embeddings=8), "factor"),
        (
            dict(method="yarn", factor=2.0, original_max_position_embeddings=0),
            "original_max_position_embeddings",
        ),
    ],
)
def test_extension_scaling_rejects_bad_requests_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        extension_scaling(**kwargs)
