#!/usr/bin/env python3
"""Compile every Triton kernel specialisation the dispatcher launches, with no GPU, and check the machine code.

    python scripts/triton_resources.py                  # compile, check, print the table; exit 1 on a violation
    python scripts/triton_resources.py --json out.json  # also write every kernel's figures as JSON
    python scripts/triton_resources.py --list           # only list the specialisations (no compiling)

Triton's own compiler and its bundled ``ptxas`` / ``cuobjdump`` run on a CPU-only machine. The
specialisations come from the layout registry through ``triton_kernels.side`` / ``convert_launch`` /
``copy_launches`` (the functions the launch sites call), at page size 64, so a new layout is covered
by construction:

for sm_90 (H100/H200), sm_100 (B200) and sm_120 alike, every launch: encode and decode of each layout,
whole-pool transcode, slot transcode and the integer-E4M3 path for every (source, destination) pair, the
non-finite scan, gather into both FlashMLA scratch layouts, the persistent grid, every byte move
(launches compiling to the same kernel are compiled once, their labels kept).

Checks (a violation exits 1): the compile succeeds; no local memory (the cubin's LOCAL bytes, PTX
``ld/st.local``, SASS ``LDL/STL``; a stack frame nothing loads or stores is only recorded); no fp64
instruction (PTX ``.f64``, SASS ``DADD/DMUL/DFMA``); the hardware E4M3 conversions (``cvt.rn.satfinite.e4m3x2.f32`` to
encode, ``cvt.rn.f16x2.e4m3x2`` to decode) wherever the kernel runs its hardware path on E4M3 bytes,
none on the integer path; 16-byte global accesses (``ld/st.global.v4.b32`` or ``.v2.b64``) where
both sides are 16-byte aligned, for every side holding fp32 rows, bf16 or E4M3 fields, and in the
byte move's data-row range (footer ranges hold 8 bytes per row or less). E2M1 and
UE8M0 are integer bit operations in every kernel (no hardware conversion is claimed), and E2M1
bytes are read one byte per value pair (recorded in the table, not a violation).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, before the kernels are decorated
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its warning)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvbridge.backends import triton_kernels as tk  # noqa: E402
from kvbridge.layouts import Layout, all_layouts, get_layout  # noqa: E402
from kvbridge.layouts.registry import (  # noqa: E402
    OP_BF16,
    OP_E2M1_E4M3,
    OP_E2M1_NVFP4,
    OP_E2M1_NVFP4Z,
    OP_E4M3_TENSOR,
    OP_E4M3_UE8M0,
)

#: Page size of every specialisation (alignment 16 for every registered layout at this size).
PAGE_SIZE = 64
TARGETS = (90, 100, 120)
#: FlashMLA scratch layouts gather-transcode writes (``attention.flashmla``: MODEL1, and the current kernels' cache).
SCRATCH_LAYOUTS = ("flashmla-model1", "v41-fp8-interleaved")
#: Per-SM limits (CUDA programming guide, compute capabilities 9.0 / 10.0 / 12.0): resident blocks, warps,
#: 32-bit registers, shared memory bytes; plus the 1 KiB the runtime reserves per block.
SM_LIMITS = {90: (32, 64, 65536, 233472), 100: (32, 64, 65536, 233472), 120: (32, 48, 65536, 102400)}
RESERVED_SMEM = 1024
#: Fields whose values or scales are E4M3 bytes.
E4M3_OPS = (OP_E4M3_TENSOR, OP_E4M3_UE8M0, OP_E2M1_E4M3, OP_E2M1_NVFP4, OP_E2M1_NVFP4Z)
VECTOR_OPS = (OP_BF16, OP_E4M3_TENSOR, OP_E4M3_UE8M0)  # fields read / written as whole rows of bytes
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass
class Spec:
    """One compiled specialisation: ``kind`` of launch, layouts (None: dense fp32), target and the launch."""

    kind: str
    src: str | None
    dst: str | None
    arch: int
    kernel: str
    constexprs: dict
    num_warps: int
    signature: dict
    also: list[str] = field(default_factory=list)  # other (kind, layouts) labels compiling to the same kernel

    @property
    def label(self) -> str:
        return f"{self.kind} {self.src or 'fp32'} -> {self.dst or 'fp32'}"

    def key(self) -> tuple:
        return self.kernel, self.arch, self.num_warps, repr(sorted(self.constexprs.items())), repr(self.signature)


def _pointer(side: tk.Side) -> str:
    return "*u8" if side.program else "*fp32"


def convert_spec(kind: str, src: Layout | None, dst: Layout | None, arch: int, *, src_slots: bool = False,
                 dst_slots: bool = False, check: bool = False, write: bool = True, hw_fp8: bool = True) -> Spec:
    """A ``_convert_kernel`` launch as ``triton_kernels._launch_convert`` makes it (int32 slot lists)."""
    s, d = tk.side(src, PAGE_SIZE if src else 1), tk.side(dst, PAGE_SIZE if dst else 1)
    launch = tk.convert_launch(s, d, src_slots=src_slots, dst_slots=dst_slots, check=check, write=write,
                               hw_fp8=hw_fp8)
    dummy = _pointer(s)  # the launcher passes the source tensor for absent lists
    sig = {"src": dummy, "src16": "*i16" if s.program else "*fp32", "src_slots": "*i32" if src_slots else dummy,
           "src_cap": "i32", "src_p": "i32", "src_pb": "i32", "src_scale": "fp32",
           "dst": _pointer(d), "dst16": "*i16" if d.program else "*fp32", "dst_slots": "*i32" if dst_slots else dummy,
           "dst_p": "i32", "dst_pb": "i32", "dst_mult": "fp32", "dst_gscale": "fp32", "min_exp": "i32",
           "flags": "*u8" if check else dummy, "n_tokens": "i32", "n_rows": "i32", "n_blocks": "i32"}
    return Spec(kind, src.name if src else None, dst.name if dst else None, arch, "_convert_kernel",
                launch.constexprs, launch.num_warps, sig)


def copy_specs(kind: str, src: Layout, dst: Layout, arch: int, *, src_slots: bool = False, dst_slots: bool = False,
               check: bool = False) -> list[Spec]:
    """The ``_copy_kernel`` launches of one byte move as ``triton_kernels._launch_copy`` makes them."""
    launches = tk.copy_launches(tk.side(src, PAGE_SIZE), tk.side(dst, PAGE_SIZE), src_slots=src_slots,
                                dst_slots=dst_slots, check=check)
    sig = {"src": "*i64", "src_slots": "*i32" if src_slots else "*i64", "src_cap": "i32", "src_p": "i32",
           "src_pw": "i32", "dst": "*i64", "dst_slots": "*i32" if dst_slots else "*i64", "dst_p": "i32",
           "dst_pw": "i32", "flags": "*u8" if check else "*i64", "n_tokens": "i32", "n_rows": "i32"}
    return [Spec(f"{kind} words {c.constexprs['LO']}-{c.constexprs['HI']}", src.name, dst.name, arch,
                 "_copy_kernel", c.constexprs, c.num_warps, sig) for c in launches]


def persistent_spec(src: Layout, dst: Layout, arch: int) -> Spec:
    """Whole-pool transcode on the persistent grid (``convert_programs_per_sm`` set)."""
    saved, tk.convert_programs_per_sm = tk.convert_programs_per_sm, 4
    try:
        return convert_spec("transcode persistent", src, dst, arch, check=True)
    finally:
        tk.convert_programs_per_sm = saved


def _every(arch: int, layouts: list[Layout]) -> list[Spec]:
    """Every launch the dispatcher makes for ``layouts``: all pairs, both FlashMLA scratch layouts, every byte move."""
    scratch = [get_layout(name) for name in SCRATCH_LAYOUTS]
    specs: list[Spec] = []
    for lay in layouts:
        specs.append(convert_spec("encode", None, lay, arch))
        specs.append(convert_spec("decode", lay, None, arch))
        specs.append(convert_spec("nonfinite scan", lay, lay, arch, src_slots=True, check=True, write=False))
        specs += [convert_spec("gather", lay, out, arch, src_slots=True, check=True) for out in scratch]
        for dst in layouts:
            specs.append(convert_spec("transcode", lay, dst, arch, check=True))
            specs.append(convert_spec("transcode_slots", lay, dst, arch, src_slots=True, dst_slots=True))
            specs.append(convert_spec("transcode int-e4m3", lay, dst, arch, check=True, hw_fp8=False))
            if lay.same_record(dst):
                specs += _moves(lay, dst, arch)
    specs.append(persistent_spec(get_layout("trtllm-fp8"), get_layout("flashmla-model1"), arch))
    return specs


def _moves(src: Layout, dst: Layout, arch: int) -> list[Spec]:
    """The three byte moves between identical records: repage, slot copy, gather copy."""
    return (copy_specs("repage", src, dst, arch) + copy_specs("slots byte move", src, dst, arch, src_slots=True,
                                                               dst_slots=True)
            + copy_specs("gather byte move", src, dst, arch, src_slots=True, check=True))


def specialisations() -> list[Spec]:
    """Every launch for every target, duplicates (launches with the same kernel and constants) merged."""
    layouts = [lay for lay in all_layouts() if tk.supports(lay)]
    specs = [spec for arch in TARGETS for spec in _every(arch, layouts)]
    unique: dict[tuple, Spec] = {}
    for spec in specs:
        if spec.key() in unique:
            unique[spec.key()].also.append(spec.label)
        else:
            unique[spec.key()] = spec
    return list(unique.values())


# ----------------------------------------------------------------------------- compile and inspect


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (``ptxas``), user + system."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def compile_one(spec: Spec) -> dict:
    """Compile ``spec`` to PTX and cubin; its resources (``cuobjdump -res-usage``) and instruction counts."""
    fn = getattr(tk, spec.kernel)
    pointers = [n for n, t in spec.signature.items() if t.startswith("*")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}  # 16-byte aligned tensors
    sig = {**spec.signature, **{k: "constexpr" for k in spec.constexprs}}
    started, cpu = time.perf_counter(), _cpu_seconds()
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=spec.constexprs, attrs=attrs),
                                target=GPUTarget("cuda", spec.arch, 32), options={"num_warps": spec.num_warps})
    except Exception as exc:  # a compile error is this specialisation's result (reported as a violation)
        return {"error": f"{type(exc).__name__}: {str(exc)[-2000:]}"}
    seconds, cpu = time.perf_counter() - started, _cpu_seconds() - cpu
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage, sass = (subprocess.run([str(BIN / "cuobjdump"), flag, cubin.name], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    res = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {
        "seconds": round(seconds, 2), "cpu_seconds": round(cpu, 2),
        "regs": res["REG"], "stack": res["STACK"], "local": res["LOCAL"],
        "static_shared": res["SHARED"], "shared": kernel.metadata.shared,
        "ld_v4": _count(r"ld\.global(\.\w+)*\.v(4\.b32|2\.b64)", ptx),
        "st_v4": _count(r"st\.global(\.\w+)*\.v(4\.b32|2\.b64)", ptx),
        "ld_u8": _count(r"ld\.global(\.\w+)*\.(u8|b8)", ptx), "st_u8": _count(r"st\.global(\.\w+)*\.(u8|b8)", ptx),
        "local_ops": _count(r"(ld|st)\.local", ptx) + _count(r"\b(LDL|STL)\b", sass),
        "f64": _count(r"\.f64\b", ptx) + _count(r"\b(DADD|DMUL|DFMA|F2F\.F64)", sass),
        "sass_e4m3_encode": _count(r"F2FP\.SATFINITE\.E4M3", sass), "sass_128": _count(r"\b(LDG|STG)\.E\.128", sass),
        "cvt_e4m3_encode": _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx),
        "cvt_e4m3_decode": _count(r"cvt\.rn\.f16x2\.e4m3x2", ptx),
        "cvt_e2m1": _count(r"e2m1x2", ptx), "cvt_ue8m0": _count(r"ue8m0x2", ptx),
    }


def occupancy(regs: int, shared: int, warps: int, arch: int) -> tuple[int, float]:
    """Resident blocks per SM and the fraction of the SM's warp slots they fill (registers in 256-per-warp units)."""
    max_blocks, max_warps, reg_file, smem = SM_LIMITS[arch]
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = reg_file // (per_warp * warps) if regs else max_blocks
    blocks = min(max_blocks, max_warps // warps, by_regs, smem // (shared + RESERVED_SMEM))
    return blocks, blocks * warps / max_warps


def _ops(name: str | None) -> set[int]:
    return {seg.op for seg in get_layout(name).segments} if name else set()


def violations(spec: Spec, r: dict) -> list[str]:
    """What is wrong with one compiled specialisation (empty: it passes)."""
    if "error" in r:
        return [f"compile error: {r['error'][:300]}"]
    bad = []
    if r["local"] or r["local_ops"]:  # a stack frame that nothing loads or stores is recorded, not a spill
        bad.append(f"local memory: LOCAL {r['local']} B, {r['local_ops']} local loads / stores (PTX ld/st.local, "
                   "SASS LDL/STL)")
    if r["f64"]:
        bad.append(f"{r['f64']} fp64 instructions")
    if spec.kernel == "_copy_kernel":
        c = spec.constexprs
        # the data-row range starts 16-byte aligned; footer ranges (8 B per row and less) cannot be 16-byte
        if c["LO"] == 0 and c["HI"] >= 2 and c["SRC_WA"] == 2 and c["DST_WA"] == 2 and not (r["ld_v4"] and r["st_v4"]):
            bad.append("byte move lost its 16-byte loads / stores")
        return bad
    c = spec.constexprs
    src_ops, dst_ops = _ops(spec.src), _ops(spec.dst)
    if c["HW_FP8"]:
        if c["WRITE"] and dst_ops & set(E4M3_OPS) and not r["cvt_e4m3_encode"]:
            bad.append("no cvt.rn.satfinite.e4m3x2.f32 on the hardware E4M3 encode path")
        if src_ops & set(E4M3_OPS) and not r["cvt_e4m3_decode"]:
            bad.append("no cvt.rn.f16x2.e4m3x2 on the hardware E4M3 decode path")
    elif r["cvt_e4m3_encode"] or r["cvt_e4m3_decode"]:
        bad.append("hardware E4M3 conversion on the integer path")
    if c["SRC_ALIGN"] == 16 and c["DST_ALIGN"] == 16:
        if (not spec.src or src_ops & set(VECTOR_OPS)) and not r["ld_v4"]:
            bad.append("source rows lost their 16-byte loads")
        if c["WRITE"] and (not spec.dst or dst_ops & set(VECTOR_OPS)) and not r["st_v4"]:
            bad.append("destination rows lost their 16-byte stores")
    return bad


def run(specs: list[Spec], jobs: int) -> list[dict]:
    """Compile ``specs`` on ``jobs`` processes; one result row per specialisation."""
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        results = list(pool.map(compile_one, specs))
    rows = []
    for spec, r in zip(specs, results, strict=True):
        row = {**asdict(spec), "label": spec.label, **r, "violations": violations(spec, r)}
        row["constexprs"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.constexprs.items()}
        if "error" not in r:
            row["blocks_per_sm"], row["occupancy"] = occupancy(r["regs"], r["shared"], spec.num_warps, spec.arch)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown resource table: one line per (kind, target), ranges over its specialisations; spills count
    local-memory bytes and instructions, the last two columns how many kernels have 16-byte loads / stores
    and the hardware E4M3 encode / decode conversion."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "error" not in row:
            groups.setdefault((row["kind"].split(" words")[0], row["arch"]), []).append(row)
    lines = ["| kernel kind | target | kernels | warps | registers | shared B | blocks/SM | occupancy | spills "
             "| stack B | 16-B ld / st | e4m3 cvt enc / dec |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def span(values) -> str:
        lo, hi = min(values), max(values)
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    for (kind, arch), items in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        n = len(items)
        vec = f"{sum(bool(i['ld_v4']) for i in items)}/{n} / {sum(bool(i['st_v4']) for i in items)}/{n}"
        cvt = f"{sum(bool(i['cvt_e4m3_encode']) for i in items)} / {sum(bool(i['cvt_e4m3_decode']) for i in items)}"
        occ = span([round(100 * i["occupancy"]) for i in items])
        lines.append(f"| {kind} | sm_{arch} | {len(items)} | {span([i['num_warps'] for i in items])} "
                     f"| {span([i['regs'] for i in items])} | {span([i['shared'] for i in items])} "
                     f"| {span([i['blocks_per_sm'] for i in items])} | {occ}% "
                     f"| {sum(i['local'] + i['local_ops'] for i in items)} | {span([i['stack'] for i in items])} "
                     f"| {vec} | {cvt} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write every specialisation's figures to this JSON file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes (default: CPUs)")
    parser.add_argument("--list", action="store_true", help="list the specialisations only")
    args = parser.parse_args(argv)
    specs = specialisations()
    if args.list:
        for spec in specs:
            also = f" (also {', '.join(spec.also)})" if spec.also else ""
            print(f"sm_{spec.arch} {spec.kernel} {spec.label}{also}")
        print(f"{len(specs)} specialisations")
        return 0
    started = time.perf_counter()
    rows = run(specs, args.jobs)
    seconds = time.perf_counter() - started
    print(table(rows))
    bad = [(row["arch"], row["label"], v) for row in rows for v in row["violations"]]
    for arch, label, v in bad:
        print(f"VIOLATION sm_{arch} {label}: {v}")
    cpu = sum(row.get("cpu_seconds", 0.0) for row in rows)
    print(f"{len(rows)} specialisations compiled in {seconds:.0f} s on {args.jobs} processes, {cpu:.0f} CPU-s "
          f"(Triton {triton.__version__}); {len(bad)} violations")
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "page_size": PAGE_SIZE, "seconds": seconds,
                                         "cpu_seconds": cpu,
                                         "kernels": rows}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
