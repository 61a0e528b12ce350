"""Numerical checks, for one configuration, of every property of RoPE that docs/math.md derives (RoFormer,
Su et al. 2021), and of the backends that serve float32 and bfloat16 in production.

Each check compares two computations that the mathematics (docs/math.md) says are equal and reports the
largest difference against a tolerance: float64 round-off for the float64 claims. A backend's float32 or
bfloat16 output is held to a bound per element, one rounding of the output dtype plus float32 arithmetic
(:func:`backend_error_bound`); its row reports the largest error / bound, which must stay <= 1.
With ``numerics="hf"`` or ``"vllm"`` the backend rows instead hold each backend that serves the mode to the
peer's own torch expression, bit for bit (:func:`peer_rotation`), in float32, bfloat16 and float16.
Used by ``ropekit verify`` and the demo report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from ropekit import reference as ref
from ropekit.backends import BACKENDS, select_backend
from ropekit.config import RopeConfig
from ropekit.functional import apply_rotary
from ropekit.sinusoidal import sinusoidal_embedding
from ropekit.validation import check_numerics

__all__ = [
    "MAX_HEAD_DIM",
    "TOL",
    "TRITON_MODES",
    "Check",
    "available_backends",
    "backend_error_bound",
    "peer_rotation",
    "run_checks",
    "triton_compile_checks",
    "triton_mode",
]

# float64 round-off grows with the angle m*theta (about 1e-16 * m); positions below a few thousand keep every
# error near 1e-12, so 1e-9 leaves a wide margin while still catching any real mistake (those are O(1)).
TOL = 1e-9
# The textbook prints its sinusoidal values to 3-5 significant digits.
PRINTED_DIGITS_TOL = 5e-4
# The checks build head_dim x head_dim rotation matrices (8 MB at 1024); real models use 512 at most.
MAX_HEAD_DIM = 1024
# Storage dtypes the production backends are checked in (math runs in float32 for both).
BACKEND_DTYPES = (torch.float32, torch.bfloat16)
# numerics "hf" / "vllm": the dtypes whose bits are checked against the peer's expression.
PEER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Check:
    """One verified claim: the largest difference between two computations the mathematics says are equal."""

    name: str
    max_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.max_error <= self.tolerance)

    def as_dict(self) -> dict[str, Any]:
        """{"name", "max_error", "tolerance", "passed"}, the shape ``ropekit verify --json`` prints."""
        return {**asdict(self), "passed": self.passed}


def _err(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


def _textbook_dot(angle_deg: float, m: int, n: int) -> float:
    """The textbook's 2-D example: q = k = (1, 0) rotated to positions m and n by theta = angle_deg."""
    theta = np.array([math.radians(angle_deg)])
    e1 = np.array([1.0, 0.0])
    return float(ref.rotate_interleaved(e1, m, theta) @ ref.rotate_interleaved(e1, n, theta))


def backend_device(name: str) -> torch.device:
    """Where a backend is checked: CUDA when there is a GPU and the dispatch accepts CUDA inputs for it, else
    the CPU."""
    probe = torch.empty(1, 1, 1, 2)  # (batch, seq, heads, head_dim)
    if torch.cuda.is_available():
        try:
            select_backend(name, probe.cuda(), probe.new_empty(1, 1).cuda())
            return torch.device("cuda")
        except ValueError:
            pass
    return torch.device("cpu")


def available_backends() -> list[str]:
    """The registered backends the dispatch accepts float32 inputs for on this machine (each on
    :func:`backend_device`): the CPU fast path when a compiler is present, Triton on a GPU (or under
    ``TRITON_INTERPRET=1``), and the plain torch backend always."""
    names = []
    for name in BACKENDS:
        device = backend_device(name)
        try:
            select_backend(name, torch.empty(1, 1, 1, 2, device=device), torch.empty(1, 1, device=device))
        except ValueError:
            continue
        names.append(name)
    return names


