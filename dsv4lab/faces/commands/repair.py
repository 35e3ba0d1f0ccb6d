"""``dsv4lab repair CHECKPOINT --spec SPEC --out DIR`` — write a layout-repaired copy of a checkpoint.

Every tensor a rule of the spec matches is un-permuted (or un-shuffled) on its packed bytes, weight and scale
together; every other tensor and file is copied byte for byte, with the same names, dtypes and sharding. The
copy is written to a temporary folder and renamed; the source is never modified.

For drills, ``--inject-fault NAME`` does the opposite: it writes a copy with a catalogue fault injected
(``--list-faults`` shows them), e.g. the paper's W2 block permutation.
"""
from __future__ import annotations

import sys

from dsv4lab.core.errors import UserError

NAME = "repair"
HELP = "write a copy of a checkpoint with a repair spec applied (or, for drills, a catalogue fault injected)"


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_arguments(p):
    p.add_argument("checkpoint", nargs="?", help="source checkpoint folder (left untouched)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--spec", help="repair spec JSON (written by `dsv4lab fingerprint`)")
    what.add_argument("--inject-fault", metavar="NAME", help="write a faulted copy instead (see --list-faults)")
    what.add_argument("--list-faults", action="store_true", help="list the fault catalogue and exit")
    p.add_argument("--out", help="folder to write the copy to")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--layers", type=_ints, help="with --inject-fault: comma-separated layer indices to hit")
    p.add_argument("--experts", type=_ints, help="with --inject-fault: comma-separated expert indices to hit")
    p.add_argument("--tensors", metavar="GLOB", help="with --inject-fault: linears to hit instead of the fault's own")


def run(args) -> int:
    from dsv4lab.core.layouts import FAULTS, LayoutError, inject_fault_into_checkpoint, repair_checkpoint

    if args.list_faults:
        for f in FAULTS.values():
            scope = f.tensors + (f" layers={list(f.layers)}" if f.layers else "") + (
                f" experts={list(f.experts)}" if f.experts else "")
            print(f"{f.name:<24} {scope}\n    {f.layout.describe()}\n    {f.description}")
        return 0
    if not args.checkpoint or not args.out or not (args.spec or args.inject_fault):
        raise UserError("usage: dsv4lab repair CHECKPOINT (--spec SPEC | --inject-fault NAME) --out DIR")
    progress = sys.stderr.isatty()
    try:
        if args.inject_fault:
            hit = inject_fault_into_checkpoint(args.checkpoint, args.inject_fault, args.out, layers=args.layers,
                                               experts=args.experts, tensors=args.tensors,
                                               overwrite=args.overwrite, progress=progress)
            print(f"injected {args.inject_fault} into {len(hit)} linear(s) (e.g. {hit[0]}); wrote {args.out}")
            return 0
        counts = repair_checkpoint(args.checkpoint, args.spec, args.out, overwrite=args.overwrite, progress=progress)
    except LayoutError as err:
        raise UserError(str(err)) from None
    for rule, n in counts.items():
        print(f"rule {rule}: {n} tensor(s) repaired")
    print(f"wrote {args.out}")
    return 0
