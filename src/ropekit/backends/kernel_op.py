"""Wrapping a raw RoPE kernel (Triton, or the compiled CPU loop) as a backend registered with torch.library.

A raw kernel writes through data pointers, which torch.compile cannot trace. Registering it as a pair of
custom ops (one out-of-place, one in-place) with shape-only fake implementations lets
``torch.compile(fullgraph=True)`` keep the call in its graph as one opaque node instead of breaking the graph.

The kernels themselves see a simplified contract (a :data:`Launch`): 4-D (batch, seq, heads, head_dim) views
whose last axis has stride 1, flat int64 positions or an int offset, and output tensors to write. Everything
else (packed 3-D input, a strided last axis, allocation) is handled here once for both kernels.

The kernel boundary is a wall (docs/safety.md): :func:`check_launch` checks, in every launcher, everything a
kernel relies on to stay inside its tensors (dtypes, shapes, strides, devices, no self-overlapping output),
and the kernels check every table row they read: the C loop on the host before it writes anything, the
Triton kernel on the device (a clamped row, and a trap that fails the launch: no host sync, no assert kernel).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ropekit.backends.base import served_numerics
from ropekit.backends.eager.rotary import rotate_qk as eager_rotate_qk
from ropekit.dtensor_inputs import SHARDED_OPS, check_no_dtensor, is_dtensor
from ropekit.positions import check_cu_seqlens, check_offsets_beside_positions
from ropekit.validation import check_in_place_allowed, check_no_alias, check_writable, describe

jit_tracing = torch._C._get_tracing_state  # torch.jit.trace's recorder: None unless it records

__all__ = [
    "MAX_HALF",
    "KernelBackend",
    "Launch",
    "check_device",
    "check_launch",
    "check_packed_rows",
    "jit_tracing",
    "kernel_tables",
    "plain_eager",
    "register_op",
    "row_error",
]

# launch(q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate): rotate q (and k if not
# None) into q_out (and k_out). q, k, q_out, k_out: (batch, seq, heads, head_dim), last stride 1; q_out may be
# q itself. positions: contiguous int64 (batch * seq,), or None for rows offset + arange(seq).
Launch = Callable[..., None]

# The widest table (rotary_dim / 2) the kernels serve: the C loop keeps ~10 floats per pair on its stack, so
# this bounds it to 160 KB; Triton keeps a row in registers. Wider tables use the torch backend.
MAX_HALF = 4096
# The widest head a channel of the fused kernels serves: the C loop keeps one head of float32 in a scratch row
# of this fixed size on its stack (64 KB). Wider heads take the torch backend.
MAX_WIDTH = 16384

_OUT_OF_PLACE = (
    "(Tensor q, Tensor? k, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
    "bool conjugate, SymInt offset=0) -> Tensor[]"
)
_IN_PLACE = (
    "(Tensor(a!) q, Tensor(b!)? k, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
    "bool conjugate, SymInt offset=0) -> ()"
)


def _fail(name: str, expected: str, got: str) -> None:
    raise ValueError(f"{name}: expected {expected}, got {got}")


def check_launch(q, k, q_out, k_out, cos, sin, positions, offset, dtypes) -> None:
    """Everything a raw kernel relies on to stay inside its tensors; ValueError naming the argument otherwise.

    Values (the table rows of positions) are not read here: each kernel checks them where they live. Written
    for a decode step's budget: a few attribute reads per tensor, no shape slicing.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in dtypes:
        _fail("q", f"a 4-D (batch, seq, heads, head_dim) tensor of {[str(d) for d in dtypes]}", describe(q))
    batch, seq, _, head_dim = q.shape
    device = q.device
    _check_pair("q", q, q_out, q, device)
    if k is not None or k_out is not None:
        _check_pair("k", k, k_out, q, device)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            _fail(name, "a 2-D float32 tensor (table_len, rotary_dim // 2)", describe(t))
        if t.device != device:
            _fail(name, f"a tensor on q's device {device}", f"one on {t.device}")
        if t.stride()[1] != 1 and t.shape[1] > 1:
            _fail(name, "a last axis of stride 1", f"strides {t.stride()}")
    table_len, half = cos.shape
    if sin.shape != cos.shape:
        _fail("sin", f"cos's shape {tuple(cos.shape)}", str(tuple(sin.shape)))
    if not 1 <= half <= MAX_HALF or 2 * half > head_dim:
        _fail("cos", f"1 <= rotary_dim // 2 <= min(head_dim // 2, {MAX_HALF})", f"width {half}")
    tokens = batch * seq
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64:
            _fail("positions", "an int64 tensor", describe(positions))
        if positions.numel() != tokens or not positions.is_contiguous() or positions.device != device:
            _fail(
                "positions",
                f"a contiguous tensor of {tokens} rows (batch * seq) on {device}",
                f"{describe(positions)} on {positions.device}",
            )
    elif type(offset) is not int or not 0 <= offset < 1 << 63:
        _fail("offset", "a non-negative int64 when positions is None", repr(offset))
    if tokens and table_len == 0:
        _fail("cos", "at least one row", "an empty table")
    _check_memory(q, k, q_out, k_out, cos, sin, positions)


