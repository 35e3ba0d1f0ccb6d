"""Whether the prefill GEMM kernels give the same bits on every call: each weight-stationary GEMM configuration
(bf16 activations, FP8 weights upcast in registers, the grouped ``wo_a`` shape of
``tests/test_kernels_prefill_gemm.py``) and each FP8 block GEMM configuration is called ``--repeats`` times on one
input; a kernel with no cross-program communication must return identical bits every time. Per configuration:
the number of distinct outputs, the calls with a non-finite element and the worst error over the analytic bound.
Exit 0 always (a diagnostic, not a gate); ``--out`` writes the rows as JSON.

    python scripts/diag_gemm_determinism.py [--repeats 20] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from dsv4lab.engine.triton_prefill import accumulation_bound
from dsv4lab.core.provenance import short_commit
from dsv4lab.tools.verify.bounds import check_within_bound
from dsv4lab.tools.verify.registry import fp8_linear_case, grouped_wo_a_case
from dsv4lab_kernels import fp8_gemm as fg

def repeat(name: str, call, ref, mag, terms: int, accumulation: str, repeats: int) -> dict:
    first = call()
    distinct, nonfinite, worst = 1, 0, 0.0
    seen = [first]
    for i in range(repeats):
        y = first if i == 0 else call()
        torch.cuda.synchronize()
        nonfinite += int(not torch.isfinite(y.float()).all())
        if i and not any(torch.equal(y, s) for s in seen):
            distinct += 1
            seen.append(y)
        res = check_within_bound(y.view(ref.shape), ref, mag, out_dtype=torch.bfloat16, name=name,
                                 **accumulation_bound(terms, accumulation))
        worst = max(worst, float(res.max_ratio))
    row = dict(kernel=name, repeats=repeats, distinct_outputs=distinct, calls_with_nonfinite=nonfinite,
               max_error_over_bound=round(worst, 3), deterministic=distinct == 1)
    print(f"{name:34s} distinct {distinct:3d}/{repeats}  non-finite calls {nonfinite:3d}  "
          f"max error/bound {worst:.3g}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("diag_gemm_determinism: needs a CUDA GPU", file=sys.stderr)
        return 0
    g = torch.Generator().manual_seed(13)  # the inputs of tests/test_kernels_prefill_gemm.py's GPU wo_a case
    o, lin, ref, mag = grouped_wo_a_case(g, "cuda")
    M, G, K = o.shape
    rows = []
    for cfg in fg.WEIGHT_GEMM_CONFIGS:
        rows.append(repeat(f"weight_gemm wo_a {cfg}", lambda: fg.weight_gemm(o, lin.weight, lin.scale,
                                                                             torch.bfloat16, G, config=cfg),
                           ref, mag, K, "tc_bf16", a.repeats))
    x, w, ref2, mag2 = fp8_linear_case(g, 1024, K, "cuda")
    for cfg in fg.FP8_GEMM_CONFIGS:
        rows.append(repeat(f"fp8_linear {cfg}", lambda: fg.fp8_linear(x, w.weight, w.scale, config=cfg),
                           ref2, mag2, K, "tc_fp8", a.repeats))
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=short_commit(),
               triton=__import__("triton").__version__, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
