"""Compile the routed-MoE decode (``kernels/dsv4lab_kernels/fp4_moe_decode.py``) for a GPU target on a machine
without one and count the K loop's instructions per weight byte: today's best route beside the ``fp8lut`` route.

The launchers run at DeepSeek-V4-Flash widths (D 4096, I 2048, 6 of 8 experts: the code does not depend on their
number) on CPU tensors with every Triton launch compiled for ``--target`` instead of run — the machinery of
``scripts/compile_prefill_moe.py`` (the JIT's GPU signature, the wheel's ptxas, the TTGIR check that the inline-PTX
table decode gets four bytes of one weight group per call: exit 1 if not). Per kernel it reports registers, spilled
bytes, shared memory, the MMA of the PTX and the K loop's SASS mix, per iteration and thread, and **per weight
byte** (``instructions × 32 × warps / bytes the iteration reads``) — a model of the issue cost, not a time: an
H200 SM issues 128 thread-instructions a clock and must retire ~16 weight bytes a clock to stream at the measured
copy bandwidth, so ≲ 8 per byte can keep up (``scripts/kernel_sass.py`` states the arithmetic). Rows: 1 and 8
(the fma route re-reads its tiles once per row, from L2; the MMA routes take up to 16 rows in one pass).

    python scripts/compile_decode_moe.py [--target cuda:90] [--quick] [--json]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the sibling script's machinery (importing it pops TRITON_INTERPRET)
from compile_prefill_moe import compile_launches, parse_target_args  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

BYTES_PER_ITERATION = {
    # kernel: weight bytes one K-loop iteration reads (params: its launch constexprs)
    "_moe_up_kernel": lambda p: 2 * p["BN"] * p["BK"] // 2,  # w1 and w3, BN rows × BK/2 packed bytes each
    "_moe_down_expert_kernel": lambda p: p["BN"] * p["BK"] // 2,
    "_moe_up_lut_kernel": lambda p: 2 * p["BN"] * 64,  # one 128-wide K tile of 2·BN rows (gate's, then up's)
    "_moe_down_lut_kernel": lambda p: p["BN"] * 64,
}

CONFIGS = [
    # (route, MoeGeometry fields, label): the H200's tuned batch-1 choice first
    # (kernels/dsv4lab_kernels/tuned/h200.json), then the fp8lut variants of kernel_families.MOE (the quick ones first)
    ("fma", dict(block_n_up=8, block_n_down=8, block_k=256, num_warps=1, num_stages=2, decode="bytewise",
                 prequant=True), "fma bytewise prequant n8 w1 s2 (tuned at batch 1)"),
    ("fp8lut", dict(block_n_up=64, block_n_down=64, block_k=128, num_warps=4, num_stages=3), "fp8lut n64 w4 s3"),
    ("fp8lut", dict(block_n_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=3, lut_ref="tile"),
     "fp8lut n32x64 w4 s3 tile-ref"),
    ("fp8lut", dict(block_n_up=32, block_n_down=64, block_k=128, num_warps=4, num_stages=3), "fp8lut n32x64 w4 s3"),
    ("fp8lut", dict(block_n_up=64, block_n_down=128, block_k=128, num_warps=8, num_stages=3),
     "fp8lut n64x128 w8 s3"),
    ("fp8lut", dict(block_n_up=16, block_n_down=16, block_k=128, num_warps=1, num_stages=3), "fp8lut n16 w1 s3"),
    ("fp8lut", dict(block_n_up=32, block_n_down=32, block_k=128, num_warps=2, num_stages=3), "fp8lut n32 w2 s3"),
    ("fp8lut", dict(block_n_up=16, block_n_down=16, block_k=128, num_warps=1, num_stages=3, decode="plain"),
     "fp8lut n16 w1 s3 portable decode"),
]


def decode_calls(configs, rows=(1, 8)) -> list:
    """(name, thunk) per configuration and row count: the whole routed MoE of one decode step."""
    from dsv4lab.core.config import get_preset
    from dsv4lab.core.model.linear import ExpertBank
    from dsv4lab_kernels import fp4_moe_decode as moe
    from dsv4lab_kernels import fp4_moe_fp8lut as fl
    fl.decode_asm = lambda name, device: name != "portable"  # no GPU here to probe the inline PTX on
    moe._use_asm = lambda geo, ex, device: geo.decode != "plain"
    a = get_preset("flash")
    E, D, I, k = 8, a.dim, a.moe_inter_dim, a.n_activated_experts
    bank = ExpertBank(E, D, I, "fp4")
    for name, (n, kk) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
        bank._buffers[name] = torch.zeros(E, n, kk // 2, dtype=torch.uint8)
        bank._buffers[f"{name}_scale"] = torch.full((E, n, kk // 32), 120, dtype=torch.uint8)
    ex = moe.ExpertTensors.of(bank)
    calls = []
    for T in rows:
        idx = torch.stack([torch.arange(t, t + k) % E for t in range(T)])
        x, w = torch.zeros(T, D, dtype=torch.bfloat16), torch.full((T, k), 0.25)
        for route, fields, label in configs:
            geo = moe.MoeGeometry(**fields)
            calls.append((f"{label}, {T} row{'s' if T > 1 else ''}", lambda route=route, geo=geo, x=x, idx=idx, w=w:
                          moe.routed_moe_decode(x, idx, w, ex, a.swiglu_limit, route, geo)))
    return calls


def per_byte(row: dict) -> float | None:
    """K-loop instructions per weight byte of a compiled row (None: not a weight-streaming kernel)."""
    f = BYTES_PER_ITERATION.get(row["kernel"])
    if f is None or not row.get("k_loop"):
        return None
    return row["k_loop"]["instructions"] * 32 * row["params"]["num_warps"] / f(row["params"])


def main(argv=None) -> int:
    args, target = parse_target_args(__doc__.splitlines()[0], "today's best and the first fp8lut geometry, one row",
                                     argv, sass=False)
    calls = decode_calls(CONFIGS[:2], rows=(1,)) if args.quick else decode_calls(CONFIGS)
    rows = compile_launches(target, calls, sass=target.backend == "cuda", any_loop=True)
    for r in rows:
        if r["ok"]:
            r["per_weight_byte"] = per_byte(r)
    ok = bool(rows) and all(r["ok"] and r.get("asm_packs_one_group") is not False for r in rows)
    if args.json:
        print(json.dumps(dict(target=args.target, triton=triton.__version__, kernels=rows), indent=1))
        return 0 if ok else 1
    print(f"Triton {triton.__version__}, target {args.target}; K-loop SASS per iteration and thread, and per weight "
          f"byte (compiled instruction counts, not times)")
    packs = {None: "", True: ", table decode packs one group per call", False: ", TABLE DECODE PACKS CROSS GROUPS"}
    for r in rows:
        if not r["ok"]:
            print(f"FAIL {r['call']}: {r['kernel']}: {r['error']}")
            continue
        if r["kernel"] not in BYTES_PER_ITERATION:
            continue  # the activation quantizers and the combine: not weight streams
        loop = dict(r.get("k_loop") or {})
        n = loop.pop("instructions", None)
        pb = r.get("per_weight_byte")
        print(f"{r['call']}: {r['kernel']} registers {r.get('registers')}, spilled {r.get('spill_bytes')} B, smem "
              f"{r['shared']} B, MMA {', '.join(r['mma']) or 'none'}{packs[r['asm_packs_one_group']]}\n"
              f"    K loop: {n} instructions, {'-' if pb is None else f'{pb:.2f}'} per weight byte; {loop}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
