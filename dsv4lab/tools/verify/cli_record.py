"""``dsv4lab verify record --checkpoint DIR`` — record the golden oracles of a checkpoint (reference backend).

A golden file is a committed reference: an existing one is never replaced without ``--force`` (the refusal names
the checkpoint it was recorded from), and the new one is written whole or not at all. The checkpoint's content
hashes go into the file; ``verify model`` and ``verify layers`` refuse a golden found for a checkpoint whose
content differs (:func:`dsv4lab.tools.verify.model.require_recorded_from`).
"""
from __future__ import annotations

from pathlib import Path

from dsv4lab.core.errors import DSV4LabError, UserError
from dsv4lab.core.paths import display_path, read_json
from dsv4lab.core.resources import require_disk_space
from dsv4lab.tools.options import add_device, resolve_device
from dsv4lab.tools.verify.model import golden_path_for, record_golden

HELP = "record golden oracles (fixed-id oracles, 256-token hash, teacher-forced data, layer digests) for a checkpoint"
DESCRIPTION = __doc__
GOLDEN_BYTES = 16 << 20
"""Disk a recording may take: a tiny checkpoint's golden is ~0.25 MB, its linear dumps (--dump-layers) a few MB."""


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", default=None, help="golden JSON (default data/golden/<checkpoint folder name>.json)")
    p.add_argument("--dump-layers", default=None, metavar="FILE",
                   help="also write per-expert linear input/output dumps (safetensors) for layout fingerprinting")
    p.add_argument("--force", action="store_true", help="replace an existing golden file (or dump file)")
    add_device(p, default="cpu")  # goldens are recorded on the CPU unless asked otherwise


def _refuse_to_replace(path: Path) -> None:
    """One line naming an existing file (and the checkpoint a golden in it was recorded from)."""
    try:
        source = (read_json(path).get("checkpoint") or {}).get("name")
    except (DSV4LabError, AttributeError):
        source = None
    recorded = f" (recorded from a checkpoint named {source!r})" if source else ""
    raise UserError(f"{display_path(path)} already exists{recorded}; pass --force to replace it, or --out FILE to "
                    "write elsewhere")


def run(args) -> int:
    out = Path(args.out) if args.out else golden_path_for(args.checkpoint)
    for target in (out, Path(args.dump_layers) if args.dump_layers else None):
        if target is not None and target.exists() and not args.force:
            _refuse_to_replace(target)
    require_disk_space(out.parent, GOLDEN_BYTES, "recording a golden file")
    g = record_golden(args.checkpoint, out, args.dump_layers, resolve_device(args.device))
    print(f"recorded {len(g['oracles'])} oracles, a {g['trajectory']['n_tokens']}-token trajectory "
          f"(hash {g['trajectory']['hash']}), {len(g['teacher_forced']['ids'])} teacher-forced positions and "
          f"{len(g['layers']['order'])} layer digests into {out}")
    if args.dump_layers:
        print(f"linear dumps in {args.dump_layers}")
    return 0