def _check_memory(q, k, q_out, k_out, cos, sin, positions) -> None:
    """The memory rule (docs/safety.md): the outputs share memory with nothing the kernel reads, except an
    output that is its own input (in place: the same elements, perhaps through another view object)."""
    q_name = "q" if q_out.data_ptr() == q.data_ptr() else "q_out"
    k_name = "k" if k_out is not None and k_out.data_ptr() == k.data_ptr() else "k_out"
    check_no_alias(
        ((q_name, q_out), (k_name, k_out)),
        (("q", q), ("k", k), ("cos", cos), ("sin", sin), ("positions", positions)),
    )


def _check_pair(name: str, x, out, q: torch.Tensor, device: torch.device) -> None:
    """x (q or k) is read and out written: both 4-D like q, one dtype and device, last stride 1, and out
    without self-overlap."""
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        _fail(name, "a 4-D tensor (batch, seq, heads, head_dim)", describe(x))
    shape, q_shape = x.shape, q.shape
    if shape[0] != q_shape[0] or shape[1] != q_shape[1] or shape[3] != q_shape[3]:
        _fail(name, f"q's batch, seq and head_dim {tuple(q_shape)}", str(tuple(shape)))
    if x.dtype != q.dtype or x.device != device:
        _fail(name, f"q's dtype {q.dtype} on {device}", f"{x.dtype} on {x.device}")
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != shape
        or out.dtype != x.dtype
        or out.device != device
    ):
        _fail(f"{name}_out", f"a {x.dtype} tensor of shape {tuple(shape)} on {device}", describe(out))
    if shape[3] > 1 and (x.stride()[3] != 1 or out.stride()[3] != 1) and x.numel():  # empty: nothing read
        _fail(name, "a last axis of stride 1 (input and output)", f"strides {x.stride()} and {out.stride()}")
    check_writable(f"{name}_out", out)


def row_error(position: int, table_len: int, token: int | None = None) -> ValueError:
    """The error for a table row outside [0, table_len)."""
    where = "" if token is None else f" (token {token})"
    return ValueError(
        f"positions: position {position}{where} is outside the cos/sin table (table_len {table_len}); "
        f"expected 0 <= position < table_len"
    )


def check_offset_rows(offset: int, batch: int, seq: int, table_len: int) -> None:
    """Rows offset .. offset + seq - 1 must lie in the table (if there is a token): integer arithmetic."""
    if batch and seq and offset + seq > table_len:
        raise row_error(offset + seq - 1, table_len)


def check_packed_rows(cu_seqlens: torch.Tensor, offsets, tokens: int, table_len: int) -> None:
    """A packed batch's rows, on the host (CPU tensors: no sync): cu_seqlens (N + 1,) well formed (the
    message of :func:`ropekit.positions.check_cu_seqlens`), and every sequence's rows ``offset ..
    offset + length - 1`` (offsets an int, or an (N,) tensor: one per sequence) in the table."""
    cu = cu_seqlens.long()
    lengths = cu.diff()  # (N,)
    if isinstance(offsets, torch.Tensor):  # each sequence's last row + 1 (0: no rows), the lowest offset
        ends = torch.where(lengths > 0, lengths + offsets, 0)
        first, last, shortest, longest, top, lowest = torch.stack(
            (cu[0], cu[-1], lengths.min(), lengths.max(), ends.max(), offsets.min())
        ).tolist()
    else:  # an int offset: Python's integers (no int64 wrap-around)
        first, last, shortest, longest = torch.stack((cu[0], cu[-1], lengths.min(), lengths.max())).tolist()
        top, lowest = offsets + longest if longest > 0 else 0, offsets
    if first != 0 or last != tokens or shortest < 0:
        check_cu_seqlens(cu_seqlens, tokens)  # raises its message
    if lowest < 0 or top > table_len:
        raise row_error(lowest if lowest < 0 else top - 1, table_len)


