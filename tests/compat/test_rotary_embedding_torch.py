"""ropekit.compat.rotary_embedding_torch against lucidrains' own tests and the real package.

Follows rotary-embedding-torch's ``tests/test_rope.py`` (lucidrains/rotary-embedding-torch, commit ceb29d6:
``TestSimpleRopeApply``: dim 4 to 32 x theta 10 to 1e5; ``test_apply_rotation`` rotates a (1, dim) vector at
one position through ``forward`` then ``apply_rotary_emb`` and compares with the pairwise formula written
out, atol = rtol = 1e-4; ``test_frequencies``: theta^(-2i/dim) in float32, 1e-6). The peer's tests stop there;
every other feature (offsets, interpolate_factor, theta_rescale_factor, seq_before_head_dim, xPos through
``rotate_queries_and_keys`` and ``rotate_queries_with_cached_keys``, axial pixel frequencies, learned
frequencies) is compared with the real package, installed as a test-only dependency (pyproject's dev extra),
on fresh modules: float32 inputs at positions where the peer's float32 arithmetic is exact to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.compat.rotary_embedding_torch import RotaryEmbedding, apply_rotary_emb

from .conftest import NO_DEFAULT, signature_of

peer = pytest.importorskip("rotary_embedding_torch")
TOL = dict(atol=2e-5, rtol=1e-5)


def manual_apply_rope(input_vec: torch.Tensor, position: float, dim: int, theta: float) -> torch.Tensor:
    """The peer test's pairwise formula: pairs (2i, 2i+1) turned by position * theta^(-2i/dim)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2).double() / dim))
    cos, sin = (position * freqs).cos(), (position * freqs).sin()
    x0, x1 = input_vec[..., 0::2].double(), input_vec[..., 1::2].double()
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


@pytest.mark.parametrize("dim", [4, 8, 16, 32])
@pytest.mark.parametrize("theta", [10, 1000, 10000, 100000])
class TestSimpleRopeApply:
    @pytest.mark.parametrize("pos", [0, 1, 42, 13, 67, 69, 39])
    def test_apply_rotation(self, backend, dim, theta, pos):
        torch.manual_seed(pos)
        input_vec = torch.randn(1, dim)
        rope = RotaryEmbedding(dim=dim, theta=theta, cache_if_possible=False)
        freqs = rope.forward(torch.tensor([pos]), seq_len=1)
        result = apply_rotary_emb(freqs, input_vec)
        torch.testing.assert_close(
            result.double(), manual_apply_rope(input_vec, pos, dim, theta), atol=1e-4, rtol=1e-4
        )
        assert backend.calls > 0

    def test_frequencies(self, dim, theta):
        expected = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        torch.testing.assert_close(
            RotaryEmbedding(dim=dim, theta=theta).freqs.data, expected, atol=1e-6, rtol=1e-6
        )


def pair(**kwargs):
    """(ropekit's module, the peer's module) built with the same arguments."""
    return RotaryEmbedding(**kwargs), peer.RotaryEmbedding(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"interpolate_factor": 2.0},
        {"theta_rescale_factor": 4.0},
        {"seq_before_head_dim": True},
        {"freqs_for": "pixel", "max_freq": 2},  # angles < 50 rad, where the peer's float32 is still exact
        # the peer's cache is dim wide and raises for fewer frequencies: its own test turns it off too
        {"freqs_for": "constant", "num_freqs": 3, "cache_if_possible": False},
        {"custom_freqs": torch.tensor([1.0, 0.3, 0.01]), "cache_if_possible": False},
    ],
    ids=["lang", "interpolate", "ntk", "seq_first", "pixel", "constant", "custom"],
)
@pytest.mark.parametrize("offset", [0, 5])
def test_rotate_queries_or_keys_matches_the_peer(backend, kwargs, offset):
    ours, theirs = pair(dim=16, **kwargs)
    g = torch.Generator().manual_seed(1)
    shape = (2, 12, 3, 32) if kwargs.get("seq_before_head_dim") else (2, 3, 12, 32)  # head_dim 32 > dim
    q = torch.randn(shape, generator=g)
    before = q.clone()
    got = ours.rotate_queries_or_keys(q, offset=offset)
    torch.testing.assert_close(got, theirs.rotate_queries_or_keys(q, offset=offset), **TOL)
    assert torch.equal(q, before)
    rot = 2 * ours.freqs.numel()
    assert torch.equal(got[..., rot:], q[..., rot:])  # features past the rotated width pass through
    assert backend.calls > 0


@pytest.mark.parametrize("seq_before_head_dim", [False, True])
def test_xpos_queries_and_keys_match_the_peer(backend, seq_before_head_dim):
    ours, theirs = pair(dim=16, use_xpos=True, xpos_scale_base=16, seq_before_head_dim=seq_before_head_dim)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 10, 16, generator=g), torch.randn(2, 3, 10, 16, generator=g)
    if seq_before_head_dim:
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    for got, want in zip(
        ours.rotate_queries_and_keys(q, k), theirs.rotate_queries_and_keys(q, k), strict=True
    ):
        torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match=r"^scale: use_xpos=True"):
        ours.rotate_queries_or_keys(q)


