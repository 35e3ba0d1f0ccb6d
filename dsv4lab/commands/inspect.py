"""``dsv4lab inspect PATH`` — validate a native checkpoint and print its inventory.

Exit status 0 when every expected tensor is present with the right dtype and shape, no shard is truncated or
corrupt and no E8M0 scale byte is 0xFF; otherwise 1, listing every problem (tensor or shard, expected, found).
"""
from __future__ import annotations

import json
import sys

NAME = "inspect"
HELP = "validate a checkpoint (presence, dtype, shape, truncation, NaN scales) and print its inventory"


def add_arguments(p):
    p.add_argument("path", help="checkpoint folder (config.json + index + shards, or model.safetensors)")
    p.add_argument("--no-scan", action="store_true", help="skip the scan of every E8M0 scale byte for 0xFF (NaN)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from ..checkpoint import Checkpoint

    ck = Checkpoint(args.path)
    rep = ck.validate(scan_scales=not args.no_scan, progress=sys.stderr.isatty())
    a = ck.args
    kinds = [a.layer_kind(i) for i in range(a.n_layers)]
    if args.json:
        print(json.dumps(dict(path=str(ck.path), ok=rep.ok, problems=rep.problems, warnings=rep.warnings,
                              config=a.to_hf_config(), files=ck.files, inventory=rep.inventory.to_dict(),
                              layer_kinds=kinds), indent=2))
        return 0 if rep.ok else 1
    print(f"checkpoint   {ck.path}")
    print(f"config       {a.summary()}")
    print(f"shards       {len(ck.files)}")
    print(f"layer kinds  " + " ".join(f"{i}:{k}" for i, k in enumerate(kinds))
          + "".join(f" mtp.{j}:{a.layer_kind(a.n_layers + j)}" for j in range(a.n_mtp_layers)))
    print(rep.inventory.format())
    for w in rep.warnings:
        print(f"warning: {w}")
    if rep.ok:
        print("OK: every expected tensor present with the right dtype and shape"
              + ("" if args.no_scan else ", no NaN (0xFF) scales"))
        return 0
    print(f"FAILED: {len(rep.problems)} problem(s)", file=sys.stderr)
    for pr in rep.problems:
        print(f"  {pr}", file=sys.stderr)
    return 1
