"""Compile the grouped prefill MoE's ``fp8lut`` route for a GPU target on a machine without one, and read what it
emits.

The route's launchers (``kernels/dsv4lab_kernels/fp4_moe_grouped.py`` → ``fp4_moe_fp8lut.py``) are called at
DeepSeek-V4-Flash widths (D 4096, I 2048; two experts: the code does not depend on their number) on CPU tensors;
every Triton launch is intercepted and compiled (``triton.compile`` with the wheel's own ptxas) for ``--target``
instead of run, with the signature the JIT would give it on a GPU (``native_specialize_impl``: 16-divisible
integers and aligned tensors, the value 1 as a constant — the asynchronous copies' widths depend on it). Per kernel
and configuration it reports registers and spilled bytes per thread, shared memory, the MMA instructions of the
PTX (an FP8 wgmma reads ``wgmma.mma_async…e4m3.e4m3``), whether the inline-PTX table decode gets four bytes of one
weight group per call in the layout Triton chose (:func:`asm_packs_one_group`; exit 1 if not) and, with
``--sass``, the instruction mix of the K loop (per 128-wide K tile and thread: a model of the issue cost, not a
time). Must run without ``TRITON_INTERPRET``; on the GPU machine it reads what that machine's Triton emits.

    python scripts/compile_prefill_moe.py [--target cuda:90] [--sass] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "launch_pdl", "maxnreg")
SASS_OPS = ("QGMMA", "HGMMA", "QMMA", "HMMA", "PRMT", "LOP3", "SHF", "IMAD", "FFMA", "FMUL", "FADD", "HFMA2", "LDS",
            "LDSM", "STS", "LDG", "LDGSTS", "BAR", "LDL", "STL")
MMA_OPS = ("QGMMA", "HGMMA", "QMMA", "HMMA", "IMMA")
TABLE_DECODE_MARK = "prmt.b32 sel, lo, hi, 0x6420"
"""A line of the table decode's inline PTX (``fp4_moe_fp8lut._DECODE_E4M3_PTX``): the calls the layout check is for."""


def _backend(target: GPUTarget):
    if target.backend == "cuda":
        from triton.backends.nvidia.compiler import CUDABackend
        return CUDABackend
    from triton.backends.amd.compiler import HIPBackend
    return HIPBackend


def _source(fn: JITFunction, args, kwargs, target: GPUTarget) -> ASTSource:
    """``fn``'s launch as the JIT would specialize it on a GPU of ``target``'s kind."""
    backend = _backend(target)
    values = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k in fn.arg_names}
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name] if p.name in values else p.default
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
            continue
        kind, spec = native_specialize_impl(backend, v, False, not p.do_not_specialize, True)
        sig[p.name] = kind
        if kind == "constexpr":
            consts[p.name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs)