@pytest.mark.parametrize("use_xpos", [False, True])
@pytest.mark.parametrize("offset", [0, 3])
def test_rotate_queries_with_cached_keys_matches_the_peer(backend, use_xpos, offset):
    ours, theirs = pair(dim=16, use_xpos=use_xpos, xpos_scale_base=32)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 9, 16, generator=g)
    got = ours.rotate_queries_with_cached_keys(q, k, offset=offset)
    want = theirs.rotate_queries_with_cached_keys(q, k, offset=offset)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(ValueError, match=r"^q: expected at most k's 4 tokens"):
        ours.rotate_queries_with_cached_keys(k, q)


@pytest.mark.parametrize("freqs_for", ["pixel", "lang"])
def test_axial_frequencies_and_apply_rotary_emb_match_the_peer(backend, freqs_for):
    ours, theirs = pair(dim=8, freqs_for=freqs_for, max_freq=10)
    freqs = ours.get_axial_freqs(5, 6, offsets=(1, 2))
    torch.testing.assert_close(freqs, theirs.get_axial_freqs(5, 6, offsets=(1, 2)), **TOL)
    assert freqs.shape == (5, 6, 16)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 6, 20, generator=g)  # (batch, height, width, dim): 4 features pass through
    torch.testing.assert_close(apply_rotary_emb(freqs, x), peer.apply_rotary_emb(freqs, x), **TOL)
    got = apply_rotary_emb(freqs, x, start_index=2)
    torch.testing.assert_close(got, peer.apply_rotary_emb(freqs, x, start_index=2), **TOL)
    assert torch.equal(got[..., :2], x[..., :2])


def test_learned_frequencies_train_like_the_peers(backend):
    ours, theirs = pair(dim=8, learned_freq=True)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 7, 8, generator=g)
    upstream = torch.randn(q.shape, generator=g)
    (ours.rotate_queries_or_keys(q) * upstream).sum().backward()
    (theirs.rotate_queries_or_keys(q) * upstream).sum().backward()
    assert isinstance(ours.freqs, torch.nn.Parameter) and ours.freqs.requires_grad
    torch.testing.assert_close(ours.freqs.grad, theirs.freqs.grad, atol=1e-4, rtol=1e-4)
    assert ours.freqs.grad.abs().sum() > 0


def test_bfloat16_positions_stay_exact(backend):
    """The peer forms positions in the input's dtype (300 and 301 are one bfloat16 value); ropekit does
    not."""
    rope = RotaryEmbedding(dim=8)
    q = torch.zeros(1, 1, 302, 8, dtype=torch.bfloat16)
    q[..., 0::2] = 1
    out = rope.rotate_queries_or_keys(q)
    assert out.dtype == torch.bfloat16
    assert not torch.equal(out[0, 0, 300], out[0, 0, 301])


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"^freqs_for: expected one of"):
        RotaryEmbedding(8, freqs_for="audio")
    with pytest.raises(ValueError, match=r"^interpolate_factor: expected a finite number >= 1"):
        RotaryEmbedding(8, interpolate_factor=0.5)
    with pytest.raises(ValueError, match=r"^dim: expected an even int"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match=r"^use_xpos: rotate_queries_and_keys"):
        RotaryEmbedding(8).rotate_queries_and_keys(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    with pytest.raises(ValueError, match=r"^freqs: expected an even width"):
        apply_rotary_emb(torch.randn(3, 10), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"^backend: expected"):
        RotaryEmbedding(8, backend="gpu")


def test_signatures_are_the_peers():
    ours = signature_of(RotaryEmbedding.__init__)
    theirs = signature_of(peer.RotaryEmbedding.__init__)
    assert [name for name, _ in ours] == [name for name, _ in theirs] + ["backend"]
    for (name, default), (_, peer_default) in zip(ours[:-1], theirs, strict=True):
        assert default == peer_default or (default is None and peer_default is None), name
    assert signature_of(apply_rotary_emb)[:6] == [
        ("freqs", NO_DEFAULT),
        ("t", NO_DEFAULT),
        ("start_index", 0),
        ("scale", 1.0),
        ("seq_dim", -2),
        ("freqs_seq_dim", None),
    ]


@pytest.mark.c_compiler
def test_a_steady_apply_rotary_emb_is_planned_and_equals_its_checked_first_call():
    """Issue 25: apply_rotary_emb's per-token rows (one batch row of every token) reach the core's gate as a
    plain table (ropekit.tables.plain_tables): its interleaved rows are read as they are, so the steady call
    is a launch plan (9 ropekit calls; 24 before), bit for bit its first call, and the peer's answer."""
    from call_count import assert_planned, steady_step

    rope = RotaryEmbedding(dim=32)
    freqs = rope(torch.arange(9.0) + 1000)  # (9, 32): positions 1000 .. 1008
    t = torch.randn(2, 4, 9, 32, generator=torch.Generator().manual_seed(6))  # (B, H, S, D)
    calls, first, planned = steady_step(lambda: apply_rotary_emb(freqs, t, backend="cpu"))
    assert_planned(calls, 10)
    assert torch.equal(planned, first)
    torch.testing.assert_close(planned, peer.apply_rotary_emb(freqs, t), **TOL)
