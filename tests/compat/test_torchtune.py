"""ropekit.compat.torchtune against the cases of torchtune's own tests.

Follows torchtune 0.6's ``tests/torchtune/modules/test_position_embeddings.py`` (pytorch/torchtune, commit
0e08081: ``TestRotaryPositionEmbedding``) and ``tests/torchtune/models/llama3_1/test_position_embeddings.py``
(commit 3110bf9: ``TestLlama3ScaledRoPE``): the same input (seed 0, x = randn(4, 2048, 32, 128), dim 128,
max_seq_len 4096), the same golden statistics of the output (mean, sum, max) and of the Llama 3.1 cache, and
the same position cases (input_pos None, arange(seq) and arange(seq) expanded to the batch give the same
output). The golden values are torchtune's, which forms its angles in float32; ropekit forms them in float64,
so the sum of 2^25 outputs differs by 0.057 where torchtune allows 1e-5 relative: that check allows 0.1
absolute, and the elementwise checks against ropekit's float64 reference carry the rest. The two golden
forward tests keep torchtune's full size (a few hundred MB, about a second) because statistics of a smaller
input have no published values; the other tests are small.

The same file's ``TestVisionRotaryPositionEmbedding`` (seed 0, x = randn(2, 51, 8, 4): 3 tiles of 4 x 4
patches plus CLS, dim 2; golden mean / sum / max) and both classes' ``test_rope_init_meta_device`` (a module
built on meta, then ``rope_init()``, has the buffers of one built on the CPU), and
``tests/torchtune/models/phi3/test_phi3_position_embeddings.py`` (commit a22b80d: seed 0,
x = randn(4, 60, 32, 96), golden mean and sum) are followed too. torchtune 0.6.1 itself does not import
against the installed torchao, but its position-embedding files import only torch: when torchtune is
installed they are loaded by path and every module is compared with torchtune's own, output for output.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ropekit.compat.torchtune import (
    Llama3ScaledRoPE,
    Phi3RotaryPositionalEmbeddings,
    RotaryPositionalEmbeddings,
    VisionRotaryPositionalEmbeddings,
)

from .conftest import NO_DEFAULT, signature_of

GOLDEN = {  # torchtune's EXPECTED_X_OUT_{MEAN, SUM, MAX}
    RotaryPositionalEmbeddings: (6.4543e-05, 2165.7053, 5.4546),
    Llama3ScaledRoPE: (-2.4781e-06, -83.1523, 5.4625),
}


@pytest.fixture(scope="module")
def torchtune_input() -> torch.Tensor:
    torch.manual_seed(0)  # torchtune's set_seed(0) on one process
    return torch.randn(4, 2048, 32, 128)  # (bsz, seq_len, num_heads, head_dim)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [RotaryPositionalEmbeddings, Llama3ScaledRoPE], ids=lambda c: c.__name__)
def test_forward_reproduces_torchtune_golden_statistics(backend, torchtune_input, cls):
    mean, total, top = GOLDEN[cls]
    rope = cls(dim=128, max_seq_len=4096)
    x_out = rope(torchtune_input)
    assert x_out.shape == torchtune_input.shape
    torch.testing.assert_close(x_out.mean(), torch.tensor(mean), atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(x_out.max(), torch.tensor(top), atol=1e-4, rtol=1e-5)
    # torchtune's float32 angles move the sum of 2^25 outputs by 0.057 (measured, both modules); 0.1 is 3e-9
    # per output. The elementwise check against the float64 reference is test_rotates_interleaved_pairs_...
    torch.testing.assert_close(x_out.sum(), torch.tensor(total), atol=0.1, rtol=0)
    seq = torchtune_input.shape[1]
    # input_pos covering the whole sequence, shared (seq,) or per sample (bsz, seq): the same output.
    assert torch.equal(rope(torchtune_input, input_pos=torch.arange(seq)), x_out)
    packed = torch.arange(seq).unsqueeze(0).expand(torchtune_input.shape[0], seq)
    assert torch.equal(rope(torchtune_input, input_pos=packed), x_out)


def test_llama3_cache_reproduces_torchtune_golden_statistics():
    """torchtune's test_cache_equality: the (4096, 64, 2) cache has mean 0.1738 and sum 91141.7656."""
    cache = Llama3ScaledRoPE(dim=128, max_seq_len=4096).cache
    assert cache.shape == (4096, 64, 2)
    torch.testing.assert_close(cache.mean(), torch.tensor(0.1738), atol=1e-4, rtol=1.3e-6)
    torch.testing.assert_close(cache.sum(), torch.tensor(91141.7656), atol=1e-4, rtol=1.3e-6)
    assert cache.max() == 1.0


