"""How close the Triton attention kernels are to the reference's two P roundings → data/results/host/attention_rounding.json.

    TRITON_INTERPRET=1 OMP_NUM_THREADS=1 python scripts/compare_attention_rounding.py

Issue 23 made the reference round the attention probabilities as DeepSeek's kernel does: against the running max of
each 64-index block (``Numerics.attention_block=64``) instead of the one final max (``attention_block=0``). For every
decode and prefill kernel variant on 200 selected indices (4 blocks, 20% masked, NaN-poisoned unused rows), this
counts the bf16 outputs that differ from each rounding and the largest difference in bf16 ulps of the reference
(large where the output cancels to near zero). CPU, Triton interpreter: the arithmetic is the kernel's, not the GPU's
MMA order.
"""
import json
import os
import subprocess
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from dsv4lab.engine.triton_backend import kernel_module  # noqa: E402
from dsv4lab.core.model.numerics import Numerics  # noqa: E402
from dsv4lab.core.model.ops import ReferenceOps  # noqa: E402
from dsv4lab.tools.verify.bounds import ulp  # noqa: E402
from dsv4lab.tools.verify.registry import _make_attention  # noqa: E402

SHAPE = dict(b=1, s=4, h=16, d=96, n_kv=260, k=200, masked=0.2)
SEEDS = (0, 1, 2)
attn, ap = kernel_module("attention_decode"), kernel_module("attention_prefill")
DECODE = {
    "decode two-pass block_r=64 splits=1 (interpreter default)": attn.AttentionGeometry(block_h=16, block_r=64),
    "decode online block_r=32 splits=16 (H200 default)": attn.AttentionGeometry(block_h=16, block_r=32, splits=16,
                                                                                 two_pass=False),
    "decode online block_r=64 splits=1": attn.AttentionGeometry(block_h=16, block_r=64, two_pass=False),
}
PREFILL = ("h64n32x", "h64n32", "h64n64")
refs = {"blocks of 64 (new)": ReferenceOps(Numerics()), "one max (old)": ReferenceOps(Numerics(attention_block=0))}


def outputs(q, kv, idx, sink, scale):
    b, s, h, d = q.shape
    out = {name: attn.sparse_attention_decode(q.reshape(b * s, h, d), kv, idx.reshape(b * s, -1),
                                              torch.zeros(b * s, dtype=torch.long), sink, scale,
                                              geometry=g).view(b, s, h, d) for name, g in DECODE.items()}
    default = "h64n32x"
    for cfg in PREFILL:
        out[f"prefill {cfg}" + (" (default)" if cfg == default else "")] = ap.sparse_attention(q, kv, idx, sink, scale,
                                                                                           config=cfg)
    return out


rows: dict[str, dict] = {}
for seed in SEEDS:
    case = _make_attention(SHAPE, torch.Generator().manual_seed(seed), "cpu", Numerics())
    ref_out = {tag: ops.sparse_attention(*case) for tag, ops in refs.items()}
    for name, o in {**outputs(*case), "reference, one max": ref_out["one max (old)"]}.items():
        row = rows.setdefault(name, {tag: dict(differing=0.0, max_ulps=0.0) for tag in refs})
        for tag, r in ref_out.items():
            e = (o.double() - r.double()).abs() / ulp(r, torch.bfloat16)
            row[tag]["differing"] += float((o != r).float().mean()) / len(SEEDS)
            row[tag]["max_ulps"] = max(row[tag]["max_ulps"], float(e.max()))
root = Path(__file__).resolve().parents[1]
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root).stdout.strip()
doc = dict(what="Triton attention kernels (interpreter) vs the reference's P rounding: fraction of bf16 outputs that "
                "differ and the largest difference in bf16 ulps of the reference",
           shape=SHAPE, seeds=list(SEEDS), rows=[dict(variant=k, **{t: {m: round(v, 4) for m, v in d.items()}
                                                                   for t, d in r.items()}) for k, r in rows.items()],
           torch=torch.__version__, commit=commit, command="python scripts/compare_attention_rounding.py")
out = root / "data/results/host/attention_rounding.json"
out.write_text(json.dumps(doc, indent=1) + "\n")
print(f"{'variant':<58}" + "".join(f"{t:>28}" for t in refs))
for k, r in rows.items():
    print(f"{k:<58}" + "".join(f"{r[t]['differing']:>14.1%} {r[t]['max_ulps']:>8.0f} ulp" for t in refs))
print(f"wrote {out}")
