"""ropekit.integrations.hf_probe: each model convention is recognised, reproduced, and nothing else is.

The rotation functions here are written from the conventions the module docstring lists (Su et al. 2021's
rotation, with the pairings of GPT-NeoX, GPT-J, Cohere, DeepSeek-V3 and Llama 4's complex form); tables are
built from the float64 reference frequencies.
"""

import pytest
import torch

from ropekit.integrations import hf_probe
from ropekit.integrations.hf_probe import Call, Convention, Signature, find_convention, stand_in

B, H, S, D = 2, 3, 7, 16


def angles(rotary_dim=D):
    inv = 1.0 / 500.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return (torch.arange(S, dtype=torch.float64)[:, None] * inv).float().expand(B, S, rotary_dim // 2)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def neox(q, k, cos, sin, unsqueeze_dim=1):  # Llama / GPT-NeoX: cat(freqs, freqs) tables, partial by width
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    r = cos.shape[-1]
    return tuple(
        torch.cat((x[..., :r] * cos + rotate_half(x[..., :r]) * sin, x[..., r:]), -1) for x in (q, k)
    )


def cohere(q, k, cos, sin, unsqueeze_dim=1):  # repeat_interleave tables, (2i, 2i+1) pairs
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(x * cos + rotate_every_two(x) * sin for x in (q, k))


def gptj(tensor, sin, cos):  # one angle per pair, (B, S, H, D) layout, sin before cos
    sin = sin[:, :, None, :].repeat_interleave(2, -1)
    cos = cos[:, :, None, :].repeat_interleave(2, -1)
    return tensor * cos + rotate_every_two(tensor) * sin


def deepseek_interleave(
    q, k, cos, sin, position_ids=None, unsqueeze_dim=1
):  # (2i, 2i+1) in, [evens, odds] out
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    return tuple(
        torch.cat((x[..., ::2] * cos - x[..., 1::2] * sin, x[..., 1::2] * cos + x[..., ::2] * sin), -1)
        for x in (q, k)
    )


def nanochat(q, k, cos, sin, unsqueeze_dim=1):  # rotate_half with the other sign: rotation by -angle
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple(x * cos - rotate_half(x) * sin for x in (q, k))


def llama4(xq, xk, freqs_cis):  # complex, (B, S, H, D)
    out = []
    for x in (xq, xk):
        z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        out.append(torch.view_as_real(z * freqs_cis[:, :, None, :]).flatten(3).type_as(x))
    return tuple(out)


def tables(kind, rotary_dim=D, dtype=torch.float32):
    a = angles(rotary_dim)
    if kind == "first_half":
        a = torch.cat((a, a), -1)
    elif kind == "every_other":
        a = a.repeat_interleave(2, -1)
    if kind == "complex":
        return (torch.polar(torch.ones_like(a), a),)
    return a.cos().to(dtype), a.sin().to(dtype)


def record(fn, args):
    return Call(args, {}, fn(*args))


def qk(layout="bhsd", dtype=torch.float32):
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


CASES = [
    (neox, lambda: (*qk(), *tables("first_half")), Convention("first_half", "half", "bhsd")),
    (neox, lambda: (*qk(), *tables("first_half", rotary_dim=8)), Convention("first_half", "half", "bhsd")),
    (cohere, lambda: (*qk(), *tables("every_other")), Convention("every_other", "interleaved", "bhsd")),
    (gptj, lambda: (qk("bshd")[0], *reversed(tables("full"))), Convention("full", "interleaved", "bshd")),
    (
        deepseek_interleave,
        lambda: (*qk(), *tables("first_half")),
        Convention("first_half", "deinterleave", "bhsd"),
    ),
    (llama4, lambda: (*qk("bshd"), *tables("complex")), Convention("complex", "interleaved", "bshd")),
    (
        nanochat,
        lambda: (*qk(), *tables("first_half")),
        Convention("first_half", "half", "bhsd", conjugate=True),
    ),
]


@pytest.mark.parametrize(
    ("fn", "make", "want"), CASES, ids=[c[0].__name__ + str(i) for i, c in enumerate(CASES)]
)
def test_each_convention_is_recognised_and_reproduced(fn, make, want):
    torch.manual_seed(0)
    args = make()
    signature = Signature.of(fn)
    convention, diff, tol = find_convention(fn, signature, record(fn, args), "torch")
    assert convention == want
    assert diff <= tol
    rotate = stand_in(
        fn, signature, convention, {"__tuple__": isinstance(fn(*args), tuple), "position_ids": None}, "torch"
    )
    got, expected = rotate(*args), fn(*args)
    for g, e in zip(
        got if isinstance(got, tuple) else (got,),
        expected if isinstance(expected, tuple) else (expected,),
        strict=True,
    ):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def test_bf16_rotation_agrees_within_the_bf16_tolerance_and_a_wrong_table_does_not():
    torch.manual_seed(0)
    args = (*qk(dtype=torch.bfloat16), *tables("first_half", dtype=torch.bfloat16))
    convention, diff, tol = find_convention(neox, Signature.of(neox), record(neox, args), "torch")
    assert convention == Convention("first_half", "half", "bhsd") and 0 < tol < 0.15

    def shifted(q, k, cos, sin, unsqueeze_dim=1):  # positions off by one: a real error of one angle step
        return neox(q, k, cos.roll(1, dims=1), sin.roll(1, dims=1), unsqueeze_dim)

    convention, diff, tol = find_convention(shifted, Signature.of(shifted), record(shifted, args), "torch")
    assert convention is None and diff > 10 * tol


def test_stand_in_leaves_calls_it_was_not_proved_on_to_the_models_function():
    calls = []

    def model_fn(q, k, cos, sin, mode="rope", unsqueeze_dim=1):
        calls.append(mode)
        return neox(q, k, cos, sin, unsqueeze_dim)

    args = (*qk(), *tables("first_half"))
    signature = Signature.of(model_fn)
    convention, _, _ = find_convention(model_fn, signature, record(model_fn, args), "torch")
    calls.clear()
    rotate = stand_in(model_fn, signature, convention, {"mode": "rope", "__tuple__": True}, "torch")
    rotate(*args)
    assert calls == []  # proved arguments: ropekit alone
    rotate(*args, mode="other")
    assert calls == ["other"]  # an argument value the proof never saw: the model's own code


def test_signature_without_tensors_and_tables_is_not_understood():
    def odd(a, b, c):
        return a

    with pytest.raises(hf_probe.NotUnderstood, match="do not name tensors"):
        Signature.of(odd)


def test_rotation_functions_are_named_apply_rotary_or_apply_rope():
    assert hf_probe.rotation_function("apply_rotary_pos_emb", neox)
    assert hf_probe.rotation_function("x", llama4) is False
    assert hf_probe.rotation_function("apply_rotary_emb", llama4)
    assert not hf_probe.rotation_function("rotate_half", rotate_half)
    assert not hf_probe.rotation_function("apply_rotary_pos_emb", object())


def test_deepseek_v4_trailing_rope_slice_is_found_and_proved():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    x = torch.randn(2, 3, 5, 32)  # (B, H, S, D): [nope | rope], the trailing 8 features rotate
    angles = torch.arange(5.0)[:, None] * 0.3 ** torch.arange(4.0)  # (S, R/2): one angle per pair
    call = hf_probe.Call((x, angles.cos()[None], angles.sin()[None]), {}, None)
    signature = hf_probe.Signature.of(apply_rotary_pos_emb)
    convention, diff, tol = hf_probe.find_convention(apply_rotary_pos_emb, signature, call, "torch")
    assert convention is not None and diff <= tol
    assert (convention.rotary_position, convention.pairing, convention.table) == (
        "last",
        "interleaved",
        "full",
    )
    assert "trailing features" in convention.describe()


def optional_k(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    """Qwen4-exp's indexer form: k optional, q alone rotated and returned as a tensor when k is None."""
    out = neox(q, q if k is None else k, cos, sin, unsqueeze_dim)
    return out[0] if k is None else out


def test_a_function_called_with_q_alone_is_proved_on_q_and_its_other_forms_keep_the_model_code():
    torch.manual_seed(0)
    freqs = angles()
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()  # (B, S, D)
    q = torch.randn(B, S, H, D)
    call = Call((q,), {"cos": cos, "sin": sin, "unsqueeze_dim": 2}, None)
    signature = Signature.of(optional_k)
    convention, diff, tol = find_convention(optional_k, signature, call, "torch")
    assert convention is not None and diff <= tol
    recorded = {"__tuple__": False}
    rotate = stand_in(optional_k, signature, convention, recorded, "torch")
    torch.testing.assert_close(rotate(q, cos=cos, sin=sin, unsqueeze_dim=2), optional_k(q, None, cos, sin, 2))
    # a 3-D key with (G, D) tables, as the indexer's pooled keys: not a proved form, the model's code answers
    keys, rows = torch.randn(5, 1, D), cos[0, :5]
    assert torch.equal(rotate(keys, cos=rows, sin=sin[0, :5]), optional_k(keys, None, rows, sin[0, :5]))
