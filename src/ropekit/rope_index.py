"""Multimodal position ids: transformers 5's ``get_rope_index`` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

A Qwen-VL prompt mixes text runs with image and video runs (``mm_token_type_ids``: 0 text, 1 image, 2 video).
Every token gets three positions (temporal, height, width) for M-RoPE:

* a text run of n tokens continues from the current start p: t = h = w = p, p + 1, ..., and p grows by n;
* a visual run takes the next grid (t, h, w) of its kind (h and w in patches, merged spatial_merge x
  spatial_merge into one token) and gives the token at frame i, row r, column c the positions
  (p + floor(i * interval), p + r, p + c); then p grows by max(h, w) / spatial_merge.

The families differ only in ``interval`` and in how videos are cut:

* Qwen2-VL: interval 1 for images and videos.
* Qwen2.5-VL: videos use interval = tokens_per_second * second_per_grid_ts[v] (seconds per temporal patch),
  so the time axis counts in absolute time.
* Qwen3-VL: each video frame is its own run, preceded by a text timestamp ("<t1> <vision_start> frame
  <vision_end> <t2> ..."), so a video grid (t, h, w) serves t runs of (1, h, w) and time lives in the text.

This follows transformers 5.24 (``Qwen2VLModel.get_rope_index`` and its Qwen2.5 / Qwen3 versions), which
advances p by max(h, w) / spatial_merge after a grid; transformers 4 and the original Qwen code started the
next run one past the largest id used, which differs only for a video whose time axis outruns its spatial
extent. :func:`ropekit.mrope_positions` builds one sequence from a list of segments with that older rule.

``mrope_position_deltas`` is (largest position + 1) - (number of real tokens) per row: decoding continues
at position (tokens so far) + delta on all three axes (:func:`mrope_decode_positions`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ropekit.hf_config import load_hf_config
from ropekit.validation import (
    check_grid_thw,
    check_int,
    check_movable,
    check_number,
    check_seconds_per_grid,
    describe,
)

__all__ = [
    "ROPE_INDEX_FAMILIES",
    "get_rope_index",
    "mrope_decode_positions",
    "vision_position_ids",
]

# model_type -> family; a family decides the time interval and whether videos are cut into frames.
ROPE_INDEX_FAMILIES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl",
    "qwen3_omni_moe": "qwen3_omni",
}
TEXT, IMAGE, VIDEO = 0, 1, 2


def vision_position_ids(
    start: int, t: int, h: int, w: int, *, time_interval: float | torch.Tensor = 1.0
) -> torch.Tensor:
    """(3, t * h * w) positions of one visual grid (already merged), in row-major (frame, row, column) order.

    Frame i, row r, column c gets (start + floor(i * time_interval), start + r, start + c).
    """
    frames = (torch.arange(t) * time_interval).long() + start  # (t,)
    rows, cols = torch.arange(h) + start, torch.arange(w) + start  # (h,), (w,)
    grid = torch.meshgrid(frames, rows, cols, indexing="ij")  # 3 x (t, h, w)
    return torch.stack([g.reshape(-1) for g in grid])  # (3, t * h * w)


def _family_and_vision(config: Any) -> tuple[str, Mapping[str, Any]]:
    d = _thinker(load_hf_config(config))
    model_type = str(d.get("model_type") or "").removesuffix("_text").removesuffix("_thinker")
    if model_type not in ROPE_INDEX_FAMILIES:
        raise ValueError(
            f"config['model_type']: expected one of {sorted(ROPE_INDEX_FAMILIES)}, "
            f"got {d.get('model_type')!r}"
        )
    vision = d.get("vision_config")
    if not isinstance(vision, Mapping) or vision.get("spatial_merge_size") is None:
        raise ValueError(
            "config['vision_config']: expected the model's vision config with spatial_merge_size (pass the "
            f"full multimodal config, not its text_config), got {describe(vision)}"
        )
    return ROPE_INDEX_FAMILIES[model_type], vision


def _runs(types: list[int]) -> Iterator[tuple[int, int]]:
    """(token type, length) for each run of equal types."""
    for kind, run in itertools.groupby(types):
        yield kind, sum(1 for _ in run)


def get_rope_index(
    config: Any,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    *,
    audio_seqlens: torch.Tensor | None = None,
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE position ids for a batch of Qwen-VL prompts, as transformers 5's ``get_rope_index`` builds them.

    Args:
        config: the model's HF config (a ``PretrainedConfig`` or a dict): its model_type picks the family
            (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe) and vision_config gives spatial_merge_size
            (and, for Qwen2.5-VL, tokens_per_second).
        input_ids: (batch, seq) token ids (only their shape, device and dtype are used).
        mm_token_type_ids: (batch, seq) 0 for text, 1 for image and 2 for video tokens.
        image_grid_thw: (images, 3) patch grids (t, h, w) of the images, in order over the whole batch.
        video_grid_thw: (videos, 3) patch grids of the videos, in order over the whole batch.
        attention_mask: (batch, seq) 1 for real tokens, 0 for padding (left or right); padding gets
            position 0 and does not count.
        second_per_grid_ts: (videos,) seconds per temporal patch (Qwen2.5-VL, Qwen3-Omni; default 1 each).
        audio_seqlens: (audios,) Qwen3-Omni only: each audio's feature length (before its encoder).
        use_audio_in_video: Qwen3-Omni only: each video carries its audio, interleaved in time.

    Qwen3-Omni (``qwen3_omni_moe``, the full config or its ``thinker_config``) reads the runs from the token
    ids themselves (vision / audio start tokens), as its ``get_rope_index`` does; see
    :mod:`ropekit.rope_index_omni`. Its positions are float32: time counts position_id_per_seconds per second.

    Returns:
        (position_ids, mrope_position_deltas): position_ids (3, batch, seq) in input_ids' dtype and
        device; deltas (batch, 1), so that decoding continues at (real tokens so far) + delta.

    Raises:
        ValueError: naming the argument, for shapes that disagree, token types other than 0 / 1 / 2, a run of
            image or video tokens whose length is not what its grid gives (t * h * w / spatial_merge^2), too
            few or too many grids, or a config of another model family.
    """
    family, vision = _family_and_vision(config)
    merge = check_int("config['vision_config']['spatial_merge_size']", vision["spatial_merge_size"])
    if family == "qwen3_omni":
        from ropekit.rope_index_omni import omni_rope_index  # Qwen3-Omni reads token ids, not token types

        return omni_rope_index(
            _thinker(load_hf_config(config)), merge, input_ids, image_grid_thw, video_grid_thw,
            attention_mask, second_per_grid_ts, audio_seqlens, use_audio_in_video,
        )  # fmt: skip
    if mm_token_type_ids is None:
        raise ValueError(
            f"mm_token_type_ids: {family} needs the token types (0 text, 1 image, 2 video), got None"
        )
    if audio_seqlens is not None or use_audio_in_video:
        raise ValueError(
            f"audio_seqlens: only Qwen3-Omni has audio; {family} takes None and use_audio_in_video=False"
        )
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a (batch, seq) tensor, got {describe(input_ids)}")
    shape = tuple(input_ids.shape)
    for name, value in (("mm_token_type_ids", mm_token_type_ids), ("attention_mask", attention_mask)):
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != shape):
            raise ValueError(f"{name}: expected a tensor of input_ids' shape {shape}, got {describe(value)}")
    check_movable("mm_token_type_ids", mm_token_type_ids, torch.device("cpu"), where="the host device")
    types = mm_token_type_ids.to("cpu", torch.int64)
    if types.numel() and (types.min() < TEXT or types.max() > VIDEO):
        raise ValueError(
            "mm_token_type_ids: expected 0 (text), 1 (image) or 2 (video), "
            f"got values {types.unique().tolist()}"
        )
    images = check_grid_thw("image_grid_thw", image_grid_thw)
    videos = check_grid_thw("video_grid_thw", video_grid_thw)
    intervals = _video_intervals(family, vision, videos, second_per_grid_ts)
    if family == "qwen3_vl" and videos is not None:  # one run per frame, each frame a (1, h, w) grid
        intervals = intervals.repeat_interleave(videos[:, 0])
        videos = videos.repeat_interleave(videos[:, 0], dim=0)
        videos[:, 0] = 1
    queues = {IMAGE: _queue(images), VIDEO: _queue(videos)}
    names = {IMAGE: "image_grid_thw", VIDEO: "video_grid_thw"}
    video_index = itertools.count()

    mask = None if attention_mask is None else attention_mask.to("cpu").bool()
    position_ids = torch.zeros(3, *shape, dtype=torch.int64)  # (3, batch, seq); padding stays 0
    deltas = []
    for row in range(shape[0]):
        keep = slice(None) if mask is None else mask[row]
        row_types = types[row][keep].tolist()
        start, parts = 0, []
        for kind, length in _runs(row_types):
            if kind == TEXT:
                parts.append((torch.arange(length) + start).expand(3, length))
                start += length
                continue
            grid = next(queues[kind], None)
            if grid is None:
                raise ValueError(
                    f"{names[kind]}: row {row} has more {'image' if kind == IMAGE else 'video'} runs than "
                    f"the {names[kind]} rows given"
                )
            t, h, w = grid
            if h % merge or w % merge or t * h * w // merge**2 != length:
                raise ValueError(
                    f"mm_token_type_ids: row {row} has a run of {length} "
                    f"{'image' if kind == IMAGE else 'video'} tokens, but its grid {names[kind]} (t, h, w) = "
                    f"{(t, h, w)} with spatial_merge_size {merge} gives {t * h * w / merge**2:g}"
                )
            interval = 1.0 if kind == IMAGE else intervals[next(video_index)]
            parts.append(vision_position_ids(start, t, h // merge, w // merge, time_interval=interval))
            start += max(h, w) // merge
        ids = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)  # (3, real tokens)
        position_ids[:, row, keep] = ids
        deltas.append((int(ids.max()) + 1 if ids.numel() else 0) - len(row_types))
    for kind, queue in queues.items():
        if next(queue, None) is not None:
            raise ValueError(f"{names[kind]}: more grids than the runs of mm_token_type_ids use")
    deltas = torch.tensor(deltas, dtype=torch.int64, device=input_ids.device)[:, None]  # (batch, 1)
    return position_ids.to(device=input_ids.device, dtype=input_ids.dtype), deltas


def _queue(grids: torch.Tensor | None) -> Iterator[tuple[int, int, int]]:
    return iter(() if grids is None else [tuple(g) for g in grids.tolist()])


def _video_intervals(
    family: str,
    vision: Mapping[str, Any],
    videos: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
) -> torch.Tensor:
    """Time interval per video: tokens_per_second * seconds per temporal patch for Qwen2.5-VL, else 1."""
    count = 0 if videos is None else videos.shape[0]
    if family != "qwen2_5_vl":
        if second_per_grid_ts is not None:
            raise ValueError(
                f"second_per_grid_ts: only Qwen2.5-VL spaces video frames in time; {family} takes None"
            )
        return torch.ones(count)
    if second_per_grid_ts is None:
        seconds = torch.ones(count)
    else:
        seconds = check_seconds_per_grid(second_per_grid_ts)
        if seconds.dim() != 1 or seconds.shape[0] < count:
            raise ValueError(
                f"second_per_grid_ts: expected one number per video ({count}), "
                f"got {describe(second_per_grid_ts)}"
            )
    tokens_per_second = vision.get("tokens_per_second")
    if tokens_per_second is None:
        raise ValueError("config['vision_config']['tokens_per_second']: Qwen2.5-VL needs it, got none")
    check_number("config['vision_config']['tokens_per_second']", tokens_per_second, minimum=0)
    return tokens_per_second * seconds


def mrope_decode_positions(
    mrope_position_deltas: torch.Tensor,
    start: int,
    length: int = 1,
    *,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(3, batch, length) M-RoPE positions for `length` new text tokens after a prompt of `start` tokens.

    A new token's position on every axis is (real tokens before it) + delta, delta from
    :func:`get_rope_index`. Without attention_mask the tokens before it are `start` + its offset, as in
    transformers' decode step; with left padding pass the (batch, start + length) mask so pads do not count.

    Raises:
        ValueError: for deltas that are not (batch, 1), a negative start, or a mask of the wrong shape.
    """
    if (
        not isinstance(mrope_position_deltas, torch.Tensor)
        or mrope_position_deltas.dim() != 2
        or (mrope_position_deltas.shape[-1] != 1)
    ):
        raise ValueError(
            f"mrope_position_deltas: expected a (batch, 1) tensor, got {describe(mrope_position_deltas)}"
        )
    start = check_int("start", start, minimum=0, expected="an integer >= 0")
    length = check_int("length", length)
    batch, device = mrope_position_deltas.shape[0], mrope_position_deltas.device
    if attention_mask is None:
        text = torch.arange(start, start + length, device=device).expand(batch, length)  # (batch, length)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (
            batch,
            start + length,
        ):
            raise ValueError(
                f"attention_mask: expected shape (batch, start + length) = {(batch, start + length)}, "
                f"got {describe(attention_mask)}"
            )
        counts = attention_mask.to(device=device, dtype=torch.int64).cumsum(-1) - 1  # (batch, start + length)
        text = counts[:, start:]
    return (text + mrope_position_deltas).expand(3, batch, length)


def _thinker(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-Omni's thinker config (the part that sees text, images, video and audio), or d itself.

    Its vision_start_token_id lives beside it in the talker config when the thinker does not name it.
    """
    thinker = d.get("thinker_config")
    if not isinstance(thinker, Mapping):
        return dict(d)
    out = {**thinker, "model_type": "qwen3_omni_moe"}
    talker = d.get("talker_config")
    if out.get("vision_start_token_id") is None and isinstance(talker, Mapping):
        out["vision_start_token_id"] = talker.get("vision_start_token_id")
    return out