def backend_error_bound(want: np.ndarray, dtype: torch.dtype, scale: float) -> np.ndarray:
    """The largest error a correct backend may make on each element, for exact results ``want`` stored in
    dtype from inputs of magnitude <= scale.

    Rounding to nearest costs at most half an ulp of dtype at the element's own magnitude; the float32
    arithmetic on float32-rounded table rows adds a few float32 ulps of scale. A store that truncates instead
    (up to a whole ulp) exceeds the bound.
    """
    info = torch.finfo(dtype)
    magnitude = np.maximum(np.abs(want), info.tiny)
    ulp = info.eps * 2.0 ** np.floor(np.log2(magnitude))
    return 0.5 * ulp + 8 * torch.finfo(torch.float32).eps * scale


def _backend_checks(
    config: RopeConfig, backends: Sequence[str], rng: np.random.Generator, n_positions: int, max_position: int
) -> list[Check]:
    """Each backend, in each of BACKEND_DTYPES and both pair layouts, against the float64 reference applied to
    the same (already rounded) inputs."""
    theta = ref.inv_freq(config.rotary_dim, config.base)
    positions = rng.integers(0, max_position, size=n_positions)
    x = torch.from_numpy(rng.standard_normal((1, n_positions, 3, config.head_dim)))  # (batch, seq, heads, D)
    cos, sin = config.cos_sin(int(positions.max()) + 1)  # float32: what production tables are
    checks = []
    for name in backends:
        device = backend_device(name)
        pos = torch.from_numpy(positions).reshape(1, n_positions).to(device)  # (batch, seq)
        for dtype in BACKEND_DTYPES:
            stored = x.to(dtype)
            scale = float(stored.double().abs().max())
            for interleaved, layout in ((False, "half"), (True, "interleaved")):
                rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
                want = rotate(stored.double().numpy(), positions[None, :, None], theta)
                got = apply_rotary(
                    stored.to(device), cos.to(device), sin.to(device), positions=pos,
                    interleaved=interleaved, backend=name,
                )  # fmt: skip
                error = np.abs(got.double().cpu().numpy() - want) / backend_error_bound(want, dtype, scale)
                dtype_name = str(dtype).removeprefix("torch.")
                checks.append(
                    Check(
                        f"backend {name} {dtype_name} ({layout}) = float64 reference (error / bound)",
                        float(error.max()),
                        1.0,
                    )
                )
    return checks


def peer_rotation(x, cos, sin, positions, *, interleaved: bool, numerics: str) -> torch.Tensor:
    """The peer's own torch expression in x's dtype on the first R features (the rest pass through): "hf",
    transformers' eager ``x * cos + rotate_half(x) * sin`` on full-width rows (``cat(freqs, freqs)``, or
    ``repeat_interleave`` and Cohere's interleaved rotate_half); "vllm", vLLM's ``forward_native``, ``x1 *
    cos - x2 * sin`` and ``x2 * cos + x1 * sin``. cos, sin (L, R/2) are cast to x's dtype first, as both
    peers cast theirs. x (B, S, H, D), positions (B, S)."""
    c = cos[positions].to(x.dtype).unsqueeze(-2)  # (B, S, 1, R/2)
    s = sin[positions].to(x.dtype).unsqueeze(-2)
    rot = 2 * cos.shape[-1]
    x_rot = x[..., :rot]
    x1, x2 = (
        (x_rot[..., ::2], x_rot[..., 1::2])
        if interleaved
        else (x_rot[..., : rot // 2], x_rot[..., rot // 2 :])
    )
    if numerics == "hf":
        if interleaved:
            c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
            rotated_half = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
            rotated_half = torch.cat((-x2, x1), dim=-1)
        out = x_rot * c + rotated_half * s
    else:
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), dim=-1)
    return torch.cat((out, x[..., rot:]), dim=-1)


