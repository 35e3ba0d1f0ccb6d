"""``dsv4lab make-checkpoint`` — write a random checkpoint in exactly the native format.

Deterministic: the bytes depend only on the config and ``--seed`` (each tensor is generated from
(seed, tensor name)), so rerunning gives identical files. ``data/tiny`` is regenerated with::

    dsv4lab make-checkpoint --preset tiny --seed 0 --out data/tiny --overwrite

The disk must have room for every byte before anything is written (a refusal names the folder, what is needed and
what is free).
"""
from __future__ import annotations

import sys
from pathlib import Path

from dsv4lab.core.config import resolve_args
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_preset, int_range
from dsv4lab.core.paths import DEFAULT_TOKENIZER, require
from dsv4lab.core.resources import require_disk_space

NAME = "make-checkpoint"
HELP = "write a seeded random checkpoint (native names, dtypes, shapes, shards, index)"


def add_arguments(p):
    g = p.add_mutually_exclusive_group(required=True)
    add_preset(p, group=g)
    g.add_argument("--config", help="config.json (or a checkpoint folder) to take the architecture from")
    p.add_argument("--seed", type=int_range(0), default=0)
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--shards", type=int_range(1), default=None, help="number of shards (default: >= 2, <= 4 GiB each)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json to copy in (default for the tiny preset: data/tokenizers/pystdlib-bpe-4096.json)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args) -> int:
    from dsv4lab.core.checkpoint import inventory, make_random_checkpoint

    margs = resolve_args(args.preset, args.config)
    tok = args.tokenizer
    if tok is None and args.preset == "tiny":
        tok = require(DEFAULT_TOKENIZER, "the tiny preset's default tokenizer")
    if tok is not None and not Path(tok).exists():
        raise UserError(f"--tokenizer {tok}: no such file")
    inv = inventory(margs)
    require_disk_space(Path(args.out).absolute().parent, inv.total_bytes, f"writing {Path(args.out).name}")
    print(f"writing {inv.tensors:,} tensors, {inv.total_bytes:,} bytes to {args.out} (seed {args.seed})",
          file=sys.stderr)
    out = make_random_checkpoint(margs, args.seed, args.out, n_shards=args.shards, tokenizer=tok,
                                 overwrite=args.overwrite, progress=sys.stderr.isatty())
    print(f"wrote {out}")
    return 0
