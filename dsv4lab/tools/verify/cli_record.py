"""``dsv4lab verify record --checkpoint DIR`` — record the golden oracles of a checkpoint (reference backend)."""
from __future__ import annotations

from pathlib import Path

from dsv4lab.tools.options import add_device, resolve_device
from dsv4lab.tools.verify.model import golden_path_for, record_golden

HELP = "record golden oracles (fixed-id oracles, 256-token hash, teacher-forced data, layer digests) for a checkpoint"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", default=None, help="golden JSON (default data/golden/<checkpoint folder name>.json)")
    p.add_argument("--dump-layers", default=None, metavar="FILE",
                   help="also write per-expert linear input/output dumps (safetensors) for layout fingerprinting")
    add_device(p, default="cpu")  # goldens are recorded on the CPU unless asked otherwise


def run(args) -> int:
    out = Path(args.out) if args.out else golden_path_for(args.checkpoint)
    g = record_golden(args.checkpoint, out, args.dump_layers, resolve_device(args.device))
    print(f"recorded {len(g['oracles'])} oracles, a {g['trajectory']['n_tokens']}-token trajectory "
          f"(hash {g['trajectory']['hash']}), {len(g['teacher_forced']['ids'])} teacher-forced positions and "
          f"{len(g['layers']['order'])} layer digests into {out}")
    if args.dump_layers:
        print(f"linear dumps in {args.dump_layers}")
    return 0
