"""Compile the decode kernels for an NVIDIA target without a GPU and count what the hardware would execute.

Triton's NVIDIA backend (with its bundled ``ptxas`` and ``cuobjdump``) compiles a kernel to a cubin on any machine;
this script does that for the routed-MoE decode and FP8 GEMV configurations the benchmark times, and reports per
kernel: registers, local-memory spill stack, and for the main loop the SASS instructions per weight byte, with the
instruction mix. It is a *model* of the GPU cost (instruction counts, not time): the H200 issues 128 thread
instructions per clock per SM and must retire ~16 weight bytes per clock per SM to stream at the copy bandwidth
measured there (4.2 TB/s over 132 SMs at ~1.98 GHz), so ≲ 8 instructions per byte can keep up and more cannot.

    python scripts/kernel_sass.py                 # the table (about a minute)
    python scripts/kernel_sass.py --check         # exit 1 if a kernel fails to compile (no GPU needed)
    python scripts/kernel_sass.py --signatures    # each configuration's arguments against its kernel (CI: seconds)
    python scripts/kernel_sass.py --only moe_up   # one family
    python scripts/kernel_sass.py --glue          # the mHC site and the attention kernels: every loop's mix

Must run without ``TRITON_INTERPRET`` (the kernels must be real JIT functions); the versions of Triton here and on
the GPU machine may differ (3.9 here, 3.6 there), so treat the counts as the same code's shape, not its exact SASS.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("kernel_sass.py: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
KERNELS_DIR = ROOT / "kernels" / "dsv4lab_kernels"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402


def _kernels(name: str):
    """``dsv4lab_kernels.<name>`` — installed, or from ``kernels/`` of this tree (not through the engine's
    loader: importing the engine on a machine without a GPU selects the interpreter)."""
    import importlib
    import importlib.util
    if importlib.util.find_spec("dsv4lab_kernels") is None:
        spec = importlib.util.spec_from_file_location("dsv4lab_kernels", KERNELS_DIR / "__init__.py",
                                                      submodule_search_locations=[str(KERNELS_DIR)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["dsv4lab_kernels"] = mod
        spec.loader.exec_module(mod)
    return importlib.import_module(f"dsv4lab_kernels.{name}")


moe = _kernels("fp4_moe_decode")
gemv = _kernels("fp8_gemv")

TARGET = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

# Flash shapes: D=4096, I=2048, 6 of 256 experts; every integer argument the JIT would see as divisible by 16 is
# declared so (the JIT specializes on it: vectorized loads depend on it).
MOE_INTS = ("D", "I", "n_local", "stride_we", "stride_wn", "stride_se", "stride_sn")


WITH_PDL = False  # --pdl: compile with the programmatic-dependent-launch prologue (kernels/dsv4lab_kernels/launch.py)


SIGNATURES_ONLY = False  # --signatures: check each configuration's arguments against its kernel, compile nothing


def _check_signature(fn, signature: dict, constexprs: dict) -> None:
    """Every parameter of ``fn`` named by the configuration and no other name (a kernel that gained a parameter
    would otherwise fail to compile only when this script is run), in the kernel's order (the divisibility hints
    are given by position)."""
    params = {p.name for p in fn.params}
    given = set(signature) | set(constexprs)
    missing, unknown = sorted(params - given), sorted(given - params)
    if missing or unknown:
        raise ValueError(f"{fn.__name__}: missing {missing}, unknown {unknown}")
    order = [p.name for p in fn.params if p.name in signature]
    if list(signature) != order:
        raise ValueError(f"{fn.__name__}: arguments out of the kernel's order: {list(signature)} against {order}")


def _compile(fn, signature: dict, constexprs: dict, div16, num_warps: int, num_stages: int):
    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in div16}
    constexprs = dict(constexprs)
    if WITH_PDL and any(p.name == "PDL" for p in fn.params):
        constexprs.setdefault("PDL", True)
    for p in fn.params:  # constexpr parameters with a default (e.g. PDL = False) take it
        if p.is_constexpr and p.name not in constexprs and p.default is not inspect.Parameter.empty:
            constexprs[p.name] = p.default
    if SIGNATURES_ONLY:
        return _check_signature(fn, signature, constexprs)
    for c in constexprs:
        signature[c] = "constexpr"
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))


def _sass(cubin: bytes) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return sass, res


def _loops(sass: str) -> list[tuple[int, int, Counter]]:
    """(start, end, opcode counts) of every backward branch's body, innermost first."""
    rows = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, ins in rows:
        t = re.search(r"BRA\s+0x([0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            lo = int(t.group(1), 16)
            ops = Counter()
            for a, i in rows:
                if lo <= a <= addr:
                    op = i.split()[1] if i.startswith("@") else i.split()[0]
                    ops[op.split(".")[0]] += 1
            loops.append((lo, addr, ops))
    return loops


def moe_up(route: str, bn: int, bk: int, warps: int, stages: int, T: int = 1, asm: bool = True, aq: bool = True,
           elem: bool = False, bytewise: bool = False):
    tq = triton.next_power_of_2(T)
    tp = max(tq, 16) if route != "fma" else tq
    sig = {"x_ptr": "*bf16", "idx_ptr": "*i64", "rw_ptr": "*fp32", "w1_ptr": "*u8", "w3_ptr": "*u8",
           "s1_ptr": "*u8", "s3_ptr": "*u8", "h_ptr": "*bf16", "g_ptr": "*bf16", "u_ptr": "*bf16", "T": "i32",
           "D": "i32", "I": "i32", "expert_offset": "i32", "n_local": "i32", "limit": "fp32", "stride_we": "i32",
           "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32"}
    cx = dict(TOPK=6, TQ=tq, TP=tp, KP=8, PP=triton.next_power_of_2(6 * T), ROUTE=moe.ROUTES.index(route), ASM=asm,
              ACT_QUANT=aq, WRITE_GU=False, ROUND_ACT=True, HAS_LIMIT=True, DOT_FP32=False, BN=bn, BK=bk,
              FMA_ELEM=elem, BYTEWISE=bytewise)
    k = _compile(moe._moe_up_kernel, sig, cx, MOE_INTS, warps, stages)
    return k, 2 * bn * bk // 2  # bytes of w1 and w3 per loop step


def moe_down(route: str, bn: int, bk: int, warps: int, stages: int, T: int = 1, asm: bool = True,
             aq: bool = True, elem: bool = False, bytewise: bool = False):
    tq = triton.next_power_of_2(T)
    tp = max(tq, 16) if route != "fma" else tq
    sig = {"h_ptr": "*bf16", "idx_ptr": "*i64", "w2_ptr": "*u8", "s2_ptr": "*u8", "out_ptr": "*fp32", "T": "i32",
           "D": "i32", "I": "i32", "expert_offset": "i32", "n_local": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_se": "i32", "stride_sn": "i32"}
    cx = dict(TOPK=6, TQ=tq, TP=tp, KP=8, PP=triton.next_power_of_2(6 * T), ROUTE=moe.ROUTES.index(route), ASM=asm,
              ACT_QUANT=aq, ROUND_ACT=True, DOT_FP32=False, BN=bn, BK=bk, FMA_ELEM=elem, BYTEWISE=bytewise)
    k = _compile(moe._moe_down_expert_kernel, sig, cx, MOE_INTS, warps, stages)
    return k, bn * bk // 2


def gemv_kernel(route: str, bn: int, bk: int, warps: int, stages: int, M: int = 1, w_fp8: bool = True,
                act_quant: bool = True, unroll: int = 1, prequant: bool = False, fma_rows: int = 1):
    tq, tp = gemv.token_blocks(M, route, fma_rows=fma_rows)
    sig = {"x_ptr": "*fp8e4nv" if prequant else "*bf16", "xs_ptr": "*fp32",
           "w_ptr": "*fp8e4nv" if w_fp8 else "*bf16", "s_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "n_per_group": "i32", "stride_xm": "i32",
           "stride_xg": "i32", "stride_xs": "i32", "stride_wn": "i32", "stride_sn": "i32", "SPLIT_K": "i32",
           "B1": "i32", "B2": "i32", "B3": "i32", "u_ptr": "*bf16", "limit": "fp32"}
    cx = dict(W_FP8=w_fp8, ACT_QUANT=act_quant and not prequant, PREQUANT=prequant, ROUTE=gemv.ROUTES.index(route),
              OUT_BF16=True, DOT_FP32=False, TQ=tq, TP=tp, BN=bn, BK=bk, KU=unroll, BLOCK_S=16)
    k = _compile(gemv._fp8_gemv_kernel, sig, cx, ("N", "K", "n_per_group", "stride_xm", "stride_xg", "stride_wn",
                                                  "stride_sn"), warps, stages)
    return k, bn * bk * unroll * (1 if w_fp8 else 2)


# name, builder, args: the configurations the benchmark times (see dsv4lab/engine/kernel_families.py)
CONFIGS = [
    ("moe_up dot asm n16 k256 w1 s2 b1", moe_up, ("dot", 16, 256, 1, 2)),
    ("moe_up dot asm n32 k256 w2 s3 b1", moe_up, ("dot", 32, 256, 2, 3)),
    ("moe_up dot asm n64 k256 w4 s2 b1", moe_up, ("dot", 64, 256, 4, 2)),
    ("moe_up dot asm n64 k256 w4 s2 b8", moe_up, ("dot", 64, 256, 4, 2, 8)),
    ("moe_up dot plain n32 k256 w2 s3 b1", moe_up, ("dot", 32, 256, 2, 3, 1, False)),
    ("moe_up fma asm n16 k256 w1 s2 b1", moe_up, ("fma", 16, 256, 1, 2)),
    ("moe_up fma asm n8 k256 w1 s2 b1", moe_up, ("fma", 8, 256, 1, 2)),
    ("moe_up fma asm elem n8 k256 w1 s2 b1", moe_up, ("fma", 8, 256, 1, 2, 1, True, True, True)),
    ("moe_up fma asm elem prequant n8 k256 w1 s2 b1", moe_up, ("fma", 8, 256, 1, 2, 1, True, False, True)),
    ("moe_up fma asm prequant n8 k256 w1 s2 b1", moe_up, ("fma", 8, 256, 1, 2, 1, True, False)),
    ("moe_up fma bytewise prequant n8 k256 w1 s2 b1", moe_up, ("fma", 8, 256, 1, 2, 1, True, False, False, True)),
    ("moe_up int8 n16 k256 w1 s2 b1", moe_up, ("int8", 16, 256, 1, 2)),
    ("moe_up dot_scaled n16 k256 w1 s2 b1", moe_up, ("dot_scaled", 16, 256, 1, 2)),
    ("moe_down dot asm n32 k256 w2 s3 b1", moe_down, ("dot", 32, 256, 2, 3)),
    ("moe_down fma asm n8 k256 w1 s2 b1", moe_down, ("fma", 8, 256, 1, 2)),
    ("moe_down fma asm elem n8 k256 w1 s2 b1", moe_down, ("fma", 8, 256, 1, 2, 1, True, True, True)),
    ("moe_down fma asm elem prequant n8 k256 w1 s2 b1", moe_down, ("fma", 8, 256, 1, 2, 1, True, False, True)),
    ("moe_down fma asm prequant n8 k256 w1 s2 b1", moe_down, ("fma", 8, 256, 1, 2, 1, True, False)),
    ("moe_down fma bytewise prequant n8 k256 w1 s2 b1", moe_down, ("fma", 8, 256, 1, 2, 1, True, False, False, True)),
    ("moe_down dot asm n64 k256 w4 s2 b8", moe_down, ("dot", 64, 256, 4, 2, 8)),
    ("moe_up dot asm prequant n64 k256 w4 s2 b8", moe_up, ("dot", 64, 256, 4, 2, 8, True, False)),
    ("moe_down dot asm prequant n64 k256 w4 s2 b8", moe_down, ("dot", 64, 256, 4, 2, 8, True, False)),
    ("gemv fma n32 k256 w4 s3 b1", gemv_kernel, ("fma", 32, 256, 4, 3)),
    ("gemv fma n16 k512 w4 s3 b1", gemv_kernel, ("fma", 16, 512, 4, 3)),
    ("gemv fma n64 k256 w8 s3 b1", gemv_kernel, ("fma", 64, 256, 8, 3)),
    ("gemv fma n16 k256 w4 s3 u2 b1", gemv_kernel, ("fma", 16, 256, 4, 3, 1, True, True, 2)),
    ("gemv fma n32 k256 w4 s3 u2 b1", gemv_kernel, ("fma", 32, 256, 4, 3, 1, True, True, 2)),
    # the fma route with several rows per weight tile (GemvGeometry.fma_rows): the per-row share of the loop
    ("gemv fma n16 k256 w4 s3 r2 b2", gemv_kernel, ("fma", 16, 256, 4, 3, 2, True, True, 1, False, 2)),
    ("gemv fma n16 k128 w4 s3 r4 b4", gemv_kernel, ("fma", 16, 128, 4, 3, 4, True, True, 1, False, 4)),
    ("gemv fma n16 k128 w4 s3 b1", gemv_kernel, ("fma", 16, 128, 4, 3)),
    ("gemv fma n64 k256 w8 s3 r2 b2", gemv_kernel, ("fma", 64, 256, 8, 3, 2, True, True, 1, False, 2)),
    ("gemv fma n32 k256 w4 s3 r2 b2", gemv_kernel, ("fma", 32, 256, 4, 3, 2, True, True, 1, False, 2)),
    ("gemv fma n64 k256 w8 s3 r4 b4", gemv_kernel, ("fma", 64, 256, 8, 3, 4, True, True, 1, False, 4)),
    ("gemv fma n32 k256 w8 s3 r4 b4", gemv_kernel, ("fma", 32, 256, 8, 3, 4, True, True, 1, False, 4)),
    ("gemv fma n64 k128 w4 s3 r4 b4", gemv_kernel, ("fma", 64, 128, 4, 3, 4, True, True, 1, False, 4)),
    ("gemv dot n16 k256 w1 s3 b1", gemv_kernel, ("dot", 16, 256, 1, 3)),
    ("gemv dot n64 k256 w4 s4 b1", gemv_kernel, ("dot", 64, 256, 4, 4)),
    ("gemv dot n64 k256 w4 s3 b8", gemv_kernel, ("dot", 64, 256, 4, 3, 8)),
    ("gemv dot prequant n64 k256 w4 s3 b8", gemv_kernel, ("dot", 64, 256, 4, 3, 8, True, True, 1, True)),
    ("gemv dot bf16-act n16 k256 w1 s3 b1", gemv_kernel, ("dot", 16, 256, 1, 3, 1, True, False)),
    ("gemv dot bf16-weight n32 k256 w2 s3 b1", gemv_kernel, ("dot", 32, 256, 2, 3, 1, False, False)),
]


# ------------------------------------------------------------------------------------------ latency-bound glue
MHC_INTS = ("D", "PER", "sx_m", "sx_s", "so_m", "sxn_m", "sxn_s", "sfn", "sy_m")


def mhc_site(splits: int = 128, block_d: int = 32, block_dn: int = 2048, warps: int = 8, split_tail: bool = False):
    """The one-launch mHC site (``hc_post_pre_norm`` at Flash width: 4 streams, 24 mixing logits)."""
    mhc = _kernels("mhc")
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "xn_ptr": "*bf16",
           "fn_ptr": "*fp32", "part_ptr": "*fp64", "cnt_ptr": "*i32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
           "w_ptr": "*bf16", "y_ptr": "*bf16", "post_out_ptr": "*fp32", "comb_out_ptr": "*fp32",
           "slot_ptr": "*bf16", "idx_ptr": "*bf16", "sh_ptr": "*bf16", "D": "i32",  # (the MoE-output pointers: unused)
           "NMIX": "i32", "SPLITS": "i32", "PER": "i32", "ITERS": "i32", "norm_eps": "fp32", "hc_eps_bits": "i64",
           "sx_m": "i32", "sx_s": "i32", "so_m": "i32", "sxn_m": "i32", "sxn_s": "i32", "sfn": "i32", "sy_m": "i32",
           "M": "i32", "n_shared": "i32", "expert_offset": "i32", "n_local": "i32"}
    cx = dict(APPLY_POST=True, HEAD=False, NORM=True, ROUND_BF16=True, HC=4, BLOCK_D=block_d, BLOCK_J=32,
              BLOCK_S=triton.next_power_of_2(splits), BLOCK_DN=block_dn, SPLIT_TAIL=split_tail)
    return _compile(mhc._mhc_site_kernel, sig, cx, MHC_INTS, warps, 1)


MIX_SIG = {"x_ptr": "*bf16", "out_ptr": "*bf16", "post_ptr": "*fp32", "comb_ptr": "*fp32", "xn_ptr": "*bf16",
           "fn_ptr": "*fp32", "part_ptr": "*fp64", "M": "i32", "D": "i32", "NMIX": "i32", "SPLITS": "i32",
           "sx_m": "i32", "sx_s": "i32", "so_m": "i32", "sxn_m": "i32", "sxn_s": "i32", "sfn": "i32"}
MIX_INTS = ("D", "sx_m", "sx_s", "so_m", "sxn_m", "sxn_s", "sfn")


def mhc_mix(rows_kernel: bool, block_m: int, block_d: int, warps: int, post: bool = False):
    """The mHC mix of a prefill chunk: the decode kernels' mix (``rows_kernel=False``) or the rows kernel."""
    mhc = _kernels("mhc")
    fn = mhc._mhc_mix_rows_kernel if rows_kernel else mhc._mhc_mix_kernel
    cx = dict(APPLY_POST=post, MIX=True, ROUND_BF16=True, HC=4, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_J=32)
    sig = dict(MIX_SIG, fn_ptr="*fp64") if rows_kernel else dict(MIX_SIG)  # the rows kernel gets the matrix widened
    return _compile(fn, sig, cx, MIX_INTS, warps, 1)


ATTN_INTS = ("D", "stride_qr", "stride_qh", "stride_ba", "stride_na", "stride_bb", "stride_nb", "stride_ra",
             "stride_rb")


def attention(block_h: int = 16, block_r: int = 32, warps: int = 8, two_pass: bool = False):
    """The sparse attention decode's main kernel (Flash: 512-wide latent head, RoPE epilogue, CSA prefix)."""
    attn = _kernels("attention_decode")
    sig = {"q_ptr": "*bf16", "kva_ptr": "*bf16", "rows_a_ptr": "*i32", "bat_a_ptr": "*i64", "kvb_ptr": "*bf16",
           "rows_b_ptr": "*i32", "bat_b_ptr": "*i64", "sink_ptr": "*fp32", "out_ptr": "*bf16", "pm_ptr": "*fp32",
           "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64",
           "H": "i32", "D": "i32", "Ka": "i32", "Kb": "i32", "scale": "fp32", "R": "i32", "s_cos": "i32",
           "RATIO_B": "i32", "stride_qr": "i32", "stride_qh": "i32", "stride_ba": "i32", "stride_na": "i32",
           "stride_bb": "i32", "stride_nb": "i32", "stride_ra": "i32", "stride_rb": "i32", "SPLITS": "i32",
           "cnt_ptr": "*i32"}
    cx = dict(ROUND_ACT=True, DOT_FP32=False, TWO_PASS=two_pass, ROPE=True, PREFIX_B=True, BLOCK_H=block_h,
              BLOCK_R=block_r, BLOCK_D=512)
    return _compile(attn._attn_decode_kernel, sig, cx, ATTN_INTS, warps, 3)


def attention_combine(splits: int = 16, block_h: int = 16, warps: int = 8):
    """The split combine, with the launcher's column block for ``splits`` slices."""
    attn = _kernels("attention_decode")
    sig = {"pm_ptr": "*fp32", "pl_ptr": "*fp32", "pacc_ptr": "*fp32", "sink_ptr": "*fp32", "out_ptr": "*bf16",
           "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "H": "i32", "D": "i32", "R": "i32",
           "s_cos": "i32", "stride_qr": "i32", "stride_qh": "i32", "SPLITS": "i32"}
    block_s = triton.next_power_of_2(splits)
    cx = dict(ROUND_ACT=True, ROPE=True, BLOCK_H=block_h, BLOCK_S=block_s,
              BLOCK_DC=max(16, min(512, 16384 // (block_s * block_h))))
    return _compile(attn._attn_combine_kernel, sig, cx, ("D",), warps, 3)


GLUE = [("mhc_site n128 d32 f2048 w8 (the default at batch 1)", mhc_site, ()),
        ("mhc_site n64 d32 f2048 w8", mhc_site, (64,)),
        ("mhc_site n128 d32 f2048 w8 split tail", mhc_site, (128, 32, 2048, 8, True)),
        ("mhc mix of a prefill chunk, decode kernels: 4 rows x 16 columns, 4 warps", mhc_mix, (False, 4, 16, 4)),
        ("mhc mix of a prefill chunk, rows kernel: 16 rows x 16 columns, 8 warps", mhc_mix, (True, 16, 16, 8)),
        ("mhc mix of a prefill chunk, rows kernel: 32 rows x 8 columns, 8 warps", mhc_mix, (True, 32, 8, 8)),
        ("mhc mix of a prefill chunk, rows kernel: 16 rows x 8 columns, 4 warps", mhc_mix, (True, 16, 8, 4)),
        ("mhc mix of a prefill chunk, rows kernel: 64 rows x 4 columns, 4 warps", mhc_mix, (True, 64, 4, 4)),
        ("mhc post+mix of a prefill chunk, rows kernel: 16 rows x 8 columns, 4 warps", mhc_mix,
         (True, 16, 8, 4, True)),
        ("attention h16 r32 w8 one pass (the GPU default)", attention, ()),
        ("attention h16 r64 w8 one pass", attention, (16, 64)),
        ("attention combine, 16 slices", attention_combine, ()),
        ("attention combine, 32 slices", attention_combine, (32,))]


def report_glue() -> int:
    """Per kernel: registers, spill stack, instructions in all, and every loop (innermost first) with its size and
    the operations that make latency — block barriers, warp shuffles, calls (the fp64 division's slow path),
    global loads — beside its six most frequent opcodes."""
    print(f"Triton {triton.__version__}, target sm_{TARGET.arch}; the latency-bound glue (modelled from the SASS)")
    failures = 0
    for name, build, args in GLUE:
        try:
            k = build(*args)
        except Exception as err:  # noqa: BLE001 — report every configuration that does not compile
            failures += 1
            print(f"{name}: FAILED: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        sass, res = _sass(k.asm["cubin"])
        regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
        total = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", line))
        print(f"{name}: regs {regs.group(1) if regs else '?'}, stack {stack.group(1) if stack else '?'}, "
              f"{total} instructions, {sass.count('LDG')} global loads")
        for lo, hi, ops in _loops(sass):
            mix = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
            print(f"    loop {lo:#06x}-{hi:#06x}: {sum(ops.values())} instructions; BAR {ops['BAR']}, SHFL "
                  f"{ops['SHFL']}, CALL {ops['CALL']}, LDG {ops['LDG']}; {mix}")
    return 1 if failures else 0


def report(only: str | None, check: bool) -> int:
    failures = 0
    print(f"Triton {triton.__version__}, target sm_{TARGET.arch}; instructions per weight byte of the main loop "
          f"(≲ 8 keeps up with the H200 copy bandwidth: modelled)")
    print(f"{'kernel':<40}{'regs':>6}{'stack':>7}{'instr/B':>9}  main-loop mix")
    for name, build, args in CONFIGS:
        if only and not name.startswith(only):
            continue
        warps = args[3]
        try:
            k, step_bytes = build(*args)
        except Exception as err:  # noqa: BLE001 — report every configuration that does not compile
            failures += 1
            print(f"{name:<40} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            continue
        if check:
            print(f"{name:<40} compiles")
            continue
        sass, res = _sass(k.asm["cubin"])
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        loops = _loops(sass)
        if not loops:
            print(f"{name:<40}{regs.group(1) if regs else '?':>6}{stack.group(1) if stack else '?':>7}   (no loop)")
            continue
        lo, hi, ops = max(loops, key=lambda t: sum(t[2].values()))  # the weight-streaming loop is the largest
        per_byte = sum(ops.values()) * warps * 32 / step_bytes
        mix = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        print(f"{name:<40}{regs.group(1) if regs else '?':>6}{stack.group(1) if stack else '?':>7}"
              f"{per_byte:>9.2f}  {mix}")
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only compile; exit 1 if any configuration fails")
    p.add_argument("--only", default=None, help="configurations whose name starts with this")
    p.add_argument("--glue", action="store_true", help="the mHC site and attention kernels: every loop's mix")
    p.add_argument("--pdl", action="store_true", help="with the PDL prologue: where its wait (ACQBULK) sits against "
                   "the first global load, per kernel")
    p.add_argument("--signatures", action="store_true", help="only check that each configuration names every "
                   "parameter of its kernel (no compilation: seconds; CI)")
    a = p.parse_args()
    if a.signatures:
        return check_signatures()
    if a.pdl:
        return report_pdl()
    return report_glue() if a.glue else report(a.only, a.check)


def check_signatures() -> int:
    """Each configuration's arguments against its kernel's parameters, nothing compiled: one line per mismatch."""
    global SIGNATURES_ONLY
    SIGNATURES_ONLY = True
    bad = 0
    for name, build, args in CONFIGS + GLUE:
        try:
            build(*args)
        except Exception as err:  # noqa: BLE001 — every configuration is reported
            bad += 1
            print(f"{name}: {type(err).__name__}: {err}")
    print(f"{len(CONFIGS) + len(GLUE) - bad} of {len(CONFIGS) + len(GLUE)} configurations name their kernel's "
          "parameters")
    return 1 if bad else 0


def report_pdl() -> int:
    """Each configuration compiled with ``PDL=True``: the index of its ``griddepcontrol.wait`` (SASS ``ACQBULK``)
    and of its first global load — the wait must come first, or the kernel could read its predecessor's output
    before it is written."""
    global WITH_PDL
    WITH_PDL = True
    print(f"Triton {triton.__version__}, target sm_{TARGET.arch}; kernels compiled with the PDL prologue")
    bad = 0
    for name, build, args in CONFIGS + GLUE:
        k = build(*args)
        k = k[0] if isinstance(k, tuple) else k
        if "PDL" not in k.src.fn.arg_names:
            print(f"{name:<58} no PDL parameter: launched without PDL")
            continue
        sass, _ = _sass(k.asm["cubin"])
        ops = [m.group(1) for m in (re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
                                    for line in sass.splitlines()) if m]
        wait = next((i for i, op in enumerate(ops) if op.startswith("ACQBULK")), None)
        load = next((i for i, op in enumerate(ops) if op.startswith(("LDG", "LDGSTS", "UBLKCP", "UTMALDG"))), None)
        ok = wait is not None and (load is None or wait < load)
        bad += not ok
        print(f"{name:<58} wait at instruction {wait}, first global load at {load}: {'ok' if ok else 'WRONG'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
