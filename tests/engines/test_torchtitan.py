"""torchtitan 0.3 with ropekit's override: the real engine, its real configs, modules and parallelism.

Runs in the engines environment only (``make proofs``): ``--override.imports`` is applied to torchtitan's
llama3 and qwen3 debug configs exactly as its trainer does (``apply_overrides``), the replaced modules are
compared with torchtitan's own ``ComplexRoPE`` / ``CosSinRoPE`` (outputs and q / k gradients), on one process
and on 2 gloo processes with tensor parallel (heads sharded) and context parallel (torchtitan's head-tail load
balancer), and the llama3 debug model's logits with and without the override.

The stock modules build their tables in float32 (angles ``float32(position) * float32(inv_freq)``) and
ropekit in float64, so the two differ by the stock angle's rounding, about position * 2^-24 radians; at the
positions used here (< 256) that is below float32's tolerance for the outputs, and where the positions are
large, ropekit's rotation is the one closer to the float64 truth (test_far_positions_...).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.config.override import OverrideConfig, apply_overrides
from torchtitan.models.common.rope import ComplexRoPE, CosSinRoPE, RoPE
from torchtitan.models.llama3 import model_registry as llama3_registry
from torchtitan.models.qwen3 import model_registry as qwen3_registry

from gloo_ranks import run_ranks
from ropekit.integrations.torchtitan import (
    RopekitComplexRoPE,
    RopekitCosSinRoPE,
    TorchtitanRopeError,
    context_length,
    rope,
)

pytestmark = pytest.mark.engine

OVERRIDE = "ropekit.integrations.torchtitan.rope"
BATCH, SEQ, HEADS, KV_HEADS, DIM, MAX_SEQ = 2, 16, 4, 2, 32, 256
SCALINGS = {
    "none": {"scaling": "none"},
    "llama": {"scaling": "llama", "scaling_factor": 8.0, "original_max_position_embeddings": 64},
    "yarn truncate": {"scaling": "yarn", "rope_factor": 4.0, "original_seq_len": 64, "truncate": True},
    "yarn no truncate": {"scaling": "yarn", "rope_factor": 4.0, "original_seq_len": 64, "truncate": False},
}
STOCK = {"ComplexRoPE": ComplexRoPE, "CosSinRoPE": CosSinRoPE}
OURS = {"ComplexRoPE": RopekitComplexRoPE, "CosSinRoPE": RopekitCosSinRoPE}
# Outputs of magnitude ~4 rotated by angles that differ by up to MAX_SEQ * 2^-24 rad (the stock float32
# angle), plus float32 rounding of the rotation itself.
ATOL, RTOL = 4 * MAX_SEQ * 2.0**-24 + 1e-5, 1.3e-6


def overridden(config):
    """A copy of a model config with ropekit's override applied, as torchtitan's trainer applies it."""
    config = copy.deepcopy(config)
    lines = apply_overrides(OverrideConfig(imports=[OVERRIDE]), config)
    return config, lines


def config_of(kind: str, scaling: str):
    return STOCK[kind].Config(dim=DIM, max_seq_len=MAX_SEQ, theta=10000.0, **SCALINGS[scaling])


def pair(kind: str, scaling: str):
    """A stock module and ropekit's, built from the same torchtitan config through the override."""
    config = config_of(kind, scaling)
    return config.build(), rope(config).build()


def run_both(stock, ours, q, k, positions, grads):
    """Both modules' outputs and q / k gradients for the same inputs and incoming gradients."""
    results = []
    for module in (stock, ours):
        q_in, k_in = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        out = module(q_in, k_in, positions)
        torch.autograd.backward(out, grads)
        results.append(tuple(t.detach() for t in (*out, q_in.grad, k_in.grad)))
    return results


def positions_of(form: str):
    generator = torch.Generator().manual_seed(2)
    if form == "None":
        return None
    if form == "(1, S)":
        return torch.randperm(MAX_SEQ, generator=generator)[:SEQ][None]
    return torch.randint(0, MAX_SEQ, (BATCH, SEQ), generator=generator)


@pytest.mark.parametrize("registry", [llama3_registry, qwen3_registry], ids=["llama3", "qwen3"])
def test_override_builds_ropekits_module_at_every_rope_node(registry):
    config = registry("debugmodel", attn_backend="flex").model
    stock_kinds = {type(c) for _, c, _, _ in config.traverse(RoPE.Config)}
    ours, lines = overridden(config)
    with torch.device("meta"):
        model = ours.build()
    ropes = [m for m in model.modules() if isinstance(m, RoPE)]
    assert len(ropes) == len(config.layers) == len(lines)
    expected = {RopekitComplexRoPE if ComplexRoPE.Config in stock_kinds else RopekitCosSinRoPE}
    assert {type(m) for m in ropes} == expected
    assert all(OVERRIDE in line for line in lines)


