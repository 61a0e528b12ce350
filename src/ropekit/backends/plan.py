"""Launch plans: a repeated call's steady state as one lookup, the value checks and one kernel call.

"Plan" in ropekit means this and nothing else: the launch-plan cache and the runs it holds.

A decode loop calls with the same shapes, strides, dtypes and flags every step; only the data and the int
offset change. :func:`gate` makes the one gate every op reaches (the rotation, the serving fusions,
the module, the compat calls): it builds the call's key from its arguments (each tensor's shape, stride, dtype
and device; ``int`` for an int; the keyword flags with their types), looks it up once, and runs the plan it
finds. A miss returns the key; the op's checked path then serves the call (every argument checked, the
backend chosen) and stores the plan it has proved with :func:`keep`: a run with everything that depends on
the key alone (strides, the packed kernel arguments, the table bound) worked out, or None when this kind has
none. A plan's run makes the checks that depend on values and addresses (an int offset against the table;
the memory rule of docs/safety.md from this call's data pointers) and returns None, having written nothing,
when one fails: the checked path then runs and raises its own error.

A plan never changes an answer: every fact a check relied on is in the key (or checked by its run), so a
changed stride, shape, dtype or flag misses. Calls that trace (torch.compile, dispatch modes), record autograd
history, take a tensor subclass or an argument of any other type never use a plan.

Shape notation: B batch, S sequence, H heads, D head_dim.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from ropekit.backends.base import served_numerics
from ropekit.backends.kernel_op import KernelBackend, kernel_tables
from ropekit.validation import byte_extent, shares_memory

__all__ = [
    "clear_plans",
    "gate",
    "keep",
    "launch_rotary",
    "launch_rotary_packed",
    "launch_rotary_positions",
    "rotary_plan",
    "span",
]

# Plans kept before the cache starts over: a process sees a handful of (shape, layout) kinds; a workload
# whose shapes never repeat (variable-length prefill) must not grow this without bound.
MAX_PLANS = 256
# A flag's kind (``name:kind`` in gate's flags) -> the check that its value is exactly of that kind.
_FLAG_CHECKS = {
    "bool": "({0} is True or {0} is False)",
    "bool?": "({0} is None or {0} is True or {0} is False)",
    "int": "type({0}) is int",
    "number": "(type({0}) is float or type({0}) is int)",
    "number?": "({0} is None or type({0}) is float or type({0}) is int)",
    "dtype": "type({0}) is torch.dtype",
    "str": "type({0}) is str",
}

Tensor = torch.Tensor
# The gates' questions of torch, bound once (a decode step cannot spare the attribute look-ups).
_is_compiling = torch.compiler.is_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack
# torch.jit.trace records: a plan's pointers are invisible to it. (Today a traced call's key misses anyway:
# the tracer's sizes compare unequal to plain ones; this does not rest on that.)
_jit_tracing = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_plans: dict[tuple, Callable | None] = {}  # None: the key's kind has no plan (the checked path serves it)
_MISSING = object()


def clear_plans() -> None:
    """Forget every plan (with the backend choices: :func:`ropekit.backends.clear_backend_cache`)."""
    _plans.clear()


def gate(op: str, args: str, flags: str) -> Callable[..., tuple[object, tuple | None]]:
    """The one gate in front of an op's checked path, made once per op: ``gate(op, args, flags)`` returns
    ``launch_planned(*args, **flags)``, which answers ``(result, None)`` when a plan served the call; ``(None,
    key)`` on a first call of its kind (the checked path serves it, then :func:`keep` stores the plan for
    key); ``(None, None)`` when no plan serves it (a kind known to have none, a value check that failed, an
    argument no plan may take: a trace, a tensor subclass or one that requires grad, another type).

    Every op's key is built the same way: each tensor's shape, stride, dtype and device, ``int`` for an int
    (its value goes to the plan's run), None for None, then each flag's value, of exactly its kind. A call
    that records autograd history (grad enabled and a tensor that requires grad) never takes a plan. The gate
    is written out for the op's arguments (a tuple literal, as a hand-written key would be: a decode step
    cannot spare a loop over its arguments), from this one template.

    Args:
        op: the op's name (its plans never meet another op's).
        args: the positional arguments, in the order the plan's run takes them: ``name`` a plain tensor,
            ``name?`` a tensor or None, ``name#`` a tensor or an int (its value goes to the run), ``name$`` a
            tensor, a number (int or float: its value is in the key, as a flag's) or None, ``name!`` None (no
            plan serves a call that gives it).
        flags: the keyword-only arguments, ``name:kind`` with kind bool, bool? (or None), int, number (int or
            float), number? (or None), dtype (a torch.dtype) or str; any other type takes the checked path.
    """
    names, plain, facts, grads = [], [], [], []  # pieces of the source; its own names start with _gate_
    for token in args.split():
        name = token.rstrip("?#!$")
        names.append(name)
        layout = f"{name}.shape, {name}.stride(), {name}.dtype, {name}.device"
        if token.endswith("!"):  # no plan serves it given: None, or the checked path
            plain.append(f"{name} is None")
        elif token.endswith("?"):
            plain.append(f"({name} is None or type({name}) is Tensor)")
            facts.append(f"None if {name} is None else ({layout})")
            grads.append(f"({name} is not None and {name}.requires_grad)")
        elif token.endswith("$"):  # a tensor, a number (its value in the key, as a flag's) or None
            plain.append(
                f"({name} is None or type({name}) is Tensor or type({name}) is float or type({name}) is int)"
            )
            facts.append(f"None if {name} is None else ({layout}) if type({name}) is Tensor else ({name},)")
            grads.append(f"(type({name}) is Tensor and {name}.requires_grad)")
        elif token.endswith("#"):
            plain.append(f"(type({name}) is Tensor or type({name}) is int)")
            facts.append(f"int if type({name}) is int else ({layout})")
            grads.append(f"(type({name}) is Tensor and {name}.requires_grad)")
        else:
            plain.append(f"type({name}) is Tensor")
            facts.append(layout)
            grads.append(f"{name}.requires_grad")
    flag_names = []
    for token in flags.split():
        name, kind = token.split(":")
        flag_names.append(name)
        plain.append(_FLAG_CHECKS[kind].format(name))  # exact types: a key holds True, never 1 in its place
        facts.append(name)
    call = ", ".join(names)
    params = f"{call}, *, {', '.join(flag_names)}" if flag_names else call
    source = f"""