def _bin(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _resources(kernel) -> dict:
    """Registers and local-memory stack per thread (``cuobjdump -res-usage`` of the cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        res = subprocess.run([_bin("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([_bin("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(stack.group(1)) if stack else None,
                sass=sass)


def k_loop_mix(sass: str, any_loop: bool = False) -> dict:
    """The opcode counts of the innermost loop that issues an MMA (the K loop), per iteration and thread; with
    ``any_loop``, where no loop issues one (the CUDA-core routes), the largest innermost loop (a weight-streaming
    kernel's K loop)."""
    rows = [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    spans = []
    for addr, ins in rows:
        t = re.search(r"BRA\s+0x([0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            spans.append((int(t.group(1), 16), addr))
    loops = []
    for lo, hi in spans:
        ops = Counter((i.split()[1] if i.startswith("@") else i.split()[0]).split(".")[0]
                      for a, i in rows if lo <= a <= hi)
        innermost = not any(lo <= a < b <= hi and (a, b) != (lo, hi) for a, b in spans)
        loops.append((ops, innermost))
    with_mma = [ops for ops, _ in loops if any(ops[m] for m in MMA_OPS)]
    if with_mma:
        ops = min(with_mma, key=lambda c: sum(c.values()))
    elif any_loop and any(inner for _, inner in loops):
        ops = max((ops for ops, inner in loops if inner), key=lambda c: sum(c.values()))
    else:
        return {}
    return dict(instructions=sum(ops.values()), **{op: ops[op] for op in SASS_OPS if ops[op]})


def asm_packs_one_group(ttgir: str, mark: str | None = None) -> bool | None:
    """Whether every inline-PTX table decode (``tt.elementwise_inline_asm`` with four packed elements) gets four
    consecutive bytes of one weight row per call — what its single table per call assumes (the four bytes lie in
    one 16-byte group then: the packs are 4-aligned). Read from the layout of its operands in the TTGIR: a blocked
    layout with the bytes' axis fastest and a multiple of 4 of them per thread, a dot operand with ``kWidth`` a
    multiple of 4, or a linear layout whose first two register bases step the byte axis by 1 and 2. None where the
    kernel has no such call. ``mark``: only the calls whose PTX holds this text (the table decode's, not the fma
    route's E2M1 decodes, which take no table)."""
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    verdicts = []
    for line in re.findall(r"tt\.elementwise_inline_asm.*packed_element = 4.*", ttgir):
        if mark is not None and mark not in line:
            continue
        for shape, name in re.findall(r"tensor<([\dx]+)xi8, (#ttg\.\w+<\{[^}]*\}>|#\w+)", line):
            rank, spec = len(shape.split("x")), layouts.get(name, name)
            if spec.startswith("#ttg.blocked"):
                per = [int(v) for v in re.search(r"sizePerThread = \[([\d, ]+)\]", spec).group(1).split(",")]
                order = [int(v) for v in re.search(r"order = \[([\d, ]+)\]", spec).group(1).split(",")]
                verdicts.append(order[0] == rank - 1 and per[-1] % 4 == 0)
            elif "dot_op" in spec:
                verdicts.append(int(re.search(r"kWidth = (\d+)", spec).group(1)) % 4 == 0)
            elif spec.startswith("#ttg.linear"):
                regs = re.search(r"register = \[(.*?)\]\], lane", spec)
                first = re.findall(r"\[([\d, ]+)\]", regs.group(1) + "]") if regs else []
                unit = [0] * (rank - 1)
                verdicts.append(len(first) >= 2 and first[0].replace(" ", "") == ",".join(map(str, unit + [1]))
                                and first[1].replace(" ", "") == ",".join(map(str, unit + [2])))
            else:
                verdicts.append(False)
    return None if not verdicts else all(verdicts)


def compile_launches(target: GPUTarget, calls, sass: bool = False, any_loop: bool = False) -> list[dict]:
    """Run ``calls`` ((name, thunk) pairs) with every Triton launch compiled for ``target`` instead of executed.
    Each row keeps the launch's ``num_warps`` and integer constexprs (``params``: the tile sizes a per-byte count
    needs); ``any_loop``: the K-loop mix of kernels without an MMA too (:func:`k_loop_mix`)."""
    rows = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        t0 = time.perf_counter()
        try:
            k = triton.compile(_source(self, args, kwargs, target), target=target, options=options)
            params = {"num_warps": options.get("num_warps", 4)} | {
                n: v for n, v in kwargs.items() if n.isupper() and isinstance(v, int)}
            row = dict(call=current[0], kernel=self.__name__, ok=True, seconds=round(time.perf_counter() - t0, 1),
                       shared=k.metadata.shared, params=params,
                       mma=sorted(set(re.findall(r"wgmma\.mma_async[\w.]*|mma\.sync[\w.]*", k.asm.get("ptx", "")))),
                       asm_packs_one_group=asm_packs_one_group(k.asm.get("ttgir", ""), TABLE_DECODE_MARK))
            if target.backend == "cuda":
                res = _resources(k)
                code = res.pop("sass")
                row.update(res)
                if sass:
                    row["k_loop"] = k_loop_mix(code, any_loop)
            rows.append(row)
        except Exception as err:  # noqa: BLE001 — report every kernel, not only the first failure
            rows.append(dict(call=current[0], kernel=self.__name__, ok=False, error=f"{type(err).__name__}: "
                             + " | ".join(str(err).strip().splitlines()[-4:])[:2000]))
        return None

    current = [""]
    JITFunction.run = compile_only
    try:
        for name, thunk in calls:
            current[0] = name
            before = len(rows)
            try:
                thunk()
            except Exception as err:  # noqa: BLE001 — a launcher failing after a compiled launch is not a kernel error
                if len(rows) == before:
                    rows.append(dict(call=name, kernel="-", ok=False, error=f"launcher: {type(err).__name__}: {err}"))
    finally:
        JITFunction.run = original
    return rows


def fp8lut_calls(configs) -> list:
    """(name, thunk) per configuration ``(rows, warps, stages, decode, lut_ref)`` of the route's two stages at
    Flash widths, and the route's helper kernels."""
    from dsv4lab.core.config import get_preset
    from dsv4lab.core.model.linear import ExpertBank
    from dsv4lab_kernels import fp4_moe_fp8lut as fl
    from dsv4lab_kernels import fp4_moe_grouped as fm
    from dsv4lab_kernels.moe_sort import sort_by_expert_reference
    fl.decode_asm = lambda name, device: name != "portable"  # no GPU here to probe the inline PTX on
    a = get_preset("flash")
    E, D, I, T, k = 2, a.dim, a.moe_inter_dim, 64, a.n_activated_experts
    bank = ExpertBank(E, D, I, "fp4")
    for name, (n, kk) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        bank._buffers[name] = torch.zeros(E, n, kk // 2, dtype=torch.uint8)
        bank._buffers[f"{name}_scale"] = torch.full((E, n, kk // 32), 120, dtype=torch.uint8)
    idx = torch.arange(T * k).remainder(E).view(T, k)
    xv, xs = torch.zeros(T, D, dtype=torch.float8_e4m3fn), torch.ones(T, D // 128)  # quantized activations
    w = torch.ones(T * k)
    calls = []
    for rows, warps, stages, decode, ref in configs:
        geo = fm.MoEGeometry(rows=rows, warps1=warps, warps2=warps, stages1=stages, stages2=stages, decode=decode,
                             lut_ref=ref)
        routing = sort_by_expert_reference(idx, E, rows)  # the sorter's outputs without launching its kernels
        tag = f"rows {rows}, {warps} warps, {stages} stages, {decode} decode, ref {ref}"
        calls.append((f"gate/up {tag}", lambda geo=geo, routing=routing: fm.gate_up(
            xv, xs, bank, routing, "fp8lut", geo, w, 10.0, fuse=True)))
        h = torch.zeros(routing.sorted_slots.shape[0], I, dtype=torch.float8_e4m3fn)
        hs = torch.zeros(I // 128, routing.sorted_slots.shape[0]).t()
        calls.append((f"down {tag}", lambda geo=geo, routing=routing, h=h, hs=hs: fm.down(
            h, hs, bank, routing, "fp8lut", geo, T * k)))
    wb, d = fl.decode_probe_inputs("cpu")
    calls.append(("table decode probe (inline PTX)", lambda: fl.decode(wb, d, True)))
    return calls


DEFAULT_CONFIGS = [(64, 8, 3, "asm", "tile"), (128, 8, 3, "asm", "tile"), (64, 8, 3, "asm", "row"),
                   (64, 8, 3, "portable", "tile")]
"""(sorter rows, warps, stages, decode, reference) compiled by default: the route's default launch, its 128-row
blocks, the per-row reference and the portable decode (the bench times all four: kernel_families.PREFILL_MOE)."""


def parse_target_args(description: str, quick_help: str, argv=None, sass: bool = True):
    """The compile scripts' command line (``--target``, ``--quick``, ``--json``; ``--sass`` where the mix is
    optional): ``(args, GPUTarget)``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--target", default="cuda:90", help="backend:arch, e.g. cuda:90 (H200)")
    if sass:
        p.add_argument("--sass", action="store_true", help="also the K loop's instruction mix (CUDA targets)")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    backend, arch = args.target.split(":")
    return args, GPUTarget(backend, int(arch) if arch.isdigit() else arch, 32 if backend == "cuda" else 64)


def main(argv=None) -> int:
    args, target = parse_target_args(__doc__.splitlines()[0], "only the default launch (rows 64, asm, tile)", argv)
    rows = compile_launches(target, fp8lut_calls(DEFAULT_CONFIGS[:1] if args.quick else DEFAULT_CONFIGS), args.sass)
    if args.json:
        print(json.dumps(dict(target=args.target, triton=triton.__version__, kernels=rows), indent=1))
    else:
        print(f"Triton {triton.__version__}, target {args.target}")
        for r in rows:
            if not r["ok"]:
                print(f"FAIL {r['call']}: {r['kernel']}: {r['error']}")
                continue
            packs = {None: "", True: ", table decode packs: one group each", False: ", TABLE DECODE PACKS CROSS ROWS"}
            print(f"ok   {r['call']}: {r['kernel']} {r['seconds']} s, registers {r.get('registers')}, spilled "
                  f"{r.get('spill_bytes')} B, smem {r['shared']} B, MMA {', '.join(r['mma']) or 'none'}"
                  f"{packs[r['asm_packs_one_group']]}")
            if r.get("k_loop"):
                print(f"       K loop per 128-wide tile and thread (modelled): {r['k_loop']}")
    return 0 if rows and all(r["ok"] and r.get("asm_packs_one_group") is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