# Every scaling option of each class; torchtitan's CosSinRoPE refuses llama scaling (the next test).
KINDS_AND_SCALINGS = [(kind, s) for kind in STOCK for s in SCALINGS if (kind, s) != ("CosSinRoPE", "llama")]


@pytest.mark.parametrize("form", ["None", "(1, S)", "(B, S)"])
@pytest.mark.parametrize(("kind", "scaling"), KINDS_AND_SCALINGS)
def test_outputs_and_gradients_equal_the_stock_module(kind, scaling, form):
    torch.manual_seed(0)
    stock, ours = pair(kind, scaling)
    q, k = torch.randn(BATCH, SEQ, HEADS, DIM), torch.randn(BATCH, SEQ, KV_HEADS, DIM)
    grads = (torch.randn_like(q), torch.randn_like(k))
    want, got = run_both(stock, ours, q, k, positions_of(form), grads)
    for name, w, g in zip(("q_out", "k_out", "q.grad", "k.grad"), want, got, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL, msg=name)
    assert not torch.equal(got[0], q)  # it rotated


@pytest.mark.parametrize("kind", list(STOCK))
@pytest.mark.parametrize("form", ["(B, S, H, D)", "(T, H, D)"])
def test_positions_past_the_cache_raise_what_torchtitan_raises_and_what_ropekit_raises(kind, form):
    """torchtitan's contract (its own RoPE tests: ``assertRaises(RuntimeError)`` for positions past the
    cache) holds inside torchtitan, and ropekit's (a ValueError naming positions) for ropekit's callers."""
    stock, ours = pair(kind, "none")
    shape = (1, 4, HEADS, DIM) if form == "(B, S, H, D)" else (4, HEADS, DIM)
    q = k = torch.randn(shape)
    positions = torch.tensor([0, 1, MAX_SEQ, MAX_SEQ + 1])
    positions = positions[None] if form == "(B, S, H, D)" else positions
    if form == "(B, S, H, D)":
        with pytest.raises(RuntimeError):  # the stock module, as torchtitan's own test asks
            stock(q, k, positions)
    with pytest.raises(RuntimeError) as raised:
        ours(q, k, positions)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, TorchtitanRopeError)
    assert "positions" in str(raised.value) and str(MAX_SEQ) in str(raised.value)
    packed = torch.randn(4, HEADS, DIM)
    for bad in (torch.arange(4)[None].expand(2, 4), torch.arange(4)[None], torch.arange(3)):  # (tokens,) only
        with pytest.raises(
            TorchtitanRopeError, match=r"^positions: expected \(4,\) \(one per token of the packed"
        ):
            ours(packed, packed, bad)
    with pytest.raises(TorchtitanRopeError, match=r"^key: expected \(tokens, heads, dim\) like query"):
        ours(packed, packed[None], None)


@pytest.mark.parametrize("kind", list(STOCK))
@pytest.mark.parametrize("form", ["None", "(T,)"])
def test_packed_tokens_heads_dim_form_is_the_batch_of_one(kind, form):
    """torchtitan's main branch after 0.3 passes q and k packed, (tokens, heads, dim), with positions
    (tokens,): the rotation of the batch of one that 0.3's stock module computes, gradients included."""
    torch.manual_seed(1)
    stock, ours = pair(kind, "yarn truncate")
    q, k = torch.randn(SEQ, HEADS, DIM), torch.randn(SEQ, KV_HEADS, DIM)
    grads = (torch.randn_like(q), torch.randn_like(k))
    positions = None if form == "None" else torch.randint(0, MAX_SEQ, (SEQ,))
    q_in, k_in = q.clone().requires_grad_(), k.clone().requires_grad_()
    got = ours(q_in, k_in, positions)
    torch.autograd.backward(got, grads)
    q4, k4 = q[None].clone().requires_grad_(), k[None].clone().requires_grad_()
    want = stock(q4, k4, None if positions is None else positions[None])
    torch.autograd.backward(want, tuple(g[None] for g in grads))
    assert got[0].shape == q.shape and got[1].shape == k.shape
    pairs = zip((*got, q_in.grad, k_in.grad), (want[0][0], want[1][0], q4.grad[0], k4.grad[0]), strict=True)
    for g, w in pairs:
        torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_the_cache_length_is_read_from_either_field_name():
    """0.3's ``max_seq_len`` and its main branch's ``max_context_length``."""
    assert context_length(config_of("ComplexRoPE", "none")) == MAX_SEQ

    class Renamed:
        max_context_length = 48

    assert context_length(Renamed()) == 48
    with pytest.raises(ValueError, match="max_context_length"):
        context_length(object())


