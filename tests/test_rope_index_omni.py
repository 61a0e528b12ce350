"""Qwen3-Omni's time-aligned M-RoPE positions against transformers 5.24's own get_rope_index."""

from __future__ import annotations

import types

import pytest
import torch

import ropekit
from ropekit.rope_index_omni import audio_output_length

omni = pytest.importorskip("transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe")
from transformers import Qwen3OmniMoeConfig  # noqa: E402

CONFIG = Qwen3OmniMoeConfig()
THINKER = CONFIG.thinker_config
VSTART, VEND = 151652, 151653
IMAGE, VIDEO = THINKER.image_token_id, THINKER.video_token_id
AUDIO, ASTART, AEND = THINKER.audio_token_id, THINKER.audio_start_token_id, THINKER.audio_start_token_id + 1
MERGE = THINKER.vision_config.spatial_merge_size
N_WINDOW = THINKER.audio_config.n_window


def _hf(input_ids, attention_mask, **kwargs):
    """transformers' own function, on a stand-in for the thinker model (it reads config and merge size)."""
    config = Qwen3OmniMoeConfig().thinker_config
    config.vision_start_token_id = VSTART  # the thinker's default config omits it; checkpoints carry it
    model = types.SimpleNamespace(config=config, spatial_merge_size=MERGE)
    cls = omni.Qwen3OmniMoePreTrainedModelForConditionalGeneration
    model.get_llm_pos_ids_for_vision = types.MethodType(cls.get_llm_pos_ids_for_vision, model)
    return cls.get_rope_index(model, input_ids, attention_mask=attention_mask, **kwargs)


def _config():
    d = CONFIG.to_dict()
    d["thinker_config"]["vision_start_token_id"] = VSTART
    return d


