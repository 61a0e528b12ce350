"""Read a compiled Triton kernel's PTX and resource usage the way the GPU will see them, and check them.

Every check follows data, not text patterns: which global loads and stores touch a given tensor is decided by
tracing registers forward from that tensor's pointer parameter, and where a stored value comes from is decided
by tracing its registers backward to the instruction that produced them. So a planted scalar load or a
truncating store is found wherever it sits in the kernel.

Checks (one :class:`Finding` each when they fail):
    spills: no local memory (``LOCAL`` and ``STACK`` in ``cuobjdump --dump-resource-usage``, no ``.local``
        in the PTX): a register spill goes to local memory, which is DRAM behind the L1.
    registers: at most the budget that keeps full occupancy at the kernel's ``num_warps``
        (:func:`register_budget`: 32 from 2 warps up), or the occupancy its module states as
        ``OCCUPANCY_TARGET`` with its reason.
    vectorised: every global load and store through a named pointer moves at least 128 bits per instruction
        (``ld.global.v4.b32``, ``st.global.v2.b64``, ...).
    rounding: every 16-bit value stored through a named pointer was produced by the hardware
        round-to-nearest-even conversion (``cvt.rn.bf16x2.f32``, ``cvt.rn.f16.f32``, ...) or copied unchanged
        from a global load; never computed in integer arithmetic nor converted with another rounding mode.
    no FMA: no ``fma`` instruction on floats, when the kernel was compiled with ``enable_fp_fusion=False``.
"""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass

__all__ = [
    "MAX_BLOCKS_PER_SM",
    "MAX_THREADS_PER_SM",
    "REGISTERS_PER_SM",
    "Finding",
    "Instruction",
    "access_bits",
    "check_no_fma",
    "check_registers",
    "check_rounding",
    "check_spills",
    "check_vectorised",
    "occupancy",
    "parse_ptx",
    "pointer_accesses",
    "register_budget",
    "resource_usage",
]

# Per-SM limits of compute capability 8.0, 9.0 and 10.0 alike (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability"): 64K 32-bit registers, 2,048 resident threads, 32 resident blocks.
REGISTERS_PER_SM = 65536
MAX_THREADS_PER_SM = 2048
MAX_BLOCKS_PER_SM = 32
# Registers are allocated per warp in units of 256, i.e. per thread in units of 8.
REGISTER_GRANULE = 8


