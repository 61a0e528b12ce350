"""Qwen3-Omni's time-aligned M-RoPE position ids (transformers 5.24, ``Qwen3OmniMoe...get_rope_index``).

Qwen3-Omni finds its runs from the token ids: ``<vision_start> image|video ... <vision_end>`` and
``<audio_start> audio ... <audio_end>``. Each token gets (t, h, w) positions; a run continues from the start
p (one past the largest position of the piece before it):

* text: t = h = w = p, p + 1, ...; the start and end tokens of a run are text tokens too;
* audio: n = :func:`audio_output_length` (audio_seqlens[a]) tokens at p, p + 1, ... on every axis;
* image: frame i, row r, column c at (p + i * position_id_per_seconds, p + r, p + c) (h and w merged);
* video: the same with i * second_per_grids[v] * position_id_per_seconds: time counts
  ``position_id_per_seconds`` (25) positions per second, so a frame at 2.4 s sits at t = p + 60;
* audio in video (``use_audio_in_video``): ``<vision_start><audio_start> ... <audio_end><vision_end>``; the
  video's tokens and its audio's tokens (audio token k at t = p + k: one per 1/25 s) are merged by time, a
  video token first when its t is not later than the audio token's.

Positions are float32 (video time is fractional). Without any image or video grid, every token is text
(audio runs then count as text, which gives the same positions: an audio run is consecutive on every axis).
``mrope_position_deltas`` is (largest position + 1) - (real tokens), as for Qwen-VL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ropekit.validation import check_bool, check_grid_thw, check_int, check_seconds_per_grid, describe

__all__ = ["audio_output_length", "omni_rope_index"]


def audio_output_length(feature_length: int, n_window: int) -> int:
    """Tokens Qwen3-Omni's audio encoder emits for ``feature_length`` input frames.

    Whole windows of 2 n_window frames give 13 tokens each; the rest goes through three stride-2 convolutions
    (transformers' ``_get_feat_extract_output_lengths``).
    """
    window = 2 * n_window
    rest = feature_length % window
    after = (rest - 1) // 2 + 1  # first convolution
    after = ((after - 1) // 2 + 1 - 1) // 2 + 1  # second and third
    return after + (feature_length // window) * 13


class _Ids:
    """The token ids and sizes of a Qwen3-Omni thinker config."""

    def __init__(self, d: Mapping[str, Any], merge: int) -> None:
        names = ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id")
        names += ("audio_start_token_id", "position_id_per_seconds")
        for name in names:
            value = d.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"config[{name!r}]: Qwen3-Omni's thinker config needs it, got {describe(value)}"
                )
        self.image, self.video, self.audio = d["image_token_id"], d["video_token_id"], d["audio_token_id"]
        self.vision_start, self.audio_start = d["vision_start_token_id"], d["audio_start_token_id"]
        self.per_second = d["position_id_per_seconds"]
        audio = d.get("audio_config")
        n_window = audio.get("n_window") if isinstance(audio, Mapping) else None
        self.n_window = check_int("config['audio_config']['n_window']", n_window)
        self.merge = merge


def _text(start: float, n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + start).expand(3, n)  # (3, n)


def _vision(start: float, times: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(3, t * h * w): frame-major, rows, columns; times (t,) are the frames' offsets on the time axis."""
    grid = torch.meshgrid(times.float(), torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    return torch.stack([g.reshape(-1) for g in grid]) + start


def _merge_by_time(video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """Video and audio tokens in time order (video first on ties), as pieces; the last piece is what the
    next run starts after."""
    pieces, i, j = [], 0, 0
    while i < video.shape[1] and j < audio.shape[1]:
        if video[0, i] <= audio[0, j]:
            pieces.append(video[:, i : i + 1])
            i += 1
        else:
            pieces.append(audio[:, j : j + 1])
            j += 1
    pieces += [t for t in (video[:, i:], audio[:, j:]) if t.shape[1]]
    return pieces


def _row(tokens: list[int], ids: _Ids, grids: dict[str, Any], use_audio_in_video: bool) -> torch.Tensor:
    """(3, len(tokens)) positions of one prompt; grids holds the batch-wide queues (consumed in order)."""
    pieces: list[torch.Tensor] = []

    def start() -> float:
        return float(pieces[-1].max()) + 1 if pieces else 0.0

    cursor = 0
    while True:
        vision_at = _find(tokens, ids.vision_start, cursor) if grids["visual_left"]() else None
        audio_at = _find(tokens, ids.audio_start, cursor) if grids["audio_left"]() else None
        found = [x for x in (vision_at, audio_at) if x is not None]
        if not found:
            break
        run = min(found)
        p = start()
        if run > cursor:
            pieces.append(_text(p, run - cursor))
            p += run - cursor
        in_video = run == vision_at and audio_at == run + 1
        edge = 2 if in_video else 1
        pieces.append(_text(p, edge))
        p += edge
        kind = "audio" if run == audio_at and run != vision_at else None
        if kind is None:
            nxt = tokens[run + 1] if run + 1 < len(tokens) else None
            kind = "audio_in_video" if in_video else {ids.image: "image", ids.video: "video"}.get(nxt)
            if kind is None:
                raise ValueError(
                    f"input_ids: a vision start token at {run} is followed by {nxt!r}, expected the image "
                    f"({ids.image}) or video ({ids.video}) token, or the audio start with use_audio_in_video"
                )
        length, sources = edge, []
        if kind in ("audio", "audio_in_video"):
            features = grids["audio"]()
            n_audio = audio_output_length(features, ids.n_window)
            audio = _text(p, n_audio)
            length += n_audio
            sources.append(f"audio_seqlens {features}")
        if kind == "audio":
            pieces.append(audio)
        else:
            (t, h, w), seconds = grids["image" if kind == "image" else "video"]()
            sources.append(f"{'image' if kind == 'image' else 'video'}_grid_thw {(t, h, w)}")
            h, w = h // ids.merge, w // ids.merge
            if kind == "image":  # one frame per second
                times = (torch.arange(t) * ids.per_second).float()
            else:  # float32 seconds, as transformers multiplies them
                times = torch.arange(t) * torch.tensor(seconds, dtype=torch.float32) * ids.per_second
            block = _vision(p, times, h, w)
            length += t * h * w
            pieces.extend(_merge_by_time(block, audio) if kind == "audio_in_video" else [block])
        _check_run(tokens, run, edge, length - edge, kind, ids, sources)
        pieces.append(_text(start(), edge))
        cursor = run + length + edge
    if cursor < len(tokens):
        pieces.append(_text(start(), len(tokens) - cursor))
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0)


def _check_run(
    tokens: list[int], run: int, edge: int, expected: int, kind: str, ids: _Ids, sources: list[str]
) -> None:
    """The run's tokens after its start tokens are exactly as many image / video / audio tokens as its grid
    or audio length gives (a shorter run took the end token and the text after it as patches).
    ``run`` counts the prompt's real tokens (padding left out)."""
    allowed = {
        "image": {ids.image}, "video": {ids.video}, "audio": {ids.audio},
        "audio_in_video": {ids.video, ids.audio},
    }[kind]  # fmt: skip
    found, at = 0, run + edge
    while at + found < len(tokens) and tokens[at + found] in allowed:
        found += 1
    if found != expected:
        what = "video and audio" if kind == "audio_in_video" else kind
        raise ValueError(
            f"input_ids: the {what} run at token {run} holds {found} {what} tokens; expected {expected}, "
            f"from {' and '.join(sources)} (spatial_merge_size {ids.merge}, n_window {ids.n_window})"
        )


def _find(tokens: list[int], token: int, begin: int) -> int | None:
    try:
        return tokens.index(token, begin)
    except ValueError:
        return None


def omni_rope_index(
    d: Mapping[str, Any],
    merge: int,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    second_per_grids: torch.Tensor | None,
    audio_seqlens: torch.Tensor | None,
    use_audio_in_video: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids (3, batch, seq) float32, deltas (batch, 1)) for Qwen3-Omni; see the module docstring.

    Called by :func:`ropekit.get_rope_index` with the thinker config ``d`` and its spatial_merge_size.

    Raises:
        ValueError: for a config without the token ids, shapes that disagree, fewer grids, audio lengths or
            seconds than the prompts use, seconds that are not finite numbers >= 0, a run whose image /
            video / audio tokens are not as many as its grid or audio length gives, a vision start followed
            by neither an image nor a video token.
    """
    ids = _Ids(d, merge)
    check_bool("use_audio_in_video", use_audio_in_video)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected a (batch, seq) tensor, got {describe(input_ids)}")
    shape = tuple(input_ids.shape)
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != shape
    ):
        raise ValueError(
            f"attention_mask: expected a tensor of input_ids' shape {shape}, got {describe(attention_mask)}"
        )
    mask = torch.ones(shape, dtype=torch.bool) if attention_mask is None else attention_mask.to("cpu") == 1
    position_ids = torch.zeros(3, *shape, dtype=torch.float32)
    if image_grid_thw is None and video_grid_thw is None:  # text only (audio runs are consecutive too)
        counts = mask.to(torch.float32).cumsum(-1) - 1  # (batch, seq)
        text = counts.masked_fill(~mask, 1.0)
        position_ids[:] = text
        deltas = text.amax(-1, keepdim=True) + 1 - mask.sum(-1, keepdim=True)
        return position_ids.to(input_ids.device), deltas.to(input_ids.device)
    grids = _queues(image_grid_thw, video_grid_thw, second_per_grids, audio_seqlens)
    deltas = []
    rows = input_ids.to("cpu").tolist()
    for row in range(shape[0]):
        tokens = [t for t, keep in zip(rows[row], mask[row].tolist(), strict=True) if keep]
        counts = _run_counts(tokens, ids, use_audio_in_video)
        grids["visual_left"] = lambda c=counts: c["visual"] > 0
        grids["audio_left"] = lambda c=counts: c["audio"] > 0
        positions = _row(tokens, ids, _counting(grids, counts), use_audio_in_video)
        position_ids[:, row, mask[row]] = positions
        deltas.append((float(positions.max()) + 1 if positions.numel() else 0.0) - len(tokens))
    return position_ids.to(input_ids.device), torch.tensor(deltas, device=input_ids.device)[:, None]


def _run_counts(tokens: list[int], ids: _Ids, use_audio_in_video: bool) -> dict[str, int]:
    """How many visual and audio runs a prompt has (transformers counts them before walking the prompt)."""
    after_vision = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == ids.vision_start]
    images = after_vision.count(ids.image)
    videos = after_vision.count(ids.audio_start if use_audio_in_video else ids.video)
    present = ids.image in tokens or ids.video in tokens
    audios = tokens.count(ids.audio_start) if ids.audio in tokens else 0
    return {"visual": images + videos if present else 0, "audio": audios}


def _counting(grids: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """The grid queues, each take counting down this row's remaining runs of its kind."""

    def take(kind: str, counter: str):
        def pop():
            counts[counter] -= 1
            return grids[kind]()

        return pop

    return {
        **grids,
        "image": take("image", "visual"),
        "video": take("video", "visual"),
        "audio": take("audio", "audio"),
    }


def _queues(image_grid_thw, video_grid_thw, second_per_grids, audio_seqlens) -> dict[str, Any]:
    """Batch-wide queues of (grid, seconds) per image and video, and feature lengths per audio."""
    images = check_grid_thw("image_grid_thw", image_grid_thw)
    videos = check_grid_thw("video_grid_thw", video_grid_thw)
    image_list = [] if images is None else [tuple(g) for g in images.tolist()]
    video_list = [] if videos is None else [tuple(g) for g in videos.tolist()]
    seconds = [1.0] * len(video_list)
    if second_per_grids is not None:
        seconds = check_seconds_per_grid(second_per_grids).reshape(-1).tolist()
    audios = [] if audio_seqlens is None else torch.as_tensor(audio_seqlens).reshape(-1).tolist()
    videos_seconds = zip(video_list, seconds, strict=False)  # too few seconds: the queue ends early
    state = {"image": iter(image_list), "video": iter(videos_seconds), "audio": iter(audios)}
    names = {"image": "image_grid_thw", "video": "video_grid_thw", "audio": "audio_seqlens"}

    def nxt(kind: str):
        def pop():
            item = next(state[kind], None)
            if item is None:
                raise ValueError(
                    f"{names[kind]}: the prompts have more {kind} runs than {names[kind]} (and, for videos, "
                    "second_per_grid_ts) give"
                )
            return (item, 1.0) if kind == "image" else item

        return pop

    return {"image": nxt("image"), "video": nxt("video"), "audio": nxt("audio")}