def test_cos_sin_rope_with_llama_scaling_is_the_complex_ropes_rotation_in_halves():
    """The one option ropekit adds: CosSinRoPE + llama, which torchtitan refuses, is ComplexRoPE's llama
    rotation with the features in GPT-NeoX order (pair i = features (i, i + D/2) instead of (2i, 2i + 1))."""
    torch.manual_seed(0)
    complex_stock, _ = pair("ComplexRoPE", "llama")
    halves = rope(config_of("CosSinRoPE", "llama")).build()
    with pytest.raises(NotImplementedError):  # what ropekit adds: torchtitan's own module refuses it
        config_of("CosSinRoPE", "llama").build()
    q, k = torch.randn(BATCH, SEQ, HEADS, DIM), torch.randn(BATCH, SEQ, KV_HEADS, DIM)
    to_halves = torch.cat([torch.arange(0, DIM, 2), torch.arange(1, DIM, 2)])  # adjacent -> halves order
    positions = positions_of("(B, S)")
    want = complex_stock(q, k, positions)
    got = halves(q[..., to_halves], k[..., to_halves], positions)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w[..., to_halves], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", list(STOCK))
def test_far_positions_are_rotated_closer_to_the_float64_truth_than_the_stock_module(kind):
    config = STOCK[kind].Config(dim=DIM, max_seq_len=131072, theta=500000.0)  # llama3 debug's table length
    stock, ours = config.build(), rope(config).build()
    positions = torch.arange(131072 - SEQ, 131072)[None]
    q, k = torch.randn(1, SEQ, HEADS, DIM, dtype=torch.float64), torch.randn(1, SEQ, KV_HEADS, DIM)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))
    angles = positions[0, :, None].double() * inv_freq  # (S, D/2) in float64
    x = q.view(1, SEQ, HEADS, DIM // 2, 2) if kind == "ComplexRoPE" else q.view(1, SEQ, HEADS, 2, DIM // 2)
    a, b = (x[..., 0], x[..., 1]) if kind == "ComplexRoPE" else (x[..., 0, :], x[..., 1, :])
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    truth = torch.stack((ra, rb), -1).flatten(3) if kind == "ComplexRoPE" else torch.cat((ra, rb), -1)
    errors = []
    for module in (stock, ours):
        out = module(q.float(), k, positions)[0]
        errors.append((out.double() - truth).abs().max().item())
    stock_error, ropekit_error = errors
    assert ropekit_error < 1e-5 < stock_error / 10  # float32 rounding vs a float32 angle of 131056 rad


@pytest.mark.parametrize("kind", list(STOCK))
def test_the_module_compiles_in_one_graph_and_matches_eager(kind):
    """torchtitan compiles its blocks: ropekit's module traces without a graph break (fullgraph)."""
    _, ours = pair(kind, "yarn truncate")
    torch.manual_seed(0)
    q, k = torch.randn(BATCH, SEQ, HEADS, DIM), torch.randn(BATCH, SEQ, KV_HEADS, DIM)
    grads = (torch.randn_like(q), torch.randn_like(k))
    positions = positions_of("(B, S)")
    want, got = run_both(ours, torch.compile(ours, fullgraph=True), q, k, positions, grads)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1.3e-6)


def test_llama3_debug_model_logits_are_unchanged_by_the_override():
    """The whole model, forward only (its CPU attention backends have no backward)."""
    config = llama3_registry("debugmodel", attn_backend="flex").model
    ours_config, _ = overridden(config)
    torch.manual_seed(0)
    stock = config.build()
    stock.init_states(buffer_device=torch.device("cpu"))
    ours = ours_config.build()
    ours.init_states(buffer_device=torch.device("cpu"))  # the RoPE cache: a buffer outside the state dict
    ours.load_state_dict(stock.state_dict())
    tokens = torch.randint(0, 2048, (BATCH, 32), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(32)[None].expand(BATCH, 32)
    with torch.no_grad():
        masks = stock.get_attention_masks(positions=positions)
        want = stock(tokens, positions=positions, attention_masks=masks)
        got = ours(tokens, positions=positions, attention_masks=masks)
    assert any(isinstance(m, RopekitComplexRoPE) for m in ours.modules())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)


# -- 2 gloo processes: tensor parallel (heads) and context parallel (head-tail load balancer) ------------


def cache_on(mesh, modules):
    """The modules with their caches replicated on the mesh, as torchtitan's parallelization declares them
    (``state_shardings={"cache": ...}``): the stock modules need a DTensor cache beside DTensor inputs."""
    for module in modules:
        module.cache = DTensor.from_local(module.cache, mesh, [Replicate()])
    return modules