def register_budget(num_warps: int, occupancy: float = 1.0) -> int:
    """The most registers a thread may use while the SM still holds ``occupancy`` of the threads it can hold
    at this ``num_warps``. At full occupancy: 2,048 threads, so 32 registers, from 2 warps a block up; one
    warp a block is capped at 32 blocks, 1,024 threads, so 64."""
    most = min(MAX_THREADS_PER_SM, MAX_BLOCKS_PER_SM * 32 * num_warps)
    block = 32 * num_warps
    threads = -(-int(most * occupancy) // block) * block  # whole blocks
    return REGISTERS_PER_SM // threads // REGISTER_GRANULE * REGISTER_GRANULE


def occupancy(registers: int, num_warps: int) -> float:
    """The share of an SM's 64 warp slots that blocks of ``num_warps`` warps, ``registers`` each, fill."""
    per_block = -(-registers * 32 // 256) * 256 * num_warps  # allocated per warp in units of 256
    blocks = min(MAX_BLOCKS_PER_SM, REGISTERS_PER_SM // per_block, MAX_THREADS_PER_SM // (32 * num_warps))
    return blocks * num_warps * 32 / MAX_THREADS_PER_SM


@dataclass(frozen=True)
class Finding:
    """One failed check: which check, and what was found."""

    check: str
    detail: str

    def __str__(self) -> str:
        return f"{self.check}: {self.detail}"


@dataclass(frozen=True)
class Instruction:
    """One PTX instruction: its opcode, the registers it writes, the registers it reads, and for memory
    instructions the registers of the address. ``line`` is the source text."""

    opcode: str
    dests: tuple[str, ...]
    sources: tuple[str, ...]
    address: tuple[str, ...]
    param: int | None  # ld.param: the kernel parameter index read
    line: str


_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"_param_(\d+)\]")


def _split_operands(text: str) -> list[str]:
    """Operands at top level: commas inside {...} and [...] do not split."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_ptx(ptx: str) -> list[Instruction]:
    """The instructions of the PTX body in order (declarations, labels and directives left out)."""
    out = []
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue
        body = line[:-1].strip()
        if body.startswith("@"):
            body = body.split(None, 1)[1] if " " in body else ""
        if not body:
            continue
        opcode, _, rest = body.partition(" ")
        if not opcode[0].isalpha():
            continue
        operands = _split_operands(rest.replace("\t", " "))
        address = tuple(r for op in operands if op.startswith("[") for r in _REG.findall(op))
        param = _PARAM.search(rest)
        if opcode.startswith(("st.", "red.", "atom.")) or not operands:
            dests, sources = (
                (),
                tuple(r for op in operands if not op.startswith("[") for r in _REG.findall(op)),
            )
        else:
            dests = tuple(_REG.findall(operands[0]))
            sources = tuple(r for op in operands[1:] if not op.startswith("[") for r in _REG.findall(op))
        out.append(Instruction(opcode, dests, sources, address, int(param.group(1)) if param else None, line))
    return out


def _tainted(instructions: list[Instruction], params: set[int]) -> set[str]:
    """Registers whose value depends on one of the parameters (forward data flow, to a fixed point)."""
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ins in instructions:
            if not ins.dests:
                continue
            hit = (ins.param in params) or any(r in tainted for r in ins.sources + ins.address)
            if hit and not set(ins.dests) <= tainted:
                tainted.update(ins.dests)
                changed = True
    return tainted


def pointer_accesses(instructions: list[Instruction], params: set[int]) -> list[Instruction]:
    """The global loads and stores whose address derives from one of the pointer parameters ``params``."""
    tainted = _tainted(instructions, params)
    return [
        ins
        for ins in instructions
        if ins.opcode.startswith(("ld.global", "st.global")) and any(r in tainted for r in ins.address)
    ]


_WIDTH = re.compile(r"\.(?:v(\d+)\.)?[bsuf](\d+)$")


def access_bits(opcode: str) -> int:
    """Bits one load or store instruction moves: ``ld.global.v4.b32`` -> 128, ``st.global.b16`` -> 16."""
    match = _WIDTH.search(opcode)
    if match is None:
        raise ValueError(f"opcode: expected a sized global load or store, got {opcode!r}")
    return int(match.group(1) or 1) * int(match.group(2))


def check_vectorised(instructions, params: dict[int, str], min_bits: int = 128) -> list[Finding]:
    """Every global access through each named pointer parameter moves at least ``min_bits`` a instruction."""
    findings = []
    for index, name in params.items():
        accesses = pointer_accesses(instructions, {index})
        narrow = sorted({ins.opcode for ins in accesses if access_bits(ins.opcode) < min_bits})
        if narrow:
            findings.append(Finding("vectorised", f"{name}: {', '.join(narrow)} (< {min_bits} bits)"))
    return findings


# Instructions that move bits without computing new ones: a stored value is traced through them.
_MOVES = ("mov.", "selp.", "prmt.")
_RNE = re.compile(r"^cvt\.rn\.(?:bf16|f16)(?:x2)?\.f32$")


def check_rounding(instructions, params: dict[int, str]) -> list[Finding]:
    """Every 16-bit-element store through a named pointer stores bits from ``cvt.rn`` (round to nearest even)
    or from a global load (a copy); anything else, such as integer arithmetic, is a finding."""
    defs: dict[str, list[Instruction]] = defaultdict(list)
    for ins in instructions:
        for reg in ins.dests:
            defs[reg].append(ins)
    findings = []
    for index, name in params.items():
        bad: set[str] = set()
        for store in pointer_accesses(instructions, {index}):
            if not store.opcode.startswith("st."):
                continue
            todo, seen = list(store.sources), set()
            while todo:
                reg = todo.pop()
                if reg in seen:
                    continue
                seen.add(reg)
                for ins in defs.get(reg, ()):
                    if ins.opcode.startswith(_MOVES):
                        todo.extend(ins.sources)
                    elif not (_RNE.match(ins.opcode) or ins.opcode.startswith("ld.global")):
                        bad.add(ins.opcode)
        if bad:
            findings.append(
                Finding("rounding", f"{name}: stored bits computed by {', '.join(sorted(bad))}, not cvt.rn")
            )
    return findings


def check_no_fma(instructions) -> list[Finding]:
    """No floating-point FMA (``fma.rn.f32``...; integer ``mad`` is address arithmetic)."""
    fmas = sorted({ins.opcode for ins in instructions if ins.opcode.startswith("fma.")})
    return [Finding("no FMA", f"{', '.join(fmas)} with enable_fp_fusion=False")] if fmas else []


def resource_usage(cubin_path: str, cuobjdump: str) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of one kernel: {"REG": .., "STACK": .., "LOCAL": .., ...}."""
    text = subprocess.run(
        [cuobjdump, "--dump-resource-usage", cubin_path], capture_output=True, text=True, check=True
    ).stdout
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    if "REG" not in found:
        raise ValueError(f"cubin_path: expected one kernel's resource usage, got {text[-300:]!r}")
    return {key: int(value) for key, value in found.items()}


def check_spills(usage: dict[str, int], ptx: str) -> list[Finding]:
    """No local memory: no spill stores or loads, no stack frame."""
    local = usage.get("LOCAL", 0) + usage.get("STACK", 0)
    if local or re.search(r"\.local\b", ptx):
        return [Finding("spills", f"{local} bytes of local memory a thread (LOCAL + STACK)")]
    return []


def check_registers(usage: dict[str, int], num_warps: int, target: float = 1.0) -> list[Finding]:
    """Registers a thread within :func:`register_budget` for the occupancy ``target`` (1.0 unless the kernel
    module states another, with its reason, as ``OCCUPANCY_TARGET``)."""
    budget = register_budget(num_warps, target)
    if usage["REG"] > budget:
        return [
            Finding(
                "registers",
                f"{usage['REG']} a thread > {budget} ({target:.0%} occupancy at {num_warps} warps; "
                f"this gives {occupancy(usage['REG'], num_warps):.0%})",
            )
        ]
    return []