def kernel_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin as the kernels read them: float32 rows of unit stride. A table of another dtype (bf16 rows
    from HF, float64), or the every-other-column view of an interleaved full-width table, is converted (per
    call); a row-sliced view is read in place."""
    if cos.dtype != torch.float32 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        return cos.float().contiguous(), sin.float().contiguous()
    return cos, sin


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(0) if x.dim() == 3 else x  # packed (T, H, D) -> (1, T, H, D)


def _check_op_inputs(q, k, positions) -> None:
    """The op's own shape contract, before the 4-D views: q and k (T, H, D) or (B, S, H, D) alike."""
    if not isinstance(q, torch.Tensor) or q.dim() not in (3, 4):
        _fail("q", "a (batch, seq, heads, head_dim) or (total_tokens, heads, head_dim) tensor", describe(q))
    if k is not None and (not isinstance(k, torch.Tensor) or k.dim() != q.dim()):
        _fail("k", f"a {q.dim()}-D tensor like q", describe(k))
    if k is not None and (k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]):
        axes = "batch, seq" if q.dim() == 4 else "tokens"
        _fail("k", f"q's {axes} and head_dim {tuple(q.shape)}", str(tuple(k.shape)))
    if positions is not None and (not isinstance(positions, torch.Tensor) or positions.shape != q.shape[:-2]):
        _fail("positions", f"a tensor of shape {tuple(q.shape[:-2])} (q's leading axes)", describe(positions))


def _check_op_values(q, k, positions, offset) -> None:
    """The op's shapes (:func:`_check_op_inputs`), then the values its public function checks that the
    kernel wall does not: an offset beside positions is refused (the kernel would drop it)."""
    _check_op_inputs(q, k, positions)
    if positions is not None:
        check_offsets_beside_positions(offset)


def check_device(backend, device: torch.device) -> None:
    """A registered op's backend can run on device (its ``device_reason``), in select_backend's words:
    Triton on CPU tensors without its interpreter raised Triton's own "0 active drivers"."""
    reason = getattr(backend, "device_reason", None)
    reason = None if reason is None else reason(device)
    if reason is not None:
        raise ValueError(f"backend: {backend.name!r} cannot serve these inputs: {reason}")


def _check_devices(q, k, cos, sin, positions) -> None:
    """Every tensor on q's device. The fake kernels need this: a meta tensor among CPU ones sends the
    dispatcher to them, and they would answer with uninitialised CPU memory (the real kernels' launchers
    check devices themselves)."""
    for name, t in (("k", k), ("cos", cos), ("sin", sin), ("positions", positions)):
        if isinstance(t, torch.Tensor) and t.device != q.device:
            _fail(name, f"a tensor on q's device {q.device}", f"one on {t.device}")


def _run(launch: Launch, q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate) -> None:
    """Call the kernel on 4-D views; outputs with a strided last axis are computed in a scratch copy."""
    pos = None if positions is None else positions.reshape(-1)  # (batch * seq,)
    if pos is not None and pos.dtype == torch.int64:
        pos = pos.contiguous()
    strided = [t is not None and t.stride()[-1] != 1 for t in (q, k, q_out, k_out)]
    if not any(strided):  # the usual case: the kernel reads and writes the tensors themselves
        k4, k_out4 = (None, None) if k is None else (_as_4d(k), _as_4d(k_out))
        launch(_as_4d(q), k4, _as_4d(q_out), k_out4, cos, sin, pos, offset, interleaved, conjugate)
        return
    if strided[2] or strided[3]:
        # The launcher checks the outputs it writes; a scratch copy would hide an overlapping output.
        for name, out in (("q", q_out), ("k", k_out)):
            if out is not None:
                check_writable(name, out)
        _check_memory(q, k, q_out, k_out, cos, sin, positions)
    dense = torch.contiguous_format
    scratch = [
        out if out is None or out.stride(-1) == 1 else torch.empty_like(out, memory_format=dense)
        for out in (q_out, k_out)
    ]
    inputs = [x if x is None or x.stride(-1) == 1 else x.contiguous() for x in (q, k)]
    launch(
        _as_4d(inputs[0]),
        None if k is None else _as_4d(inputs[1]),
        _as_4d(scratch[0]),
        None if k is None else _as_4d(scratch[1]),
        cos,
        sin,
        pos,
        offset,
        interleaved,
        conjugate,
    )
    for out, tmp in zip((q_out, k_out), scratch, strict=True):
        if out is not None and tmp is not out:
            out.copy_(tmp)


