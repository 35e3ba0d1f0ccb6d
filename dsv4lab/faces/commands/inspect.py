"""``dsv4lab inspect PATH`` — validate a native checkpoint and print its inventory.

Exit status 0 when every expected tensor is present with the right dtype and shape, no shard is truncated or
corrupt, the tokenizer (if any) is readable and matches the config, and no stored value is invalid (NaN or Inf in
a floating tensor, a 0xFF E8M0 scale, a NaN FP8 byte, an expert id out of range); otherwise 1, listing every problem
(tensor or shard, expected, found). A shard that cannot be read is one line, with the count of tensors it takes
with it. The value scan reads every byte once (on a terminal, with a progress bar); ``--no-scan`` skips it.
"""
from __future__ import annotations

import json
import sys

NAME = "inspect"
HELP = "validate a checkpoint (presence, dtype, shape, truncation, tokenizer, NaN/Inf values) and print its inventory"


def add_arguments(p):
    p.add_argument("path", help="checkpoint folder (config.json + index + shards, or model.safetensors)")
    p.add_argument("--no-scan", action="store_true",
                   help="skip the scan of every stored value (NaN/Inf, 0xFF scales, NaN FP8 bytes, expert ids)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from dsv4lab.core.checkpoint import Checkpoint

    ck = Checkpoint(args.path)
    rep = ck.validate(scan_values=not args.no_scan, progress=sys.stderr.isatty())
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
              + (" (values not scanned: --no-scan)" if args.no_scan else ", every stored value valid"))
        return 0
    print(f"FAILED: {len(rep.problems)} problem(s)", file=sys.stderr)
    for pr in rep.problems:
        print(f"  {pr}", file=sys.stderr)
    return 1
