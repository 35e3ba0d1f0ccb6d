"""``dsv4lab inventory PRESET`` — the expected tensor inventory of a preset, allocating no tensor."""
from __future__ import annotations

import json

from dsv4lab.core.config import resolve_args
from dsv4lab.tools.options import add_preset

NAME = "inventory"
HELP = "print the expected checkpoint inventory of a preset or config (no tensors allocated)"


def add_arguments(p):
    add_preset(p, positional=True)
    p.add_argument("--config", help="a config.json or checkpoint folder instead of a preset")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    from dsv4lab.core.checkpoint import inventory
    margs = resolve_args(args.preset, args.config)
    inv = inventory(margs)
    if args.json:
        print(json.dumps(dict(config=args.preset or args.config, **inv.to_dict()), indent=2))
    else:
        print(f"# expected inventory of {args.preset or args.config}: {margs.summary()}")
        print(inv.format())
    return 0