# name -> (direct out-of-place, direct in-place, op, in-place op): each op name is registered once.
_REGISTERED: dict[str, tuple] = {}
# qualified name ("ropekit::x") -> the op registered under it by register_op.
_OPS: dict[str, object] = {}


def register_op(
    name: str,
    impl: Callable,
    fake: Callable,
    *,
    mutates_args: tuple[str, ...],
    schema: str,
    guard: Callable[..., None] | None = None,
):
    """``torch.ops.ropekit.<name>``: impl as a custom op with a shape-only fake implementation, registered
    once per process (a second call returns the first op: registering again would replace it under a compiled
    graph that holds it). Every ropekit op is registered here: the rotary kernels' pairs and the serving
    fusions. The op is the public face of a raw kernel, so impl keeps the kernel wall: it checks what the
    kernel relies on, whatever the caller passed, and the value checks of its public function.

    What depends on the caller's grad mode runs before the op's autograd kernel, where that mode is still
    the caller's (inside impl it is always off): PyTorch's in-place refusals for every argument the op
    writes (:func:`~ropekit.validation.check_in_place_allowed`: a leaf that requires grad, a view of one, an
    inference tensor outside inference mode), then ``guard(*args)`` if given (the serving fusions: inference
    only). Nothing is written when either raises. The library's own calls skip the dispatcher (their public
    function checked all of it once)."""
    qualname = f"ropekit::{name}"
    op = _OPS.get(qualname)
    if op is None:
        op = torch.library.custom_op(qualname, impl, mutates_args=mutates_args, schema=schema)
        op.register_fake(fake)
        _guard_autograd(op, name, guard)
        _OPS[qualname] = op
    return op


_NO_RULE = (
    "call it with each rank's local tensors (t.to_local()), or rotate DTensors with ropekit.apply_rotary / "
    "apply_rotary_qk (ropekit.integrations.dtensor)"
)


def _guard_autograd(op, name: str, guard: Callable[..., None] | None) -> None:
    """Put the op's caller-grad-mode checks (see :func:`register_op`) in front of its autograd kernel."""
    from torch._library.autograd import make_autograd_impl  # the kernel custom_op registered, rebuilt

    arguments = op._opoverload._schema.arguments
    names = tuple(a.name for a in arguments)
    written = [(i, a.name) for i, a in enumerate(arguments) if a.is_write]
    autograd = make_autograd_impl(op._opoverload, op)

    def checked(keyset, *args, **kwargs):
        if name not in SHARDED_OPS:  # before DTensor's dispatch, which says "mixed torch.Tensor and DTensor"
            check_no_dtensor(f"torch.ops.ropekit.{name}", names[: len(args)], args, _NO_RULE)
        for i, arg_name in written:
            if i < len(args) and isinstance(args[i], torch.Tensor):
                check_in_place_allowed(arg_name, args[i])
        if guard is not None:
            guard(*args)
        return autograd(keyset, *args, **kwargs)

    with warnings.catch_warnings():  # it replaces the autograd kernel custom_op registered, on purpose
        warnings.filterwarnings("ignore", message="Warning only once for all operators", category=UserWarning)
        op._lib.impl(name, checked, "Autograd", with_keyset=True)


def plain_eager(x) -> bool:
    """Whether a call on x may skip the op dispatcher (tens of microseconds, most of a decode step) and call
    the op's implementation itself: a plain eager tensor, no trace (torch.compile, torch.jit.trace), no
    dispatch mode. Anything that traces goes through the registered op, which torch.compile keeps in its
    graph and torch.jit.trace records as a node (a kernel called through pointers is invisible to it: its
    graph would return the outputs unwritten)."""
    return (
        not torch.compiler.is_compiling()
        and type(x) is torch.Tensor
        and _get_current_dispatch_mode() is None
        and jit_tracing() is None
    )


def tell_autograd(written) -> None:
    """What the dispatcher does after an in-place op, for a kernel that wrote through pointers: bump the
    version counter of each written tensor (an inference tensor has none), so autograd sees the write."""
    live = [t for t in written if not t.is_inference()]
    if live:
        torch.autograd.graph.increment_version(live)


