"""ropekit.get_rope_index against transformers 5's own get_rope_index (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).

transformers' methods are called unbound with a stub ``self`` that carries the model's config: they read
only ``self.config`` and ``self.get_vision_position_ids``, so no model is built.
"""

from __future__ import annotations

import functools
import random
import types

import pytest
import torch

import ropekit
from ropekit.rope_index import mrope_decode_positions, vision_position_ids

transformers = pytest.importorskip("transformers")

MERGE = 2


def _hf_model_class(family):
    if family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

        return transformers.Qwen2VLConfig, Qwen2VLModel
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        return transformers.Qwen2_5_VLConfig, Qwen2_5_VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return transformers.Qwen3VLConfig, Qwen3VLModel


def hf_get_rope_index(family, config, *args, **kwargs):
    _, model_class = _hf_model_class(family)
    stub = types.SimpleNamespace(config=config)
    stub.get_vision_position_ids = functools.partial(model_class.get_vision_position_ids, stub)
    return model_class.get_rope_index(stub, *args, **kwargs)


def random_batch(family, rng, batch=3, pad="left"):
    """Token types, grids and mask for `batch` prompts mixing text, images and videos."""
    rows, images, videos = [], [], []
    for _ in range(batch):
        types_ = [0] * rng.randint(1, 4)
        for _ in range(rng.randint(1, 3)):
            h, w = MERGE * rng.randint(1, 3), MERGE * rng.randint(1, 3)
            if rng.random() < 0.5:
                images.append((1, h, w))
                types_ += [1] * (h * w // MERGE**2)
            else:
                t = rng.randint(1, 3)
                videos.append((t, h, w))
                frames = [t] if family != "qwen3_vl" else [1] * t  # Qwen3-VL: one run per frame
                for k, frame_count in enumerate(frames):
                    if k:
                        types_ += [0] * rng.randint(1, 3)  # the timestamp text between frames
                    types_ += [2] * (frame_count * h * w // MERGE**2)
            types_ += [0] * rng.randint(1, 4)
        rows.append(types_)
    length = max(len(r) for r in rows)
    mm, mask = torch.zeros(batch, length, dtype=torch.int64), torch.zeros(batch, length, dtype=torch.int64)
    for i, r in enumerate(rows):
        span = slice(length - len(r), length) if pad == "left" else slice(0, len(r))
        mm[i, span] = torch.tensor(r)
        mask[i, span] = 1
    grid = lambda g: torch.tensor(g, dtype=torch.int64).reshape(-1, 3) if g else None  # noqa: E731
    return mm, mask, grid(images), grid(videos)


FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pad", ["left", "right", "none"])
def test_positions_and_deltas_equal_transformers_on_random_grids(family, seed, pad):
    rng = random.Random(seed)
    config_class, _ = _hf_model_class(family)
    config = config_class()
    mm, mask, images, videos = random_batch(family, rng, batch=1 if pad == "none" else 3, pad=pad)
    input_ids = torch.randint(0, 100, mm.shape)
    mask = None if pad == "none" else mask
    extra = {}
    if family == "qwen2_5_vl" and videos is not None:
        extra["second_per_grid_ts"] = torch.tensor([rng.choice([0.5, 1.0, 2.0, 0.25]) for _ in videos])
    want = hf_get_rope_index(
        family,
        config,
        input_ids,
        mm,
        image_grid_thw=images,
        video_grid_thw=videos,
        attention_mask=mask,
        **extra,
    )
    for given in (config, config.to_dict()):  # a PretrainedConfig or its dict
        got = ropekit.get_rope_index(given, input_ids, mm, images, videos, mask, **extra)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1].reshape(-1), want[1].reshape(-1).to(torch.int64))
        assert got[0].shape == (3, *mm.shape) and got[1].shape == (mm.shape[0], 1)


