import pytest
import torch

from ropekit.config import RopeConfig
from ropekit.tools.demo.model import ByteTransformer, ModelConfig

SMALL = {"dim": 32, "n_layers": 2, "n_heads": 2}


def model(variant: str, **overrides) -> ByteTransformer:
    torch.manual_seed(0)
    return ByteTransformer(ModelConfig(variant=variant, **{**SMALL, **overrides})).eval()


def tokens(seq: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", ["nope", "sinusoidal", "rope"])
def test_later_bytes_never_change_earlier_logits(variant):
    x = tokens()
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 7) % 256
    m = model(variant)
    with torch.no_grad():
        torch.testing.assert_close(m(x)[:, :12], m(y)[:, :12])


def test_one_nope_layer_is_blind_to_the_order_of_the_prefix():
    # Without position information, one causal attention layer sees the prefix as a set (attention is a
    # weighted sum over keys). Deeper NoPE stacks are not: layer 1 leaves each token a trace of how many
    # tokens precede it.
    x = tokens()
    y = x.clone()
    y[:, :-1] = x[:, :-1].flip(1)
    m = model("nope", n_layers=1, prev_token_keys=False)
    with torch.no_grad():
        torch.testing.assert_close(m(x)[:, -1], m(y)[:, -1], rtol=0, atol=1e-6)


def test_with_previous_token_keys_one_nope_layer_sees_the_prefix_as_a_set_of_byte_pairs():
    # Each key carries (byte, previous byte): shuffling whole (previous, current) pairs, with the last two
    # bytes fixed, keeps the output; flipping the prefix reverses every pair and changes it.
    x = torch.tensor([[9, 1, 2, 9, 3, 4, 9, 7, 8, 9, 6]])
    pairs_moved = torch.tensor([[9, 7, 8, 9, 1, 2, 9, 3, 4, 9, 6]])  # blocks "9 a b" reordered
    m = model("nope", n_layers=1)
    with torch.no_grad():
        torch.testing.assert_close(m(x)[:, -1], m(pairs_moved)[:, -1], rtol=0, atol=1e-6)
        flipped = torch.cat([x[:, :-1].flip(1), x[:, -1:]], 1)
        assert (m(x)[:, -1] - m(flipped)[:, -1]).abs().max() > 1e-5


def test_previous_token_keys_add_the_projection_of_the_byte_before():
    m = model("rope")
    wk = m.blocks[0].attn.wk
    x = torch.randn(2, 6, SMALL["dim"])
    with torch.no_grad():
        expected = wk.current(x)
        expected[:, 1:] += wk.previous(x[:, :-1])
        torch.testing.assert_close(wk(x), expected)


@pytest.mark.parametrize("variant", ["sinusoidal", "rope"])
def test_position_aware_variants_see_the_order_of_the_prefix(variant):
    x = tokens()
    y = x.clone()
    y[:, :-1] = x[:, :-1].flip(1)
    m = model(variant, n_layers=1)
    with torch.no_grad():
        # Attention is nearly uniform at initialisation, so the effect is small, but 100x the float noise.
        assert (m(x)[:, -1] - m(y)[:, -1]).abs().max() > 1e-5


def test_variants_start_from_the_same_weights():
    states = [model(v).state_dict() for v in ("nope", "sinusoidal", "rope")]
    assert states[0].keys() == states[1].keys() == states[2].keys()
    assert all(torch.equal(states[0][k], s[k]) for s in states[1:] for k in states[0])


def test_swapping_in_an_identical_rope_keeps_the_logits():
    x = tokens()
    m = model("rope")
    with torch.no_grad():
        before = m(x)
        m.set_rope(RopeConfig(16, 10000.0))
        torch.testing.assert_close(m(x), before)
        m.set_rope(RopeConfig(16, 500.0))
        assert (m(x) - before).abs().max() > 1e-4


def test_need_weights_returns_causal_probabilities_per_layer():
    m = model("rope")
    with torch.no_grad():
        logits, maps = m(tokens(10), need_weights=True)
    assert logits.shape == (2, 10, 256) and len(maps) == 2
    assert maps[0].shape == (2, 2, 10, 10)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 2, 10))
    assert maps[0].triu(1).abs().max() == 0


def test_bad_configs_and_swaps_raise():
    with pytest.raises(ValueError, match="variant"):
        ModelConfig(variant="alibi")
    with pytest.raises(ValueError, match="dim"):
        ModelConfig(dim=30, n_heads=4)
    with pytest.raises(ValueError, match="rope_config"):
        model("nope").set_rope(RopeConfig(16))
    with pytest.raises(ValueError, match="head_dim"):
        model("rope").set_rope(RopeConfig(32))


def test_sinusoidal_encoding_enters_at_the_initial_embeddings_size():
    # At its own unit amplitude the encoding outweighed the embeddings 3 to 1 and retrieval was never learnt
    # (docs/demo.md); the model adds it at the size of the scaled embeddings instead.
    m = ByteTransformer(ModelConfig(variant="sinusoidal", dim=128, n_layers=1, n_heads=4))
    x = torch.arange(256)[None]  # every byte once
    with torch.no_grad():
        embedded = m.embed(x) * m.embed_scale  # (1, 256, 128)
        added = m.sinusoidal(torch.zeros_like(embedded)) * m.position_scale
    rms = lambda t: float(t.pow(2).mean().sqrt())  # noqa: E731
    assert rms(added) == pytest.approx(rms(embedded), rel=0.1)
    assert rms(added) == pytest.approx(0.02 * 128**0.5, rel=0.01)
    with torch.no_grad():
        first_block_input = embedded + added
        torch.testing.assert_close(m.blocks[0].attn_norm(first_block_input), _block_input(m, x))


def _block_input(m: ByteTransformer, x: torch.Tensor) -> torch.Tensor:
    """What the first block's attention norm sees in the model's own forward pass."""
    seen = []
    handle = m.blocks[0].attn_norm.register_forward_hook(lambda _mod, _inp, out: seen.append(out))
    with torch.no_grad():
        m(x)
    handle.remove()
    return seen[0]