def _numerics_checks(config, backends, rng, n_positions, max_position, numerics) -> list[Check]:
    """Each backend in numerics "hf" / "vllm", in PEER_DTYPES and both pair layouts, against the peer's own
    expression on the same inputs and tables: the largest difference, which must be 0 (the same bits)."""
    positions = rng.integers(0, max_position, size=n_positions)
    x = torch.from_numpy(4 * rng.standard_normal((1, n_positions, 3, config.head_dim)))  # (B, S, H, D)
    cos, sin = config.cos_sin(int(positions.max()) + 1)
    pos = torch.from_numpy(positions).reshape(1, n_positions)  # (batch, seq)
    checks = []
    for name in backends:
        device = backend_device(name)
        for dtype in PEER_DTYPES:
            stored = x.to(dtype)
            for interleaved, layout in ((False, "half"), (True, "interleaved")):
                want = peer_rotation(stored, cos, sin, pos, interleaved=interleaved, numerics=numerics)
                got = apply_rotary(
                    stored.to(device), cos.to(device), sin.to(device), positions=pos.to(device),
                    interleaved=interleaved, backend=name, numerics=numerics,
                )  # fmt: skip
                error = (got.cpu().double() - want.double()).abs().max().item()
                peer = "HF's x*cos + rotate_half(x)*sin" if numerics == "hf" else "vLLM's forward_native"
                dtype_name = str(dtype).removeprefix("torch.")
                checks.append(
                    Check(f"backend {name} {dtype_name} ({layout}) numerics={numerics} = {peer}", error, 0.0)
                )
    return checks