def test_qwen2_5_spaces_video_frames_by_tokens_per_second_times_seconds_per_grid():
    config = transformers.Qwen2_5_VLConfig()
    mm = torch.tensor([[0] + [2] * 8 + [0]])  # a video of 2 frames of 2 x 2 merged tokens
    video = torch.tensor([[2, 4, 4]])
    pos, _ = ropekit.get_rope_index(
        config, mm, mm, video_grid_thw=video, second_per_grid_ts=torch.tensor([0.5])
    )
    interval = config.vision_config.tokens_per_second * 0.5
    assert pos[0, 0, 1:9].tolist() == [1] * 4 + [1 + int(interval)] * 4


def test_deltas_continue_decoding_one_past_the_largest_position_with_left_padding():
    config = transformers.Qwen2VLConfig()
    rng = random.Random(7)
    mm, mask, images, videos = random_batch("qwen2_vl", rng, batch=3, pad="left")
    pos, deltas = ropekit.get_rope_index(config, mm, mm, images, videos, mask)
    full_mask = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], dim=1)
    nxt = mrope_decode_positions(deltas, mm.shape[1], 2, attention_mask=full_mask)  # (3, batch, 2)
    largest = pos.amax(dim=(0, 2))  # (batch,)
    assert torch.equal(nxt[:, :, 0], largest.expand(3, -1) + 1)
    assert torch.equal(nxt[:, :, 1], largest.expand(3, -1) + 2)


def test_decode_positions_without_a_mask_follow_transformers_decode_step():
    deltas = torch.tensor([[-5], [3]])
    got = mrope_decode_positions(deltas, 10, 3)
    # transformers: arange(cache_length, cache_length + seq) expanded to (3, batch, seq), plus the deltas
    want = torch.arange(10, 13).view(1, 1, -1).expand(3, 2, -1) + deltas
    assert torch.equal(got, want)


def test_vision_position_ids_offsets_every_axis_by_the_start_and_scales_time():
    ids = vision_position_ids(5, 2, 2, 3, time_interval=2.5)
    assert ids.shape == (3, 12)
    assert ids[0].tolist() == [5] * 6 + [7] * 6  # floor(1 * 2.5) = 2
    assert ids[1].tolist() == [5, 5, 5, 6, 6, 6] * 2
    assert ids[2].tolist() == [5, 6, 7] * 4


