"""DTensor rules: ropekit's ops on DTensors over 2 gloo processes equal 1 process, with no collective.

The 2 processes are spawned once for the whole file (a module fixture) and compute every case; each test then
checks one property of what they found. The reference is the same call on the plain (global) tensors in one
process; CommDebugMode counts the collectives each DTensor call ran.
"""

import pytest
import torch

import ropekit
from gloo_ranks import run_ranks
from ropekit import dtensor_inputs

# A DTensor on CPU rotates through the C loop's registered op (the torch backend has none).
pytestmark = pytest.mark.c_compiler

WORLD = 2
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, TABLE = 2, 8, 4, 2, 16, 64
SHARDINGS = {"heads": 2, "tokens": 1, "batch": 0}  # the Shard dim of q (batch, seq, heads, head_dim)
POSITION_FORMS = ("offset", "global tensor", "dtensor")


def make_inputs():
    torch.manual_seed(0)
    cos, sin = ropekit.RopeConfig(HEAD_DIM, 100.0).cos_sin(TABLE)  # a small base: rows differ a lot
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM)
    k = torch.randn(BATCH, SEQ, KV_HEADS, HEAD_DIM)
    positions = torch.randperm(TABLE)[: BATCH * SEQ].view(BATCH, SEQ)  # every token its own row
    return q, k, cos, sin, positions