def run_checks(
    config: RopeConfig,
    *,
    seed: int = 0,
    n_positions: int = 8,
    max_position: int = 4096,
    backends: Sequence[str] | None = None,
    numerics: str = "exact",
) -> list[Check]:
    """Run every check for ``config``; the textbook's worked examples are included whatever the config.

    Args:
        config: head_dim, base and rotary_dim to check. A scaling schedule is ignored: docs/math.md's
            properties are about the unscaled rotation.
        seed: seed for the random vectors and positions.
        n_positions: how many random positions each check samples.
        max_position: positions are drawn from [0, max_position).
        backends: backends whose float32 and bfloat16 outputs are checked against the float64 reference
            (one row per backend, dtype and pair layout); None means :func:`available_backends` (those
            that serve ``numerics``).
        numerics: "exact" (the rows above), or "hf" / "vllm": the backend rows check the mode's bits
            against the peer's expression (:func:`peer_rotation`, tolerance 0) in float32, bfloat16 and
            float16 instead.

    Returns:
        One :class:`Check` per claim, in a fixed order, then the backend rows.

    Raises:
        ValueError: for a head_dim above MAX_HEAD_DIM, or a backend that is not registered or cannot serve
            inputs on this machine (the dispatch's reason).
    """
    if config.head_dim > MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim: expected at most {MAX_HEAD_DIM} for verify (its checks build head_dim x head_dim "
            f"rotation matrices), got {config.head_dim}"
        )
    check_numerics(numerics)
    if backends is None:
        backends = [
            b for b in available_backends() if numerics in getattr(BACKENDS[b], "numerics", ("exact",))
        ]
    for name in backends:
        device = backend_device(name)
        probe, table = torch.empty(1, 1, 1, 2, device=device), torch.empty(1, 1, device=device)
        select_backend(name, probe, table, numerics=numerics)
    rng = np.random.default_rng(seed)
    d, D = config.rotary_dim, config.head_dim
    theta = ref.inv_freq(d, config.base)
    positions = rng.integers(0, max_position, size=n_positions)
    checks: list[Check] = []

    def add(name: str, err: float, tol: float = TOL) -> None:
        checks.append(Check(name, err, tol))

    config = RopeConfig(D, config.base, rotary_dim=d, interleaved=config.interleaved)
    add("RopeConfig.inv_freq = base^(-2i/d)", _err(config.inv_freq().numpy(), theta))

    # Orthogonality and determinant of R_m.
    rotations = [ref.rotation_matrix(m, theta) for m in positions]
    add("R^T R = I", max(_err(r.T @ r, np.eye(d)) for r in rotations))
    add("det R = 1", max(abs(np.linalg.det(r) - 1.0) for r in rotations))

    # Composition: R_m^T R_n = R_{n-m}.
    pairs = rng.integers(0, max_position, size=(n_positions, 2))
    add(
        "R_m^T R_n = R_(n-m)",
        max(
            _err(
                ref.rotation_matrix(m, theta).T @ ref.rotation_matrix(n, theta),
                ref.rotation_matrix(n - m, theta),
            )
            for m, n in pairs
        ),
    )

    # The inner product of rotated q and k depends only on n - m: the same offset at many absolute positions.
    q, k = rng.standard_normal(D), rng.standard_normal(D)
    errs = []
    for offset in rng.integers(-64, 64, size=4):
        starts = rng.integers(max(0, -offset), max_position, size=n_positions)
        dots = [
            ref.rotate_interleaved(q, m, theta) @ ref.rotate_interleaved(k, m + offset, theta) for m in starts
        ]
        errs.append((max(dots) - min(dots)) / max(1.0, abs(dots[0])))
    add("(R_m q).(R_n k) depends only on n - m", max(errs))

    # Norm preservation.
    x = rng.standard_normal((n_positions, D))
    rotated = ref.rotate_interleaved(x, positions, theta)
    add("norms preserved", _err(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1)))

    # Matrix form = complex form = interleaved elementwise form.
    by_matrix = np.stack([ref.rotate_matrix(x[i], positions[i], theta) for i in range(n_positions)])
    add("matrix form = complex form", _err(by_matrix, ref.rotate_complex(x, positions, theta)))
    add("matrix form = interleaved form", _err(by_matrix, rotated))

    # The half layout is the interleaved layout under the pair permutation.
    to_half = np.concatenate([ref.interleaved_to_half_permutation(d), np.arange(d, D)])
    add(
        "half form = interleaved form, permuted",
        _err(ref.rotate_half(x[:, to_half], positions, theta), rotated[:, to_half]),
    )

    # The production apply_rotary against the reference, both layouts, float64.
    cos, sin = config.cos_sin(int(positions.max()) + 1, dtype=torch.float64)
    xt = torch.from_numpy(x).reshape(1, n_positions, 1, D)  # (batch, seq, heads, head_dim)
    pos_t = torch.from_numpy(positions).reshape(1, n_positions)  # (batch, seq)
    outputs = {}
    for interleaved, name in ((False, "half"), (True, "interleaved")):
        outputs[interleaved] = apply_rotary(xt, cos, sin, positions=pos_t, interleaved=interleaved)
        rotate = ref.rotate_interleaved if interleaved else ref.rotate_half
        want = rotate(x, positions, theta)[None, :, None, :]
        add(f"apply_rotary ({name}) = reference", _err(outputs[interleaved].numpy(), want))
    add(
        "apply_rotary: half on permuted x = interleaved, permuted",
        _err(
            apply_rotary(xt[..., to_half], cos, sin, positions=pos_t, interleaved=False).numpy(),
            outputs[True][..., to_half].numpy(),
        ),
    )

    # Backward is the inverse rotation: dL/dx = R_m^T g = R_{-m} g.
    xg = xt.clone().requires_grad_(True)
    g = rng.standard_normal((n_positions, D))
    apply_rotary(xg, cos, sin, positions=pos_t, interleaved=True).backward(
        torch.from_numpy(g)[None, :, None, :]
    )
    add(
        "apply_rotary backward = inverse rotation",
        _err(xg.grad[0, :, 0].numpy(), ref.rotate_interleaved(g, -positions, theta)),
    )

    # The textbook's worked examples (d = 2, theta given directly in degrees).
    add("textbook: theta=30deg, m=1, n=3 gives 0.5", abs(_textbook_dot(30.0, 1, 3) - 0.5))
    add("textbook: theta=45deg, m=0, n=2 gives 0", abs(_textbook_dot(45.0, 0, 2)))
    pe = ref.sinusoidal(np.array([1, 2]), 4)
    printed = np.array([[0.841, 0.909], [0.99995, 0.9998]])  # sin 1, sin 2, cos 0.01, cos 0.02 as printed
    got = np.array([[pe[0, 0], pe[1, 0]], [pe[0, 3], pe[1, 3]]])
    add("textbook: sinusoidal d=4 at 1, 2 (to printed digits)", _err(got, printed), PRINTED_DIGITS_TOL)
    add(
        "sinusoidal_embedding = reference",
        _err(
            sinusoidal_embedding(torch.from_numpy(positions), d, config.base, dtype=torch.float64),
            ref.sinusoidal(positions, d, config.base),
        ),
    )
    from ropekit.tools.verify_fused import fused_checks

    fused = fused_checks(
        config, backends, rng, n_positions, max_position, check=Check, bound=backend_error_bound,
        device_of=backend_device,
    )  # fmt: skip
    from ropekit.tools.verify_qk_norm import qk_norm_checks

    qk_norm = qk_norm_checks(
        config, backends, rng, n_positions, max_position, check=Check, bound=backend_error_bound,
        device_of=backend_device,
    )  # fmt: skip
    if numerics == "exact":
        rows = _backend_checks(config, backends, rng, n_positions, max_position)
    else:
        rows = _numerics_checks(config, backends, rng, n_positions, max_position, numerics)
    return checks + rows + fused + qk_norm