class KernelBackend:
    """A :class:`~ropekit.backends.base.Backend` around a raw kernel, callable under torch.compile.

    Subclasses set ``name`` and implement ``unavailable_reason``; ``launch`` is the raw kernel. The ops are
    ``torch.ops.ropekit.<name>_rotary`` (out of place, returns [q_out] or [q_out, k_out]) and
    ``torch.ops.ropekit.<name>_rotary_`` (in place), both
    ``(q, k, cos, sin, positions, interleaved, conjugate, offset=0)``.
    """

    name: str

    def __init__(self, name: str, launch: Launch) -> None:
        self.name = name
        self._launch = launch

        def rotary(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_values(q, k, positions, offset)
            check_device(self, q.device)
            q_out = torch.empty_like(q)
            k_out = None if k is None else torch.empty_like(k)
            _run(launch, q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate)
            return [q_out] if k is None else [q_out, k_out]

        def rotary_(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_values(q, k, positions, offset)
            check_device(self, q.device)
            _run(launch, q, k, q, k, cos, sin, positions, offset, interleaved, conjugate)

        def rotary_fake(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            _check_devices(q, k, cos, sin, positions)
            return [torch.empty_like(q)] + ([] if k is None else [torch.empty_like(k)])

        def rotary_fake_(q, k, cos, sin, positions, interleaved, conjugate, offset=0):
            _check_op_inputs(q, k, positions)
            _check_devices(q, k, cos, sin, positions)
            check_writable("q", q)
            if k is not None:
                check_writable("k", k)

        if name in _REGISTERED:
            # Registering the op names again would replace the ops under the first instance's feet (a
            # compiled graph holding them then fails): later instances share the first registration.
            self._rotary, self._rotary_, self.op, self.op_ = _REGISTERED[name]
            return
        self._rotary, self._rotary_ = rotary, rotary_
        self.op = register_op(f"{name}_rotary", rotary, rotary_fake, mutates_args=(), schema=_OUT_OF_PLACE)
        self.op_ = register_op(
            f"{name}_rotary_", rotary_, rotary_fake_, mutates_args=("q", "k"), schema=_IN_PLACE
        )
        _REGISTERED[name] = self._rotary, self._rotary_, self.op, self.op_

    def unavailable_reason(self, q: torch.Tensor, cos: torch.Tensor) -> str | None:
        raise NotImplementedError

    def device_reason(self, device: torch.device) -> str | None:
        """The part of :meth:`unavailable_reason` that depends on the device alone (a registered op names
        its backend, so only the device is left to refuse): None when the kernel can run there."""
        return None

    def kernels(self) -> tuple[Callable[..., None], Callable[..., None]]:
        """(the fused serving launcher, the QK-norm launcher) of this backend's kernel family."""
        raise NotImplementedError

    def fused_unavailable_reason(self, op: str, *, widest: int = 0, spec=None) -> str | None:
        """None when this backend's kernel runs ``op`` ("fused": RoPE + cache, RoPE + FP8, cache shift;
        "qk_norm") for heads of ``widest`` features, else the rest of the error ``backend: '<name>' ...``."""
        if op == "fused" and widest > MAX_WIDTH:
            return (
                f"serves heads of up to {MAX_WIDTH} features, got a head of {widest}; use backend='torch' "
                f"(or 'auto', which takes it for such heads)"
            )
        return None

    def launch_fused(self, launch, *, checked: bool, written=()) -> None:
        """Run a fused serving launch (:class:`~ropekit.backends.fused_launch.FusedLaunch`) on this backend's
        kernel, then tell autograd that each tensor of ``written`` changed (the kernel writes through
        pointers; a registered op passes none: its dispatcher does it). checked=False: the launcher checks
        the launch."""
        if launch.cos.dtype != torch.float32 or launch.cos.stride(-1) != 1:
            launch = launch._replace(cos=launch.cos.float().contiguous(), sin=launch.sin.float().contiguous())
        self.kernels()[0](launch, checked=checked)
        tell_autograd(written)

    def launch_qk_norm(
        self, qkv, q_weight, k_weight, cos, sin, positions, offset, spec, *, written=()
    ) -> None:
        """QK-RMSNorm + RoPE on qkv (B, S, W) in place on this backend's kernel (it reads contiguous float32
        weights and tables), then bump the version counter of each tensor of ``written``."""
        if cos.dtype != torch.float32 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
        weights = [w.detach().float().contiguous() for w in (q_weight, k_weight)]
        self.kernels()[1](qkv, *weights, cos, sin, positions, offset, spec)
        tell_autograd(written)

    def plan(self, q, k, cos, sin, *, interleaved, conjugate, inplace, per_sequence=False, cu_seqlens=None):
        """The launch for one key (:mod:`ropekit.backends.plan`): the raw launcher on the caller's tensors,
        without the op's own argument checks (the launcher keeps the kernel wall). None when the inputs need
        the conversions of :meth:`rotate_qk` (a strided last axis, a table that is not float32), or for
        per-sequence offset tensors and packed batches (the launcher takes an int offset or a row per
        token)."""
        units = [t.stride(-1) == 1 for t in (q, cos, sin) + (() if k is None else (k,))]
        if per_sequence or cu_seqlens is not None or not all(units) or cos.dtype != torch.float32:
            return None
        launch = self._launch

        def run(q, k, cos, sin, offset):
            if inplace:
                q_out, k_out = q, k
            else:
                q_out, k_out = torch.empty_like(q), None if k is None else torch.empty_like(k)
            launch(q, k, q_out, k_out, cos, sin, None, offset, interleaved, conjugate)
            if inplace:  # what the dispatcher would do: tell autograd that q and k changed
                torch._C._increment_version((q,) if k is None else (q, k))
            return q_out, k_out

        return run

    def rotate_qk(
        self, q, k, cos, sin, positions, *, interleaved, conjugate, inplace, offset=0, numerics="exact"
    ):
        if numerics != "exact":
            flags = (interleaved, conjugate, inplace, offset, numerics)
            return self._rotate_rounded(q, k, cos, sin, positions, *flags)
        # Plain eager tensors skip the op dispatcher (tens of microseconds, most of a decode step); anything
        # that traces (torch.compile, fake tensors, dispatch modes) goes through the registered ops.
        direct = plain_eager(q)
        cos, sin = kernel_tables(cos, sin)
        args = (q, k, cos, sin, positions, interleaved, conjugate, offset)
        if inplace:
            if not direct:  # the op's ADInplaceOrView kernel bumps the version counters
                self.op_(*args)
                return q, k
            self._rotary_(*args)
            # What the dispatcher would do: tell autograd that q and k changed (docs/safety.md).
            torch._C._increment_version((q,) if k is None else (q, k))
            return q, k
        if not direct and is_dtensor(q):
            # DTensor's sharding rules cannot describe this op's Tensor[] result: rotate copies in place (the
            # copies are local, as is the rotation; ropekit.integrations.dtensor).
            q_out, k_out = q.clone(), None if k is None else k.clone()
            self.op_(q_out, k_out, cos, sin, positions, interleaved, conjugate, offset)
            return q_out, k_out
        outs = (self._rotary if direct else self.op)(*args)
        return outs[0], (outs[1] if k is not None else None)

    def _rotate_rounded(self, q, k, cos, sin, positions, interleaved, conjugate, inplace, offset, numerics):
        """numerics "hf" / "vllm" (rounded after each op): the raw launcher with its per-op rounding, on plain
        eager tensors. The registered ops compute "exact" alone; a call that traces (torch.compile, export,
        a dispatch mode, DTensors) rotates with the torch backend's ops instead, the peers' own torch
        arithmetic (the same bits in eager)."""
        if numerics not in served_numerics(self):
            raise ValueError(
                f"numerics: the {self.name!r} backend computes 'exact' only, got {numerics!r} (the 'torch' "
                f"and 'cpu' backends serve it)"
            )
        if not plain_eager(q) or is_dtensor(q):
            flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace, offset=offset)
            return eager_rotate_qk(q, k, cos, sin, positions, **flags, numerics=numerics)
        cos, sin = kernel_tables(cos, sin)
        if inplace:
            q_out, k_out = q, k
        else:
            q_out, k_out = torch.empty_like(q), None if k is None else torch.empty_like(k)
        launch = functools.partial(self._launch, numerics=numerics)
        _run(launch, q, k, q_out, k_out, cos, sin, positions, offset, interleaved, conjugate)
        if inplace:  # what the dispatcher would do: tell autograd that q and k changed
            torch._C._increment_version((q,) if k is None else (q, k))
        return q_out, k_out
