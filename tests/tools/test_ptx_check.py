"""ropekit.tools.ptx_check: the checks flag what they exist to flag. Planted defects in a copy of the rotary
kernel (written to a temporary module here, never in src) must each produce a finding; the untouched copy
must produce none."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from ropekit.tools import ptx_check

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="compiles need Triton's JIT, not its interpreter",
)

ROUND = 'value.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne")'
PLANTS = {
    "untouched": [],
    # The bf16 bits cut out of the float32 in integer arithmetic: truncation, not round to nearest even.
    "truncating bf16 store": [
        (ROUND, "(value.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)")
    ],
    # The hardware conversion, rounding toward zero.
    "round-toward-zero store": [(ROUND, 'value.to(ptr.dtype.element_ty, fp_downcast_rounding="rtz")')],
    # Lanes swapped in pairs: the addresses are no longer contiguous, so the load is split into scalars.
    "scalar load": [
        ("a = tl.load(x_row + pair[None, None, :]", "a = tl.load(x_row + (pair ^ 1)[None, None, :]")
    ],
}
EXPECTED = {
    "untouched": set(),
    "truncating bf16 store": {"rounding"},
    "round-toward-zero store": {"rounding"},
    "scalar load": {"vectorised"},
}


def _kernel_copy(tmp_path: Path, name: str):
    """A copy of ropekit/backends/triton/rotary_kernel.py with the plant's replacements, imported as a new
    module."""
    pytest.importorskip("triton")
    from ropekit.backends.triton import rotary_kernel as triton_kernel

    source = Path(triton_kernel.__file__).read_text()
    for old, new in PLANTS[name]:
        assert source.count(old) == 1, f"the plant's anchor {old!r} is gone from the kernel"
        source = source.replace(old, new)
    path = tmp_path / f"planted_{name.replace(' ', '_').replace('-', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_defect_in_a_copy_of_the_kernel_is_flagged(plant, tmp_path, monkeypatch):
    from ropekit.tools import triton_aot

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    module = _kernel_copy(tmp_path, plant)
    # bf16, half pairing, head_dim 128, int offset: a specialization the launcher picks for Llama decode.
    spec = next(
        s
        for s in triton_aot.specs("ropekit.backends.triton.rotary_kernel")
        if dict(s.signature)["q_ptr"] == "*bf16:16"
        and dict(s.constexprs)["HALF"] == 64
        and not dict(s.constexprs)["INTERLEAVED"]
        and dict(s.constexprs)["ROWS"] == 0
        and dict(s.constexprs)["BLOCK_T"] == 1
    )
    result = triton_aot.compile_and_check(spec, 90, fn=module.rotary_kernel)
    assert {f.split(":")[0] for f in result.findings} == EXPECTED[plant], result.findings


def test_register_budget_is_the_full_occupancy_share_of_the_register_file():
    # 65,536 registers over 2,048 threads; a one-warp block is capped by 32 blocks an SM (1,024 threads).
    assert [ptx_check.register_budget(w) for w in (1, 2, 4, 8)] == [64, 32, 32, 32]
    assert ptx_check.register_budget(2, 0.75) == 40  # 1,536 threads: 42 rounded down to the 8-register unit
    assert ptx_check.register_budget(2, 0.625) == 48  # 1,280 threads: 51 rounded down
    assert ptx_check.occupancy(32, 2) == 1.0
    assert ptx_check.occupancy(40, 2) == 50 / 64  # 25 blocks of 2 warps
    assert ptx_check.check_registers({"REG": 33}, 4) and not ptx_check.check_registers({"REG": 32}, 4)


PTX = """
    ld.param.b64 %rd1, [k_param_0];
    ld.param.b64 %rd2, [k_param_1];
    add.s64 %rd3, %rd1, %rd9;
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd3 + 0 ];
    ld.global.b32 %r5, [ %rd2 + 0 ];
    cvt.rn.bf16x2.f32 %r6, %r1, %r2;
    shr.u32 %r7, %r3, 16;
    mov.b32 %r8, %r7;
    st.global.v2.b32 [ %rd3 + 16 ], { %r6, %r8 };
    fma.rn.f32 %r9, %r1, %r2, %r3;
"""


def test_the_ptx_data_flow_finds_accesses_through_a_pointer_and_the_origin_of_stored_bits():
    instructions = ptx_check.parse_ptx(PTX)
    through_q = ptx_check.pointer_accesses(instructions, {0})
    assert [i.opcode for i in through_q] == ["ld.global.v4.b32", "st.global.v2.b32"]
    assert [str(f) for f in ptx_check.check_vectorised(instructions, {0: "q", 1: "cos"})] == [
        "vectorised: q: st.global.v2.b32 (< 128 bits)",
        "vectorised: cos: ld.global.b32 (< 128 bits)",
    ]
    # %r6 comes from cvt.rn (fine); %r8 is a shifted integer, through a mov: truncation.
    assert [str(f) for f in ptx_check.check_rounding(instructions, {0: "q"})] == [
        "rounding: q: stored bits computed by shr.u32, not cvt.rn"
    ]
    assert ptx_check.check_no_fma(instructions)[0].check == "no FMA"
    assert ptx_check.access_bits("st.global.v2.b64") == 128 and ptx_check.access_bits("ld.global.b16") == 16
    with pytest.raises(ValueError, match="opcode"):
        ptx_check.access_bits("bar.sync")


def test_spills_are_read_from_local_and_stack_bytes():
    assert ptx_check.check_spills({"REG": 40, "LOCAL": 0, "STACK": 0}, "") == []
    assert ptx_check.check_spills({"REG": 32, "LOCAL": 8, "STACK": 0}, "")[0].check == "spills"
    assert ptx_check.check_spills({"REG": 32, "LOCAL": 0, "STACK": 0}, "st.local.b32 [%rd1], %r1;")


def test_a_head_that_is_not_16_byte_aligned_is_reported_as_narrower_not_passed(tmp_path, monkeypatch):
    """head_dim 72 in bf16: the second half starts 72 bytes in (8-byte aligned), and the JIT hints a stride's
    alignment only when it is a multiple of 16 elements (72 is not), so the compiler cannot prove any vector
    aligned and falls back to 16-bit accesses; the check must say so (the 128-bit result is measured, not
    assumed). Such a head also spills at the register cap (8 bytes a thread on sm_90)."""
    pytest.importorskip("triton")
    from ropekit.backends.triton import rotary_kernel as triton_kernel
    from ropekit.tools import triton_aot

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    constexprs, warps = triton_kernel.kernel_config(
        "bf16", 36, 0, interleaved=False, conjugate=False, rows=0, copy_tail=False
    )
    signature = triton_kernel.signature("bf16", 72, 36, constexprs)
    assert signature["q_stride_h"] == "i32"  # 72 is not a multiple of 16: the JIT gives no hint
    spec = triton_aot.module_spec(triton_kernel, triton_kernel.rotary_kernel, signature, constexprs, warps)
    result = triton_aot.compile_and_check(spec, 90)
    narrow = [f for f in result.findings if f.startswith("vectorised")]
    assert [f.split(":")[1].strip() for f in narrow] == ["q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr"], narrow
    assert all(max(bits) < 128 for bits in result.vector_bits.values()), result.vector_bits