def meta_frequencies(dim, base, scale=None):
    """Meta's llama-models formula, in Python floats: base^(-2i/dim), then Llama 3.1's apply_scaling."""
    freqs = [1.0 / base ** (2 * i / dim) for i in range(dim // 2)]
    if scale is None:
        return freqs
    factor, low, high, old = scale
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


@pytest.mark.parametrize("input_pos_kind", ["none", "shared", "per_sample"])
@pytest.mark.parametrize("llama3", [False, True])
def test_rotates_interleaved_pairs_by_meta_frequencies(
    backend, assert_matches_reference, llama3, input_pos_kind
):
    """torchtune pairs (2i, 2i+1), as Meta's LLaMA code does; angles = position * frequency."""
    g = torch.Generator().manual_seed(4)
    bsz, seq, heads, dim = 2, 9, 3, 32
    x = torch.randn(bsz, seq, heads, dim, generator=g)
    if llama3:
        rope, scale = Llama3ScaledRoPE(dim, 64, 500000, 8, 1, 4, 32), (8, 1, 4, 32)
        base = 500000
    else:
        rope, scale, base = RotaryPositionalEmbeddings(dim, 64, 10000), None, 10000
    positions = {
        "none": torch.arange(seq).expand(bsz, seq),
        "shared": torch.tensor([3, 9, 0, 40, 63, 2, 7, 7, 1]).expand(bsz, seq),
        "per_sample": torch.randint(0, 64, (bsz, seq), generator=g),
    }[input_pos_kind]
    input_pos = {"none": None, "shared": positions[0], "per_sample": positions}[input_pos_kind]
    x_before = x.clone()
    out = rope(x, input_pos=input_pos)
    assert torch.equal(x, x_before)
    angles = torch.arange(64, dtype=torch.float64)[:, None] * torch.tensor(meta_frequencies(dim, base, scale))
    assert_matches_reference(out, x, angles.cos(), angles.sin(), positions.numpy(), interleaved=True)
    assert backend.calls > 0


def test_bfloat16_input_keeps_its_dtype_and_trains(backend):
    rope = RotaryPositionalEmbeddings(16, max_seq_len=32)
    x = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    out = rope(x)
    assert out.dtype == torch.bfloat16
    (out.float() * out.float()).sum().backward()  # a rotation keeps norms: d/dx |Rx|^2 = 2x
    torch.testing.assert_close(x.grad.float(), 2 * x.detach().float(), atol=0.1, rtol=0.02)


def test_positions_past_max_seq_len_grow_the_table():
    rope = RotaryPositionalEmbeddings(16, max_seq_len=8)
    x = torch.randn(1, 20, 1, 16)
    assert torch.equal(rope(x)[:, :8], RotaryPositionalEmbeddings(16, max_seq_len=32)(x)[:, :8])


def test_errors_name_torchtune_arguments():
    rope = RotaryPositionalEmbeddings(16, max_seq_len=8)
    with pytest.raises(ValueError, match=r"^x: expected shape \(batch, seq, heads, dim = 16\)"):
        rope(torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"^input_pos: expected shape \(batch, seq\)"):
        rope(torch.randn(2, 4, 2, 16), input_pos=torch.arange(3))
    with pytest.raises(ValueError, match=r"^input_pos: expected values >= 0"):
        rope(torch.randn(1, 4, 2, 16), input_pos=torch.tensor([0, 1, -2, 3]))
    with pytest.raises(ValueError, match=r"^max_seq_len: expected a positive int"):
        RotaryPositionalEmbeddings(16, max_seq_len=0)
    with pytest.raises(ValueError, match=r"head_dim|rotary_dim"):
        RotaryPositionalEmbeddings(15)


@pytest.mark.parametrize("base", [10_000, 500_000])
@pytest.mark.parametrize("cls", [RotaryPositionalEmbeddings, Llama3ScaledRoPE], ids=lambda c: c.__name__)
def test_frequencies_are_torchtunes_float32_values_bit_for_bit(cls, base):
    """torchtune: 1 / base ** (arange(0, dim, 2).float() / dim) in float32, then (Llama 3.1) its
    apply_scaling, element by element on float32 scalars."""
    dim = 128
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    if cls is Llama3ScaledRoPE:
        scaled = []
        for f in freqs:  # 0-d float32 tensors, as in torchtune
            wavelen = 2 * math.pi / f
            if wavelen < 8192 / 4:
                scaled.append(f)
            elif wavelen > 8192 / 1:
                scaled.append(f / 8)
            else:
                smooth = (8192 / wavelen - 1) / (4 - 1)
                scaled.append((1 - smooth) * f / 8 + smooth * f)
        freqs = torch.tensor(scaled, dtype=torch.float32)
    got = cls(dim, 64, base).rope.config.inv_freq()
    assert torch.equal(got.float(), freqs) and torch.equal(got, got.float().double())


def test_signatures_are_torchtunes():
    assert signature_of(RotaryPositionalEmbeddings.__init__) == [
        ("dim", NO_DEFAULT),
        ("max_seq_len", 4096),
        ("base", 10_000),
        ("backend", "auto"),  # ropekit's keyword-only addition
    ]
    assert signature_of(Phi3RotaryPositionalEmbeddings.__init__) == signature_of(
        RotaryPositionalEmbeddings.__init__
    )
    assert signature_of(Phi3RotaryPositionalEmbeddings.forward) == [("x", NO_DEFAULT), ("input_pos", None)]
    assert signature_of(VisionRotaryPositionalEmbeddings.__init__) == [
        ("patch_size", NO_DEFAULT),
        ("tile_size", NO_DEFAULT),
        ("max_num_tiles", NO_DEFAULT),
        ("dim", NO_DEFAULT),
        ("base", 10_000),
        ("append_cls_token", True),
        ("backend", "auto"),
    ]
    assert signature_of(Llama3ScaledRoPE.__init__) == [
        ("dim", NO_DEFAULT),
        ("max_seq_len", 4096),
        ("base", 10_000),
        ("scale_factor", 8),
        ("low_freq_factor", 1),
        ("high_freq_factor", 4),
        ("old_context_len", 8192),
        ("backend", "auto"),
    ]
    assert signature_of(RotaryPositionalEmbeddings.forward) == [("x", NO_DEFAULT), ("input_pos", None)]


def torchtune_file(relative: str):
    """One of torchtune's position-embedding files, loaded by path: torchtune's package __init__ needs a
    torchao the environment does not have; these files import only torch."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchtune")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("torchtune is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    module_spec = importlib.util.spec_from_file_location(f"torchtune_{path.stem}_{path.parent.name}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_vision_forward_reproduces_torchtune_golden_statistics(backend):
    """torchtune's TestVisionRotaryPositionEmbedding.test_forward: 3 tiles of 4 x 4 patches + CLS, dim 2."""
    torch.manual_seed(0)  # torchtune's set_seed(0) on one process
    x = torch.randn(2, ((16 // 4) ** 2 + 1) * 3, 8, 4)  # (bsz, seq_len, num_heads, head_dim)
    rope = VisionRotaryPositionalEmbeddings(patch_size=4, tile_size=16, max_num_tiles=3, dim=2)
    x_out = rope(x)
    assert x_out.shape == x.shape
    torch.testing.assert_close(x_out.mean(), torch.tensor(-0.00903320), atol=1e-8, rtol=1e-5)
    torch.testing.assert_close(x_out.sum(), torch.tensor(-29.48437119), atol=1e-8, rtol=1e-5)
    torch.testing.assert_close(x_out.max(), torch.tensor(4.07074356), atol=1e-8, rtol=1e-5)
    assert backend.calls > 0


@pytest.mark.parametrize("append_cls_token", [True, False])
def test_vision_turns_x_then_y_pairs_by_patch_column_and_row_plus_one(
    assert_matches_reference, append_cls_token
):
    g = torch.Generator().manual_seed(2)
    grid, tiles, dim = 3, 2, 4  # pairs 0, 1 follow the column, pairs 2, 3 the row
    rope = VisionRotaryPositionalEmbeddings(8, 8 * grid, tiles, dim, append_cls_token=append_cls_token)
    x = torch.randn(2, tiles * (grid * grid + 1), 3, 2 * dim, generator=g)
    out = rope(x, input_pos=torch.arange(5))  # torchtune ignores keyword arguments; so does ropekit
    theta = torch.tensor(meta_frequencies(dim, 10_000), dtype=torch.float64)  # (dim / 2,)
    patch = torch.arange(grid * grid)
    angles = torch.cat([(patch % grid + 1)[:, None] * theta, (patch // grid + 1)[:, None] * theta], -1)
    cls = torch.zeros(1, dim, dtype=torch.float64)
    angles = torch.cat([angles, cls] if append_cls_token else [cls, angles]).repeat(tiles, 1)  # (s, dim)
    pos = np.broadcast_to(np.arange(angles.shape[0]), x.shape[:2])
    assert_matches_reference(out, x, angles.cos(), angles.sin(), pos, interleaved=True)
    cls_at = grid * grid if append_cls_token else 0
    assert torch.equal(out[:, cls_at], x[:, cls_at])  # the CLS token is not rotated
    with pytest.raises(ValueError, match=r"^x: expected shape \(batch, max_num_tiles"):
        rope(x[:, :-1])
    with pytest.raises(ValueError, match=r"^dim: expected a positive even int"):
        VisionRotaryPositionalEmbeddings(8, 16, 1, 3)


def test_phi3_forward_reproduces_torchtune_golden_statistics(backend):
    """torchtune's TestPhi3RotaryPositionalEmbeddings.test_forward: x = randn(4, 60, 32, 96), dim 96."""
    torch.manual_seed(0)
    x = torch.randn(4, 60, 32, 96)
    x_out = Phi3RotaryPositionalEmbeddings(dim=96, max_seq_len=4096)(x)
    assert x_out.shape == x.shape
    torch.testing.assert_close(x_out.mean(), torch.tensor(-0.0005), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(x_out.sum(), torch.tensor(-381.0620), atol=1e-3, rtol=1e-5)
    assert backend.calls > 0


@pytest.mark.parametrize("input_pos_kind", ["none", "s", "1s", "bs"])
def test_phi3_rotates_half_pairs_and_input_pos_shapes_broadcast_as_torchtune(
    backend, assert_matches_reference, input_pos_kind
):
    g = torch.Generator().manual_seed(5)
    bsz, seq, heads, dim = 3, 6, 2, 16
    x = torch.randn(bsz, seq, heads, dim, generator=g)
    rope = Phi3RotaryPositionalEmbeddings(dim, max_seq_len=32)
    shared = torch.tensor([4, 0, 31, 7, 7, 2])
    input_pos = {
        "none": None,
        "s": shared,
        "1s": shared[None],
        "bs": torch.randint(0, 32, (bsz, seq), generator=g),
    }[input_pos_kind]
    out = rope(x, input_pos)  # positional, as torchtune's Phi-3 forward takes it
    positions = torch.arange(seq) if input_pos is None else input_pos
    positions = positions.expand(bsz, seq)
    angles = torch.arange(32, dtype=torch.float64)[:, None] * torch.tensor(meta_frequencies(dim, 10_000))
    assert_matches_reference(out, x, angles.cos(), angles.sin(), positions.numpy(), interleaved=False)
    assert backend.calls > 0


def test_input_pos_of_shape_1_s_is_shared_by_the_batch():
    """torchtune reads cache[input_pos] and views it as (-1, s, 1, h_d // 2, 2): (1, s) broadcasts."""
    g = torch.Generator().manual_seed(6)
    rope = RotaryPositionalEmbeddings(16, max_seq_len=32)
    x = torch.randn(3, 4, 2, 16, generator=g)
    pos = torch.tensor([[5, 9, 2, 30]])
    assert torch.equal(rope(x, input_pos=pos), rope(x, input_pos=pos.expand(3, 4)))
    assert torch.equal(rope(x, input_pos=pos), rope(x, input_pos=pos[0]))


@pytest.mark.parametrize("use_to_empty", [False, True])
@pytest.mark.parametrize(
    "make",
    [
        lambda: RotaryPositionalEmbeddings(dim=16, max_seq_len=64),
        lambda: Llama3ScaledRoPE(dim=16, max_seq_len=64, old_context_len=32),
        lambda: Phi3RotaryPositionalEmbeddings(dim=16, max_seq_len=64),
        lambda: VisionRotaryPositionalEmbeddings(patch_size=4, tile_size=16, max_num_tiles=2, dim=8),
    ],
    ids=["rope", "llama3", "phi3", "vision"],
)
def test_rope_init_meta_device(make, use_to_empty):
    """torchtune's test_rope_init_meta_device: build on meta, rope_init(), same buffers as a CPU build; and
    the module then computes what the CPU one does (also after to_empty, FSDP's path)."""
    on_cpu = make()
    with torch.device("meta"):
        meta_rope = make()
    assert all(b.is_meta for b in meta_rope.buffers())
    if use_to_empty:
        meta_rope.to_empty(device="cpu")
        meta_rope.reset_parameters()
    else:
        meta_rope.rope_init()
    pairs = list(zip(on_cpu.buffers(), meta_rope.buffers(), strict=True))
    assert pairs
    for p1, p2 in pairs:
        torch.testing.assert_close(p1, p2, atol=0, rtol=0)
    x = torch.randn(2, 34 if isinstance(on_cpu, VisionRotaryPositionalEmbeddings) else 5, 2, 16)
    assert torch.equal(meta_rope(x), on_cpu(x))


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs", "seq"),
    [
        (RotaryPositionalEmbeddings, "modules/position_embeddings.py", {"dim": 32, "max_seq_len": 64}, 20),
        (Llama3ScaledRoPE, "models/llama3_1/_position_embeddings.py", {"dim": 32, "old_context_len": 16}, 20),
        (Phi3RotaryPositionalEmbeddings, "models/phi3/_position_embeddings.py", {"dim": 32}, 20),
        (
            VisionRotaryPositionalEmbeddings,
            "modules/position_embeddings.py",
            {"patch_size": 2, "tile_size": 8, "max_num_tiles": 2, "dim": 16},
            34,
        ),
    ],
    ids=["rope", "llama3", "phi3", "vision"],
)
@pytest.mark.parametrize("input_pos_kind", ["none", "s", "1s", "bs"])
def test_agrees_with_torchtune_itself(ours, theirs, kwargs, seq, input_pos_kind):
    module = getattr(torchtune_file(theirs), ours.__name__)(**kwargs)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, seq, 3, 32, generator=g)
    call = {}
    if ours is not VisionRotaryPositionalEmbeddings:
        positions = torch.randint(0, 64, (2, seq), generator=g)
        call = {
            "none": {},
            "s": {"input_pos": positions[0]},
            "1s": {"input_pos": positions[:1]},
            "bs": {"input_pos": positions},
        }[input_pos_kind]
    want = module(x, **call)
    got = ours(**kwargs)(x, **call)
    # torchtune forms its angles in float32 (positions < 64 here): a few float32 ulps of a unit value
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    # the caches too, over the rows where float32 angles are still that close (the docstring's p * 6e-8)
    torch.testing.assert_close(ours(**kwargs).cache[:64], module.cache[:64], atol=2e-5, rtol=1e-5)