def _error(call) -> str:
    try:
        call()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def worker(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (WORLD,))
    q, k, cos, sin, positions = make_inputs()
    replicated = [Replicate()]
    results = {}

    # Before the rules are registered, a DTensor is refused with the import that fixes it.
    registered = set(dtensor_inputs.SHARDED_OPS)
    dtensor_inputs.SHARDED_OPS.clear()
    dq = distribute_tensor(q, mesh, [Shard(2)])
    results["no rules"] = _error(lambda: ropekit.apply_rotary(dq, cos, sin))
    dtensor_inputs.SHARDED_OPS.update(registered)
    from ropekit.integrations import dtensor  # noqa: F401  (registers the rules)

    for sharding, dim in SHARDINGS.items():
        placements = [Shard(dim)]
        for form in POSITION_FORMS:
            for inplace in (False, True):
                kwargs = {"offsets": 3} if form == "offset" else {"positions": positions}
                want = ropekit.apply_rotary_qk(q, k, cos, sin, **kwargs)
                dq, dk = (distribute_tensor(t, mesh, placements) for t in (q, k))
                if form == "dtensor":
                    alongside = [Replicate()] if sharding == "heads" else placements
                    kwargs = {"positions": distribute_tensor(positions, mesh, alongside)}
                with CommDebugMode() as comms:
                    got = ropekit.apply_rotary_qk(dq, dk, cos, sin, inplace=inplace, **kwargs)
                results[(sharding, form, inplace)] = {
                    "comms": comms.get_total_counts(),
                    "placements": [tuple(t.placements) for t in got],
                    "inputs written": inplace and got[0] is dq,
                    "got": [t.full_tensor() for t in got],
                    "want": want,
                }

    # Gradients: the rotation's backward on the shards, whatever placement the incoming gradient has.
    generator = torch.Generator().manual_seed(1)
    grad_q, grad_k = torch.randn(q.shape, generator=generator), torch.randn(k.shape, generator=generator)
    for sharding, dim in SHARDINGS.items():
        dq, dk = (distribute_tensor(t, mesh, [Shard(dim)]).requires_grad_() for t in (q, k))
        out_q, out_k = ropekit.apply_rotary_qk(dq, dk, cos, sin, positions=positions)
        incoming = (
            distribute_tensor(grad_q, mesh, [Shard(dim)]),
            distribute_tensor(grad_k, mesh, replicated),
        )
        with CommDebugMode() as comms:
            torch.autograd.backward((out_q, out_k), incoming)
        plain_q, plain_k = q.clone().requires_grad_(), k.clone().requires_grad_()
        ref_q, ref_k = ropekit.apply_rotary_qk(plain_q, plain_k, cos, sin, positions=positions)
        torch.autograd.backward((ref_q, ref_k), (grad_q, grad_k))
        results[("grad", sharding)] = {
            "comms": comms.get_total_counts(),
            "placements": (tuple(dq.grad.placements), tuple(dk.grad.placements)),
            "got": (dq.grad.full_tensor(), dk.grad.full_tensor()),
            "want": (plain_q.grad, plain_k.grad),
        }

    # RotaryEmbedding (its own tables, grown to the largest position) on tokens-sharded DTensors.
    module = ropekit.RotaryEmbedding(head_dim=HEAD_DIM, base=100.0)
    dq, dk = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
    with CommDebugMode() as comms:
        got = module(dq, dk, positions=positions)
    results["module"] = {
        "comms": comms.get_total_counts(),
        "got": [t.full_tensor() for t in got],
        "want": module(q, k, positions=positions),
    }

    # The registered op itself, every tensor a DTensor.
    op_ = torch.ops.ropekit.cpu_rotary_
    dcos, dsin = (distribute_tensor(t, mesh, replicated) for t in (cos, sin))
    dq, dk = (distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k))
    dpos = distribute_tensor(positions, mesh, [Shard(1)])
    with CommDebugMode() as comms:
        op_(dq, dk, dcos, dsin, dpos, False, False, 0)
    results["op"] = {
        "comms": comms.get_total_counts(),
        "got": (dq.full_tensor(), dk.full_tensor()),
        "want": ropekit.apply_rotary_qk(q, k, cos, sin, positions=positions),
    }

    # Placements a shard cannot rotate locally: each refused, naming the argument.
    def shard(t, dim):
        return distribute_tensor(t, mesh, [Shard(dim)])

    results["errors"] = {
        "head_dim sharded": _error(lambda: ropekit.apply_rotary_qk(shard(q, 3), shard(k, 3), cos, sin)),
        "sharded table": _error(
            lambda: ropekit.apply_rotary(shard(q, 2), shard(cos, 0), distribute_tensor(sin, mesh, replicated))
        ),
        "positions not alongside": _error(
            lambda: ropekit.apply_rotary(
                shard(q, 1), cos, sin, positions=distribute_tensor(positions, mesh, replicated)
            )
        ),
        "k placed otherwise": _error(lambda: ropekit.apply_rotary_qk(shard(q, 1), shard(k, 2), cos, sin)),
        "float64 (torch backend)": _error(lambda: ropekit.apply_rotary(shard(q.double(), 2), cos, sin)),
        "op: tokens sharded, no positions": _error(
            lambda: op_(shard(q, 1), None, dcos, dsin, None, False, False, 0)
        ),
        "op: out of place": _error(
            lambda: torch.ops.ropekit.cpu_rotary(shard(q, 2), None, dcos, dsin, None, False, False, 0)
        ),
    }
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(worker, tmp_path_factory.mktemp("dtensor"))


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("form", POSITION_FORMS)
@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_sharded_rotation_equals_one_process_without_a_collective(ranks, sharding, form, inplace):
    for result in ranks:
        case = result[(sharding, form, inplace)]
        assert case["comms"] == 0
        for got, want in zip(case["got"], case["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same kernel on the same rows
        assert case["placements"] == [(torch.distributed.tensor.Shard(SHARDINGS[sharding]),)] * 2
        assert case["inputs written"] == inplace


@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_gradients_are_rotated_on_the_shards(ranks, sharding):
    for result in ranks:
        case = result[("grad", sharding)]
        # No data moved: k's replicated gradient is re-sharded like k by slicing, locally.
        assert case["comms"] == 0
        shard = (torch.distributed.tensor.Shard(SHARDINGS[sharding]),)
        assert case["placements"] == (shard, shard)
        for got, want in zip(case["got"], case["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("caller", ["op", "module"])
def test_the_registered_op_and_rotary_embedding_rotate_dtensors_locally(ranks, caller):
    for result in ranks:
        case = result[caller]
        assert case["comms"] == 0
        for got, want in zip(case["got"], case["want"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_dtensor_before_the_rules_are_imported_names_the_import(ranks):
    assert "import ropekit.integrations.dtensor" in ranks[0]["no rules"]
    assert ranks[0]["no rules"].startswith("ValueError")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("head_dim sharded", "ValueError: q: .*placements \\(Shard\\(dim=3\\),\\)"),
        ("sharded table", "ValueError: cos: expected a replicated cos/sin table"),
        ("positions not alongside", "ValueError: positions: expected placements \\(Shard\\(dim=1\\),\\)"),
        ("k placed otherwise", "ValueError: k: expected q's placements"),
        (
            "float64 (torch backend)",
            "ValueError: backend: a DTensor q is rotated through ropekit's registered",
        ),
        ("op: tokens sharded, no positions", "positions: ropekit::cpu_rotary_ got q sharded on tokens"),
        ("op: out of place", "q: ropekit::cpu_rotary returns a list \\(Tensor\\[\\]\\)"),
    ],
)
def test_placements_a_shard_cannot_rotate_locally_are_refused_by_name(ranks, case, message):
    import re

    for result in ranks:
        assert re.search(message, result["errors"][case]), result["errors"][case]