def launch_planned({params}):
    if (
        _is_compiling() or _dispatch_depth() or _jit_tracing()
        or not ({" and ".join(plain)})
        or (_grad_enabled() and ({" or ".join(grads)}))
    ):
        return None, None
    _gate_key = ({op!r}, {", ".join(facts)})
    _gate_run = _plans.get(_gate_key, _MISSING)
    if _gate_run is _MISSING:
        return None, _gate_key
    if _gate_run is None:
        return None, None
    return _gate_run({call}), None
"""
    scope: dict = {}  # the gate reads this module's globals (_plans, _MISSING, ...) when it is called
    exec(compile(source, f"{__file__} (the gate of {op})", "exec"), globals(), scope)
    return scope["launch_planned"]


# The rotation's gate: apply_rotary(_qk), RotaryEmbedding and compat.hf use it.
launch_rotary = gate(
    "rotary",
    "q k? cos sin offset#",
    "interleaved:bool inplace:bool backend:str conjugate:bool numerics:str",
)
# A packed batch's (q (T, H, D), cu_seqlens (N + 1,), an int offset or (N,) offsets): apply_rotary(_qk).
launch_rotary_packed = gate(
    "rotary_packed",
    "q k? cos sin offset# cu_seqlens",
    "interleaved:bool inplace:bool backend:str conjugate:bool numerics:str",
)
# Explicit positions (every token's table row): (B, S) for q (B, S, H, D), or (T,) for a packed q (T, H, D)
# with its cu_seqlens (which the run's launch checks, as the checked path does): apply_rotary(_qk).
launch_rotary_positions = gate(
    "rotary_positions",
    "q k? cos sin positions cu_seqlens?",
    "interleaved:bool inplace:bool backend:str conjugate:bool numerics:str",
)


def keep(key: tuple | None, run: Callable | None) -> None:
    """Store key's plan (None: the key has none), starting over past MAX_PLANS; a None key: nothing."""
    if key is None:
        return
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    _plans[key] = run


def span(t: torch.Tensor) -> int:
    """Bytes from t's first element to one past its last (strides are never negative in torch)."""
    return byte_extent(t) + 1


