"""Where the INT8 MoE route departs from its own oracle on a GPU: each stage's verdict across launch geometries
(warps, K step, rows per program, token count), and a bare batched int8 ``tl.dot`` [G, N, 32]·[G, 32, T]
against an exact integer product. Prints one line per case; exit 0 always (a diagnostic, not a gate).

    python scripts/diag_int8_moe.py [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from dsv4lab.tools.bench.decode import moe_stage_checks
from dsv4lab.tools.verify.registry import make_bank, routing
from dsv4lab_kernels import fp4_moe_decode as moe


@triton.jit
def _batched_int8_dot(a_ptr, b_ptr, o_ptr, G: tl.constexpr, N: tl.constexpr, T: tl.constexpr):
    g = tl.arange(0, G)
    n = tl.arange(0, N)
    i = tl.arange(0, 32)
    t = tl.arange(0, T)
    a = tl.load(a_ptr + g[:, None, None] * (N * 32) + n[None, :, None] * 32 + i[None, None, :])
    b = tl.load(b_ptr + g[:, None, None] * (32 * T) + i[None, :, None] * T + t[None, None, :])
    d = tl.dot(a, b, out_dtype=tl.int32)
    tl.store(o_ptr + g[:, None, None] * (N * T) + n[None, :, None] * T + t[None, None, :], d)


def bare_dot(G, N, T, warps):
    a = torch.randint(-127, 128, (G, N, 32), dtype=torch.int8, device="cuda")
    b = torch.randint(-127, 128, (G, 32, T), dtype=torch.int8, device="cuda")
    o = torch.empty(G, N, T, dtype=torch.int32, device="cuda")
    _batched_int8_dot[(1,)](a, b, o, G, N, T, num_warps=warps)
    want = torch.bmm(a.double(), b.double()).to(torch.int32)
    return int((o != want).sum())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="")
    a = p.parse_args()
    rows = []
    for G, N, T, w in [(8, 16, 16, 1), (8, 16, 16, 2), (8, 32, 16, 2), (8, 16, 16, 4), (2, 16, 16, 1), (4, 64, 16, 4)]:
        bad = bare_dot(G, N, T, w)
        rows.append({"case": f"bare dot G{G} N{N} T{T} w{w}", "wrong": bad})
        print(rows[-1], flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cpu = torch.Generator().manual_seed(1)
    bank = make_bank(8, 4096, 2048, cpu, device="cuda")
    ex = moe.ExpertTensors.of(bank)
    geos = [moe.MoeGeometry(), moe.MoeGeometry(block_n_up=16, block_n_down=16, num_warps=1, num_stages=2),
            moe.MoeGeometry(num_warps=4), moe.MoeGeometry(block_k=128), moe.MoeGeometry(num_stages=1),
            moe.MoeGeometry(decode="plain"), moe.MoeGeometry(slot_split=1)]
    for T in (1, 4):
        idx, w = routing(cpu, T, 8, 6)
        idx, w = idx.cuda(), w.cuda()
        x = (torch.randn(T, 4096, device="cuda", generator=gen) * 2).to(torch.bfloat16)
        for geo in geos:
            try:
                res = moe_stage_checks(x, idx, w, ex, "int8", geo, 10.0, name="int8")
                verdict = {r.name.split(" ", 1)[-1]: (r.ok, round(r.max_ratio, 2), r.n_violations) for r in res}
            except Exception as e:  # noqa: BLE001 — a diagnostic records every failure
                verdict = {"error": f"{type(e).__name__}: {e}"[:300]}
            rows.append({"T": T, "geometry": repr(geo), "stages": verdict})
            print(rows[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