# How `verify --backends triton` ran the Triton kernel, and what that proves.
TRITON_MODES = {
    "gpu": "ran the compiled kernel on this GPU: its outputs on this device match the float64 reference",
    "interpreter": (
        "ran the kernel's source in Triton's CPU interpreter (no GPU here): its math, indexing and masks are "
        "right; it proves nothing about the compiled code (the interpreter is laxer about types, constexprs "
        "and bf16 conversion) nor about speed"
    ),
    "compile-only": (
        "compiled this configuration's kernels (float32 and bfloat16, forward and backward, int offset and "
        "positions) for sm_80, sm_90 and sm_100 and checked their PTX: no spills, registers within budget, "
        "128-bit q/k accesses, round-to-nearest-even stores, no FMA; no output was computed"
    ),
}


def triton_mode(compile_only: bool) -> str:
    """ "compile-only" when asked, else "gpu" with CUDA, else "interpreter"."""
    if compile_only:
        return "compile-only"
    return "gpu" if torch.cuda.is_available() else "interpreter"


def triton_compile_checks(config: RopeConfig) -> list[Check]:
    """One check a (target, dtype, direction, position kind): the number of machine-code findings of the
    kernel the launcher picks for this configuration (tolerance 0), compiled ahead of time with no GPU."""
    from ropekit.backends.triton import rotary_kernel as triton_kernel
    from ropekit.tools import triton_aot

    half, tail = config.rotary_dim // 2, config.head_dim - config.rotary_dim
    checks = []
    for dtype in ("fp32", "bf16"):
        for conjugate in (False, True):
            for has_pos in (False, True):
                constexprs, warps = triton_kernel.kernel_config(
                    dtype, half, tail, interleaved=config.interleaved, conjugate=conjugate,
                    rows=int(has_pos), copy_tail=tail > 0,  # ROWS 1: positions; 0: an int offset
                )  # fmt: skip
                signature = triton_kernel.signature(dtype, config.head_dim, half, constexprs)
                spec = triton_aot.module_spec(
                    triton_kernel, triton_kernel.rotary_kernel, signature, constexprs, warps
                )
                for arch in triton_aot.ARCHES:
                    result = triton_aot.compile_and_check(spec, arch)
                    direction = "backward" if conjugate else "forward"
                    what = f"{direction}, {'positions' if has_pos else 'int offset'}"
                    checks.append(
                        Check(
                            f"triton sm_{arch} {dtype} {what}: machine-code findings", len(result.findings), 0
                        )
                    )
    return checks