def test_text_only_rows_get_plain_positions_and_zero_delta():
    config = transformers.Qwen3VLConfig()
    mm = torch.zeros(2, 6, dtype=torch.int64)
    pos, deltas = ropekit.get_rope_index(config, mm, mm)
    assert torch.equal(pos, torch.arange(6).expand(3, 2, 6))
    assert deltas.tolist() == [[0], [0]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"image_grid_thw": torch.tensor([[1, 4, 6]])}, "run of 4 image tokens"),
        ({}, "image_grid_thw: row 0 has more image runs"),
        ({"image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 2]])}, "more grids than"),
        ({"image_grid_thw": torch.tensor([[1.0, 4, 4]])}, "image_grid_thw: expected positive integer"),
        ({"image_grid_thw": torch.tensor([1, 4, 4])}, r"image_grid_thw: expected an integer tensor of shape"),
        ({"image_grid_thw": torch.tensor([[1, 4, 4]]), "second_per_grid_ts": torch.ones(1)}, "Qwen2.5-VL"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs, match):
    config = transformers.Qwen2VLConfig()
    mm = torch.tensor([[0, 1, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match=match):
        ropekit.get_rope_index(config, mm, mm, **kwargs)


def test_a_text_config_or_another_family_is_refused_with_the_reason():
    mm = torch.zeros(1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="vision_config"):
        ropekit.get_rope_index(
            transformers.Qwen2VLConfig().text_config.to_dict() | {"model_type": "qwen2_vl"}, mm, mm
        )
    with pytest.raises(ValueError, match="model_type"):
        ropekit.get_rope_index({"model_type": "llama"}, mm, mm)
    with pytest.raises(ValueError, match="mm_token_type_ids: expected 0"):
        ropekit.get_rope_index(transformers.Qwen2VLConfig(), mm, mm + 3)
    with pytest.raises(ValueError, match="attention_mask: expected a tensor of input_ids' shape"):
        ropekit.get_rope_index(transformers.Qwen2VLConfig(), mm, mm, attention_mask=torch.ones(1, 4))


def test_inputs_are_not_modified():
    config = transformers.Qwen3VLConfig()
    mm, mask, images, videos = random_batch("qwen3_vl", random.Random(3))
    given = [t for t in (mm, mask, images, videos) if t is not None]
    copies = [t.clone() for t in given]
    ropekit.get_rope_index(config, mm, mm, images, videos, mask)
    assert all(torch.equal(a, b) for a, b in zip(copies, given, strict=True))


def test_qwen3_vl_tables_at_get_rope_index_positions_equal_transformers_text_rotary_module():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = transformers.Qwen3VLConfig(
        text_config={"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "num_hidden_layers": 1}
    )
    text = config.text_config
    text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 2, 2]}
    mm, mask, images, videos = random_batch("qwen3_vl", random.Random(11), batch=2)
    positions, _ = ropekit.get_rope_index(config, mm, mm, images, videos, mask)
    cos, sin = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1), positions)  # (batch, seq, 16), halves
    ours = ropekit.RopeConfig.from_hf(text)
    assert ours.mrope_interleaved
    got_cos, got_sin = ours.cos_sin(positions)
    torch.testing.assert_close(got_cos, cos[..., :8], rtol=0, atol=1e-5)
    torch.testing.assert_close(got_sin, sin[..., :8], rtol=0, atol=1e-5)


def test_position_ids_follow_input_ids_dtype_and_deltas_are_int64():
    config = transformers.Qwen2VLConfig()
    mm = torch.tensor([[0, 1, 1, 1, 1, 0]])
    pos, deltas = ropekit.get_rope_index(config, mm.int(), mm, torch.tensor([[1, 4, 4]]))
    assert pos.dtype == torch.int32 and deltas.dtype == torch.int64
    assert pos[:, 0].tolist() == [[0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3]]
    assert deltas.tolist() == [[-2]]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.zeros(2),), {}, r"mrope_position_deltas: expected a \(batch, 1\) tensor"),
        ((torch.zeros(2, 1, dtype=torch.int64), -1), {}, "start: expected an integer >= 0"),
        ((torch.zeros(2, 1, dtype=torch.int64), 3), {"attention_mask": torch.ones(2, 3)}, r"attention_mask"),
    ],
)
def test_decode_positions_reject_bad_arguments(args, kwargs, match):
    if len(args) == 1:
        args = (*args, 0)
    with pytest.raises(ValueError, match=match):
        mrope_decode_positions(*args, **kwargs)


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -0.5])
def test_second_per_grid_ts_that_is_not_finite_and_non_negative_is_a_value_error(seconds):
    """Issue 24, defect 9: nan (or inf) seconds gave positions of -2^63 without an error; negative seconds
    run time backwards. Zero (every frame at one time) stays accepted, as in transformers."""
    config = transformers.Qwen2_5_VLConfig()
    mm = torch.tensor([[0] + [2] * 8 + [0]])  # a video of 2 frames of 2 x 2 merged tokens
    video = torch.tensor([[2, 4, 4]])
    for bad in (torch.tensor([seconds]), [seconds]):
        with pytest.raises(ValueError, match=r"^second_per_grid_ts: expected finite numbers >= 0"):
            ropekit.get_rope_index(config, mm, mm, video_grid_thw=video, second_per_grid_ts=bad)
    pos, _ = ropekit.get_rope_index(config, mm, mm, video_grid_thw=video, second_per_grid_ts=torch.zeros(1))
    assert pos[0, 0, 1:9].tolist() == [1] * 8


def test_meta_mm_token_type_ids_is_a_value_error_naming_it():
    """Issue 24: a meta mm_token_type_ids was NotImplementedError ("Cannot copy out of meta tensor")."""
    config = transformers.Qwen2VLConfig()
    ids = torch.zeros(1, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^mm_token_type_ids: expected a tensor with values.* got a meta"):
        ropekit.get_rope_index(config, ids, torch.zeros(1, 6, dtype=torch.int64, device="meta"))
