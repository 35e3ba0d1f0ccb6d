"""``dsv4lab fingerprint SUSPECT (--reference DIR | --golden FILE)`` — find permuted layouts, write a repair spec.

Every quantized linear of the suspect checkpoint is treated as ``x ↦ x @ dequant(W)ᵀ`` (one linear dequantized
at a time) and compared with a trusted checkpoint or with recorded activations. Per tensor class (layer and
expert indices folded, e.g. ``layers.*.ffn.experts.*.w2``) the layout found on one member is confirmed on every
other member; members it does not fit are fingerprinted on their own. The result is a repair spec for
``dsv4lab repair`` or ``dsv4lab.load(..., repairs=SPEC)``.

Exit status 0 when every fingerprinted linear is either as the reference or exactly explained by a rule;
1 when some linear is left unexplained (listed with the closest hypothesis).
"""
from __future__ import annotations

import sys
from pathlib import Path

from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import float_range, int_range
from dsv4lab.core.provenance import write_json

NAME = "fingerprint"
HELP = "fingerprint a suspect checkpoint's weight layouts against a trusted one or golden dumps; write a repair spec"


def add_arguments(p):
    p.add_argument("suspect", help="checkpoint folder to examine")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--reference", metavar="DIR", help="trusted checkpoint with the same tensors")
    src.add_argument("--golden", metavar="FILE", help="recorded activations: <linear>.input [n, in] and "
                     "<linear>.output [n, out] (.safetensors, .npz or .pt)")
    p.add_argument("--out", metavar="SPEC",
                   help="repair spec to write (default: runs/fingerprint/<suspect>.repairs.json)")
    p.add_argument("--report", metavar="JSON", help="also write the full per-class report as JSON")
    p.add_argument("--only", metavar="GLOB", action="append",
                   help="only linears matching this glob (repeatable), e.g. '*.ffn.experts.*.w2'")
    p.add_argument("--tol", type=float_range(0, lo_open=True),
                   help="relative residual accepted as a match (default 1e-6 with "
                   "--reference, 0.1 with --golden)")
    p.add_argument("--seed", type=int_range(0), default=0, help="seed of the random probes")


def run(args) -> int:
    from dsv4lab.core.layouts import LayoutError, fingerprint_checkpoint

    try:
        result = fingerprint_checkpoint(args.suspect, reference=args.reference, golden=args.golden, only=args.only,
                                        tol=args.tol, seed=args.seed, progress=sys.stderr.isatty())
    except LayoutError as err:
        raise UserError(str(err)) from None
    out = Path(args.out) if args.out else Path("runs") / "fingerprint" / f"{Path(args.suspect).name}.repairs.json"
    result.spec.source["path"] = str(out)
    result.spec.save(out)
    if args.report:
        write_json(args.report, result.to_json())
    print(result.summary())
    for rule in result.spec.rules:
        print(f"  rule: {rule.selector}: stored as {rule.description}")
    for c in result.classes:
        for d in c.unexplained:
            print(f"UNEXPLAINED {d.summary()}", file=sys.stderr)
    print(f"wrote {out}")
    return 0 if result.ok else 1
