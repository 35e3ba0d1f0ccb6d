"""``dsv4lab inspect PATH`` — validate a native checkpoint and print its inventory.

Exit status 0 when every expected tensor is present with the right dtype and shape, no shard is truncated or
corrupt, the tokenizer (if any) is readable and matches the config, and no stored value is invalid (NaN or Inf in
a floating tensor, a 0xFF E8M0 scale, a NaN FP8 byte, an expert id out of range); otherwise 1, listing every problem
(tensor or shard, expected, found). A shard that cannot be read is one line, with the count of tensors it takes
with it. The value scan reads every byte once (on a terminal, with a progress bar); ``--no-scan`` skips it.

Long lists are summarised, so the output stays readable (and small) whatever the checkpoint: more than
:data:`SHOWN_PROBLEMS` problems are shown as counts per class (shard, missing, dtype, shape, index, tokenizer,
values) with the first few of each, a model of more than :data:`SHOWN_LAYERS` layers as counts per layer kind
with the first few; ``--json`` carries the counts and the first :data:`JSON_PROBLEMS` problems. ``--all`` lists
every problem.
"""
from __future__ import annotations

import json
import sys

NAME = "inspect"
HELP = "validate a checkpoint (presence, dtype, shape, truncation, tokenizer, NaN/Inf values) and print its inventory"
SHOWN_PROBLEMS = 20   # more than this many problems are summarised per class
FIRST_OF_CLASS = 5    # problems shown per class in a summary
SHOWN_LAYERS = 64     # more layers than this are summarised per kind
JSON_PROBLEMS = 200   # problems --json lists (with the counts per class)


def add_arguments(p):
    p.add_argument("path", help="checkpoint folder (config.json + index + shards, or model.safetensors)")
    p.add_argument("--no-scan", action="store_true",
                   help="skip the scan of every stored value (NaN/Inf, 0xFF scales, NaN FP8 bytes, expert ids)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--all", action="store_true", help="list every problem instead of counts per class and the first "
                   f"{FIRST_OF_CLASS} of each (beyond {SHOWN_PROBLEMS} problems)")


def run(args) -> int:
    from dsv4lab.core.checkpoint import Checkpoint

    ck = Checkpoint(args.path)
    rep = ck.validate(scan_values=not args.no_scan, progress=sys.stderr.isatty())
    a = ck.args
    kinds = [a.layer_kind(i) for i in range(a.n_layers)]
    classes = rep.by_class()
    if args.json:
        shown = rep.problems if args.all else rep.problems[:JSON_PROBLEMS]
        print(json.dumps(dict(path=str(ck.path), ok=rep.ok, problem_counts={k: len(v) for k, v in classes.items()},
                              problems=shown, problems_omitted=len(rep.problems) - len(shown),
                              warnings=rep.warnings[:JSON_PROBLEMS], config=a.to_hf_config(), files=ck.files,
                              inventory=rep.inventory.to_dict(), layer_kinds=kinds), indent=2))
        return 0 if rep.ok else 1
    print(f"checkpoint   {ck.path}")
    print(f"config       {a.summary()}")
    print(f"shards       {len(ck.files)}")
    print(f"layer kinds  {_layer_kinds(a, kinds)}")
    print(rep.inventory.format())
    for w in rep.warnings[:SHOWN_PROBLEMS]:
        print(f"warning: {w}")
    if len(rep.warnings) > SHOWN_PROBLEMS:
        print(f"warning: ... and {len(rep.warnings) - SHOWN_PROBLEMS:,} more")
    if rep.ok:
        print("OK: every expected tensor present with the right dtype and shape"
              + (" (values not scanned: --no-scan)" if args.no_scan else ", every stored value valid"))
        return 0
    counts = ", ".join(f"{len(v):,} {k}" for k, v in classes.items())
    print(f"FAILED: {len(rep.problems):,} problem(s)" + (f": {counts}" if len(classes) > 1 else ""), file=sys.stderr)
    if args.all or len(rep.problems) <= SHOWN_PROBLEMS:
        for pr in rep.problems:
            print(f"  {pr}", file=sys.stderr)
        return 1
    for kind, found in classes.items():
        print(f"  {kind} ({len(found):,}):", file=sys.stderr)
        for pr in found[:FIRST_OF_CLASS]:
            print(f"    {pr}", file=sys.stderr)
        if len(found) > FIRST_OF_CLASS:
            print(f"    ... and {len(found) - FIRST_OF_CLASS:,} more", file=sys.stderr)
    print("  (--all lists every problem)", file=sys.stderr)
    return 1


def _layer_kinds(a, kinds: list[str]) -> str:
    """``0:swa 1:csa ... mtp.0:swa``, or for a deep model the count of each kind and the first layers."""
    mtp = [f"mtp.{j}:{a.layer_kind(a.n_layers + j)}" for j in range(a.n_mtp_layers)]
    if len(kinds) <= SHOWN_LAYERS:
        return " ".join([f"{i}:{k}" for i, k in enumerate(kinds)] + mtp)
    counts = ", ".join(f"{kinds.count(k)} {k}" for k in ("swa", "csa", "hca") if k in kinds)
    first = " ".join(f"{i}:{k}" for i, k in enumerate(kinds[:8]))
    return f"{len(kinds)} layers ({counts}) + {len(mtp)} MTP; first {first} ..."