def rotary_plan(
    impl,
    q,
    k,
    cos,
    sin,
    offset,
    *,
    interleaved: bool,
    inplace: bool,
    conjugate: bool,
    cu_seqlens=None,
    positions=None,
    swap: tuple[int, int] | None = None,
    table_grows: bool = False,
    numerics: str = "exact",
):
    """The run of one rotation key, ``run(q, k, cos, sin, offset)`` -> (q_out, k_out) or None, after the
    checked path served the call with an int offset or per-sequence offsets (4-D q); or, with
    ``cu_seqlens``, ``run(q, k, cos, sin, offset, cu_seqlens)`` for a packed batch (q (T, H, D), an int
    offset or one per packed sequence: :data:`launch_rotary_packed`'s keys); or, with ``positions`` (the
    call's positions tensor, ``offset`` then unused), ``run(q, k, cos, sin, positions, cu_seqlens)`` for
    :data:`launch_rotary_positions`' keys: int64 contiguous rows, (B, S) for 4-D q or (T,) for a packed q
    with its cu_seqlens. None when this kind has no plan.

    ``impl`` is the backend it chose; a backend with a ``plan(q, k, cos, sin, *, interleaved, conjugate,
    inplace, per_sequence=False, cu_seqlens=None)`` method gives its own launch (or None: no plan); any
    other gets its rotate_qk, flags bound (int offsets of 4-D q only). A kernel backend's tables that its
    kernels do not read as they are (another dtype, a strided row) are converted in the run, as its
    rotate_qk converts them (:func:`~ropekit.backends.kernel_op.kernel_tables`). Positions are planned only
    by a backend whose plan takes ``positions=True`` (its launch reads the rows in the kernel and checks
    every one before anything is written: the C loop on the host, Triton by its launcher and its in-kernel
    flag; with cu_seqlens, it checks cu_seqlens as the checked path does): a backend that would need the
    rows checked for it (the torch backend, a registered one without that keyword) has none. The run checks
    what the key cannot hold: an int offset against the table (``table_len - S``; packed, ``table_len - 1``:
    the launch checks each sequence's rows, on the host for CPU tensors, in the kernel otherwise, as it
    checks cu_seqlens' values) and, in place, the memory rule from the call's addresses: q and k meet
    neither table nor the per-sequence offsets nor the positions nor cu_seqlens, and share no element with
    each other (decided exactly, once per byte distance k - q, which with the layouts the key fixes decides
    it).

    ``swap``: the key was built from the caller's own tensors and q, k here are their (B, S, H, D) views
    ``t.transpose(*swap)`` (:class:`ropekit.RotaryEmbedding`'s "bhsd" and "sbhd" layouts): the run takes the
    caller's tensors and returns what the checked path returns for them (the caller's own tensors in place;
    out of place, its outputs seen back through the swap). ``table_grows``: the caller grows its table for
    rows past it (the module) where a plan would refuse them: a packed int offset is served only when
    ``offset + T <= table_len`` (every row inside, whatever the lengths), and packed per-sequence offsets
    only on CPU tensors, whose rows the launch checks on the host before it writes (it returns None, and the
    caller's checked path grows the table); on a device the kernel would flag them instead.

    ``numerics``: the arithmetic mode (:data:`ropekit.validation.NUMERICS`), in the key as a flag: a plan
    of one mode never serves another; a backend's ``plan`` gets it when it is not "exact" (a ``plan``
    without that keyword: no plan).
    """
    packed = cu_seqlens is not None
    rows = positions is not None
    if (
        cos.device != q.device
        or q.dim() != (3 if packed else 4)
        or q.numel() == 0
        or (k is not None and k.numel() == 0)
    ):
        return None
    if packed and not (
        cu_seqlens.dtype in (torch.int32, torch.int64)
        and cu_seqlens.dim() == 1
        and cu_seqlens.shape[0] >= 2
        and cu_seqlens.is_contiguous()
        and cu_seqlens.device == q.device
    ):
        return None
    if rows:  # one row per token, read by the kernel as they are (the checked path converts any other)
        offset = positions
        if not (
            positions.dtype == torch.int64
            and positions.shape == q.shape[:-2]
            and positions.is_contiguous()
            and positions.device == q.device
        ):
            return None
    per_sequence = not rows and type(offset) is not int
    if packed and per_sequence and table_grows and not q.is_cpu:
        return None
    if per_sequence and not (
        offset.dtype == torch.int64
        and offset.shape == ((cu_seqlens.shape[0] - 1,) if packed else q.shape[:1])
        and offset.is_contiguous()
        and offset.device == q.device
    ):
        return None
    make = getattr(impl, "plan", None)
    flags = dict(interleaved=interleaved, conjugate=conjugate, inplace=inplace)
    if per_sequence:
        flags["per_sequence"] = True
    if packed:
        flags["cu_seqlens"] = cu_seqlens  # its length and dtype are the key's
    if numerics != "exact":
        if make is not None and numerics not in served_numerics(impl):
            return None
        flags["numerics"] = numerics
    if rows:
        if make is None or "positions" not in inspect.signature(make).parameters:
            return None  # rows it cannot check itself: the checked path checks them every call
        flags["positions"] = True
    # A kernel backend reads float32 rows of unit stride: other tables (HF's bf16 rows, the every-other
    # column of interleaved full-width rows) are converted per call, as its rotate_qk converts them.
    read_cos, read_sin = kernel_tables(cos, sin) if isinstance(impl, KernelBackend) else (cos, sin)
    convert = read_cos is not cos
    if make is not None:
        launch = make(q, k, read_cos, read_sin, **flags)
        if launch is None:
            return None
    elif per_sequence or packed:
        return None
    else:

        def launch(q, k, cos, sin, offset):
            return impl.rotate_qk(q, k, cos, sin, None, **flags, offset=offset)

    if swap is not None:
        launch = _in_caller_layout(impl, launch, q, k, swap, inplace)
    # an int offset's rows offset .. offset + S - 1 fit the table (packed: at least row offset; a table that
    # grows: every one of the T tokens' rows, offset + T - 1 at most)
    last_offset = cos.shape[0] - ((q.shape[0] if table_grows else 1) if packed else q.shape[1])
    q_span, k_span, cos_span, sin_span = span(q), 0 if k is None else span(k), span(cos), span(sin)
    # per-sequence offsets or positions: bytes the kernel reads as it writes (0: none to meet)
    offsets_span = span(offset) if (per_sequence or rows) and offset.numel() else 0
    cu_span = span(cu_seqlens) if packed else 0
    shared: dict[int, bool] = {}  # k - q byte distance -> whether q and k share an element

    def run(q, k, cos, sin, offset, cu_seqlens=None):
        if type(offset) is int and not 0 <= offset <= last_offset:
            return None
        if inplace:  # the memory rule, from this call's addresses (docs/safety.md)
            if (q.is_inference() or (k is not None and k.is_inference())) and (
                not torch.is_inference_mode_enabled()
            ):
                return None  # PyTorch refuses this write: the checked path raises as it would
            q_lo, cos_lo, sin_lo = q.data_ptr(), cos.data_ptr(), sin.data_ptr()
            if (cos_lo < q_lo + q_span and q_lo < cos_lo + cos_span) or (
                sin_lo < q_lo + q_span and q_lo < sin_lo + sin_span
            ):
                return None  # q's bytes meet a table's: the checked path decides, and raises
            for index, index_span in ((offset, offsets_span), (cu_seqlens, cu_span)):
                if index_span:  # per-sequence offsets, positions, cu_seqlens: read by the kernel as it writes
                    lo = index.data_ptr()
                    if (lo < q_lo + q_span and q_lo < lo + index_span) or (
                        k is not None and lo < k.data_ptr() + k_span and k.data_ptr() < lo + index_span
                    ):
                        return None
            if k is not None:
                k_lo = k.data_ptr()
                if (cos_lo < k_lo + k_span and k_lo < cos_lo + cos_span) or (
                    sin_lo < k_lo + k_span and k_lo < sin_lo + sin_span
                ):
                    return None
                if k_lo < q_lo + q_span and q_lo < k_lo + k_span:  # views of one buffer (packed qkv)
                    distance = k_lo - q_lo
                    meet = shared.get(distance)
                    if meet is None:
                        meet = shares_memory(q, k)
                        if len(shared) < MAX_PLANS:
                            shared[distance] = meet
                    if meet:
                        return None
        if convert:  # after the memory rule, which the caller's tables obey
            cos, sin = kernel_tables(cos, sin)
        if cu_seqlens is None:
            return launch(q, k, cos, sin, offset)
        return launch(q, k, cos, sin, offset, cu_seqlens)

    return run


def _in_caller_layout(impl, launch, q, k, swap, inplace):
    """``launch``, made for the (B, S, H, D) views q and k, as a launch on the caller's own tensors, of which
    they are ``t.transpose(*swap)``. A backend whose plans read only their tensors' addresses (and allocate
    outputs with ``empty_like``: ``plan_reads_pointers``) runs on the caller's tensors as they are, when
    ``empty_like`` lays the caller's outputs out as it lays out the views' (dense inputs: the key fixes the
    strides, so once here decides it); any other runs on views made per call, and its outputs are seen back
    through the swap, as the checked path returns them."""
    same_outputs = inplace or all(
        t is None
        or torch.empty_like(t.transpose(*swap)).stride() == torch.empty_like(t).transpose(*swap).stride()
        for t in (q, k)
    )
    if getattr(impl, "plan_reads_pointers", False) and same_outputs:
        return launch

    def through_views(q, k, cos, sin, offset):
        out = launch(q.transpose(*swap), None if k is None else k.transpose(*swap), cos, sin, offset)
        if out is None or inplace:
            return None if out is None else (q, k)  # in place: the caller's own tensors
        out_q, out_k = out
        return out_q.transpose(*swap), None if out_k is None else out_k.transpose(*swap)

    return through_views