def _visual(token, grid):
    t, h, w = grid
    return [VSTART, token] + [token] * (t * h * w // MERGE**2 - 1) + [VEND]


def _audio(seqlen):
    return [ASTART] + [AUDIO] * audio_output_length(seqlen, N_WINDOW) + [AEND]


def _batch(rows):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


@pytest.mark.parametrize("seconds", [[0.5, 2.0], [1.3, 0.04]])
def test_images_audio_and_videos_match_transformers(seconds):
    images = [(1, 4, 4), (1, 2, 6)]
    videos = [(2, 4, 6), (3, 2, 2)]
    audios = [200, 1234, 37]
    row0 = [1, 2, *_visual(IMAGE, images[0]), 3, *_audio(audios[0]), 4, 5, *_visual(VIDEO, videos[0]), 6]
    row1 = _audio(audios[1]) + _visual(VIDEO, videos[1]) + [7] + _visual(IMAGE, images[1]) + _audio(audios[2])
    ids, mask = _batch([row0, row1])
    kwargs = dict(
        image_grid_thw=torch.tensor(images), video_grid_thw=torch.tensor(videos),
        audio_seqlens=torch.tensor(audios), second_per_grids=torch.tensor(seconds),
    )  # fmt: skip
    want, want_delta = _hf(ids, mask, **kwargs)
    got, delta = ropekit.get_rope_index(
        _config(), ids, None, kwargs["image_grid_thw"], kwargs["video_grid_thw"], mask,
        kwargs["second_per_grids"], audio_seqlens=kwargs["audio_seqlens"],
    )  # fmt: skip
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(delta, want_delta.to(delta.dtype), rtol=0, atol=0)


@pytest.mark.parametrize(("audio_len", "seconds"), [(300, 2.0), (800, 0.5), (40, 1.0)])
def test_audio_in_video_is_merged_by_time_as_transformers_does(audio_len, seconds):
    video = (4, 4, 4)
    body = [VIDEO] * (4 * 4 * 4 // MERGE**2) + [AUDIO] * audio_output_length(audio_len, N_WINDOW)
    row = [1, 2, VSTART, ASTART, *body, AEND, VEND, 3, 4]
    ids, mask = _batch([row, [5, *row]])
    kwargs = dict(
        video_grid_thw=torch.tensor([video, video]), audio_seqlens=torch.tensor([audio_len, audio_len]),
        second_per_grids=torch.tensor([seconds, seconds]), use_audio_in_video=True,
    )  # fmt: skip
    want, want_delta = _hf(ids, mask, **kwargs)
    got, delta = ropekit.get_rope_index(
        _config(), ids, video_grid_thw=kwargs["video_grid_thw"], attention_mask=mask,
        second_per_grid_ts=kwargs["second_per_grids"], audio_seqlens=kwargs["audio_seqlens"],
        use_audio_in_video=True,
    )  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(delta, want_delta.to(delta.dtype), rtol=0, atol=0)
    # Time-aligned: inside the run the time axis never goes back (video and audio merged by time), and the
    # frames' times are position_id_per_seconds * seconds apart.
    run = got[0, 1][5 : 5 + len(body)]  # row 1 has no padding: text, text, text, <vision>, <audio>, run
    assert bool((run.diff() >= 0).all())
    start = got[0, 1][4] + 1
    frames = start + torch.arange(4) * THINKER.position_id_per_seconds * seconds
    assert all(bool((run == f).any()) for f in frames)


def test_text_and_audio_only_prompts_match_transformers():
    ids, mask = _batch([[1, 2, 3, *_audio(90), 4], [1, 2]])
    want, want_delta = _hf(ids, mask, audio_seqlens=torch.tensor([90]))
    got, delta = ropekit.get_rope_index(_config(), ids, attention_mask=mask, audio_seqlens=torch.tensor([90]))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(delta, want_delta.to(delta.dtype), rtol=0, atol=0)


def test_audio_output_length_matches_transformers():
    for n in (1, 37, 99, 100, 101, 1234, 30000):
        assert audio_output_length(n, N_WINDOW) == int(
            omni._get_feat_extract_output_lengths(torch.tensor(n), N_WINDOW)
        )


def test_missing_grids_and_lengths_are_value_errors():
    ids, mask = _batch([[1, *_visual(IMAGE, (1, 4, 4)), *_audio(50)]])
    with pytest.raises(ValueError, match="audio_seqlens"):
        ropekit.get_rope_index(_config(), ids, image_grid_thw=torch.tensor([[1, 4, 4]]), attention_mask=mask)
    with pytest.raises(ValueError, match="image_grid_thw"):
        ropekit.get_rope_index(
            _config(), ids, video_grid_thw=torch.tensor([[1, 4, 4]]), audio_seqlens=torch.tensor([50])
        )
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        ropekit.get_rope_index({"model_type": "qwen2_vl", "vision_config": {"spatial_merge_size": 2}}, ids)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_seconds_that_are_not_finite_and_non_negative_are_refused_as_for_qwen_vl(bad):
    ids, mask = _batch([_visual(VIDEO, (2, 4, 4))])
    with pytest.raises(ValueError, match=r"second_per_grid_ts: expected finite numbers >= 0"):
        ropekit.get_rope_index(
            _config(), ids, video_grid_thw=torch.tensor([[2, 4, 4]]), attention_mask=mask,
            second_per_grid_ts=torch.tensor([bad]),
        )  # fmt: skip


@pytest.mark.parametrize("tokens", [2, 3, 5])
def test_an_image_run_that_is_not_its_grids_length_is_a_value_error(tokens):
    row = [1, VSTART, *[IMAGE] * tokens, VEND, 5, 6, 7, 8]  # the grid (1, 4, 4) gives 4 tokens
    ids, mask = _batch([row])
    with pytest.raises(ValueError, match=rf"input_ids: the image run at token 1 holds {tokens} image tokens"):
        ropekit.get_rope_index(_config(), ids, image_grid_thw=torch.tensor([[1, 4, 4]]), attention_mask=mask)


def test_an_audio_run_that_is_not_its_lengths_is_a_value_error():
    row = [1, ASTART, *[AUDIO] * 3, AEND, 2]  # 90 features give more than 3 tokens
    ids, mask = _batch([row, [1, *_visual(IMAGE, (1, 4, 4))]])
    with pytest.raises(ValueError, match=r"input_ids: the audio run at token 1 holds 3 audio tokens"):
        ropekit.get_rope_index(
            _config(), ids, image_grid_thw=torch.tensor([[1, 4, 4]]), attention_mask=mask,
            audio_seqlens=torch.tensor([90]),
        )  # fmt: skip