def parallel_worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.context_parallel import cp_shard

    torch.manual_seed(0)
    q, k = torch.randn(BATCH, SEQ, HEADS, DIM), torch.randn(BATCH, SEQ, KV_HEADS, DIM)
    grads = (torch.randn_like(q), torch.randn_like(k))
    positions = positions_of("(B, S)")
    results = {}
    for kind in STOCK:
        # Tensor parallel: q, k and their gradients sharded on heads; positions plain (every rank's rows).
        tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        stock, ours = cache_on(tp, pair(kind, "yarn truncate"))
        shard = [Shard(2)]
        dq, dk = (DTensor.from_local(t.chunk(2, dim=2)[rank], tp, shard) for t in (q, k))
        dgrads = tuple(DTensor.from_local(g.chunk(2, dim=2)[rank], tp, shard) for g in grads)
        for form in ("(B, S)", "(1, S)", "None"):
            pos = positions if form == "(B, S)" else positions[:1] if form == "(1, S)" else None
            want, got = run_both(stock, ours, dq, dk, pos, dgrads)
            results[("tp", kind, form)] = {
                "placements": [tuple(t.placements) for t in got],
                "got": [t.to_local() for t in got],
                "want": [t.to_local() for t in want],
            }
        # Context parallel: torchtitan's head-tail balancer shards q, k, positions and gradients along the
        # sequence (rank r holds chunks r and 3 - r); the modules see this rank's tokens and their positions.
        cp = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        (lq, lk, lpos, lgq, lgk), _ = cp_shard(cp, (q, k, positions, *grads), None, "headtail")
        stock, ours = pair(kind, "yarn truncate")
        results[("cp", kind, "plain")] = dict(
            zip(("want", "got"), run_both(stock, ours, lq, lk, lpos, (lgq, lgk)), strict=True)
        )
        # The same shards as DTensors placed Shard(1) on the cp mesh, positions plain (local) as torchtitan
        # passes them.
        dq, dk, dgq, dgk = (DTensor.from_local(t, cp, [Shard(1)]) for t in (lq, lk, lgq, lgk))
        want, got = run_both(*cache_on(cp, pair(kind, "yarn truncate")), dq, dk, lpos, (dgq, dgk))
        results[("cp", kind, "dtensor")] = {
            "placements": [tuple(t.placements) for t in got],
            "got": [t.to_local() for t in got],
            "want": [t.to_local() for t in want],
        }
        # The single-process rotation, sharded by the same balancer: what each rank must hold.
        full = run_both(stock, ours, q, k, positions, grads)[1]
        results[("cp", kind, "one process")], _ = cp_shard(cp, tuple(full), None, "headtail")
    # A cache sharded across the ranks: refused, never gathered.
    _, ours = pair("CosSinRoPE", "none")
    ours.cache = DTensor.from_local(ours.cache.chunk(2)[rank], tp, [Shard(0)])
    try:
        ours(dq, dk, None)
        results["sharded cache"] = "no error"
    except ValueError as e:
        results["sharded cache"] = f"ValueError: {e}"
    return results


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    return run_ranks(parallel_worker, tmp_path_factory.mktemp("torchtitan"))


@pytest.mark.parametrize("form", ["(B, S)", "(1, S)", "None"])
@pytest.mark.parametrize("kind", list(STOCK))
def test_tensor_parallel_heads_equal_the_stock_module_and_keep_placements(parallel, kind, form):
    for result in parallel:
        case = result[("tp", kind, form)]
        assert case["placements"] == [(Shard(2),)] * 4  # q_out, k_out, q.grad, k.grad
        for w, g in zip(case["want"], case["got"], strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", list(STOCK))
def test_context_parallel_head_tail_shards_equal_the_stock_module_and_one_process(parallel, kind):
    for result in parallel:
        plain, dtensor = result[("cp", kind, "plain")], result[("cp", kind, "dtensor")]
        assert dtensor["placements"] == [(Shard(1),)] * 4
        for w, g, d, one in zip(
            plain["want"], plain["got"], dtensor["got"], result[("cp", kind, "one process")], strict=True
        ):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)  # ropekit vs stock on this rank's tokens
            torch.testing.assert_close(d, g, atol=0, rtol=0)  # DTensor or plain: the same local rotation
            torch.testing.assert_close(g, one, atol=0, rtol=0)  # the single-process result's shard
        for w, d in zip(dtensor["want"], dtensor["got"], strict=True):
            torch.testing.assert_close(d, w, atol=ATOL, rtol=RTOL)


def test_a_sharded_cache_is_refused_never_gathered(parallel):
    for result in parallel:
        assert result["sharded cache"].startswith("ValueError: cache: expected a replicated RoPE cache")
