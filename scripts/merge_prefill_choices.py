"""Overlay some ``choices`` of a fresh prefill benchmark (e.g. a ``--quick`` run in this GPU visit) on the committed
full run's, so that ``bench e2e`` in the same visit runs what was just measured without losing the choices the quick
run does not measure.

    python3 scripts/merge_prefill_choices.py FRESH.json OUT.json [--keys mhc_rows,mhc_rows_geometry]
    python3 scripts/merge_prefill_choices.py - OUT.json --set mhc_rows=true --set mhc_rows_geometry=m16d16w8

``-`` takes nothing from a fresh run; ``--set KEY=VALUE`` (JSON value, else a string) forces a choice by hand — an
ablation, recorded as such under ``merged_from.set``.

The result is the committed file with those keys (and their ``why``) replaced — its rows and ``commit`` stay the
base run's — and ``merged_from`` naming both files and commits. Refuses a fresh run from another GPU or one
without choices.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4lab.engine.triton_prefill import CHOICES_FILE  # noqa: E402
from dsv4lab.core.errors import DSV4LabError  # noqa: E402
from dsv4lab.core.paths import read_json  # noqa: E402
from dsv4lab.core.provenance import write_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fresh", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--base", type=Path, default=CHOICES_FILE, help="the full run to start from (default: committed)")
    p.add_argument("--keys", default="mhc_rows,mhc_rows_geometry", help="choices taken from the fresh run")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="force a choice by hand")
    a = p.parse_args()
    try:
        base = read_json(a.base)
        fresh = dict(base, choices={"why": {}}) if str(a.fresh) == "-" else read_json(a.fresh)
    except DSV4LabError as err:
        print(err, file=sys.stderr)
        return 2
    forced = {}
    for item in a.set:
        key, eq, value = item.partition("=")
        if not eq or not key:
            print(f"--set {item!r}: expected KEY=VALUE", file=sys.stderr)
            return 2
        try:
            forced[key] = json.loads(value)
        except ValueError:
            forced[key] = value
    if not fresh.get("choices") and not forced:
        print(f"{a.fresh}: no 'choices' to merge", file=sys.stderr)
        return 2
    if fresh.get("gpu") != base.get("gpu"):
        print(f"{a.fresh}: measured on {fresh.get('gpu')!r}, {a.base} on {base.get('gpu')!r}", file=sys.stderr)
        return 2
    choices = dict(base["choices"])
    why = dict(choices.get("why", {}))
    taken = []
    for key in a.keys.split(","):
        if key in fresh["choices"]:
            choices[key] = fresh["choices"][key]
            taken.append(key)
            stem = key.removesuffix("_geometry")
            if stem in fresh["choices"].get("why", {}):
                why[stem] = fresh["choices"]["why"][stem]
    choices.update(forced)
    choices["why"] = why
    out = dict(base, choices=choices,  # the rows (and ``commit``) stay the base run's
               merged_from=dict(base=f"{a.base.name} at {base.get('commit')}",
                                fresh=f"{a.fresh.name} at {fresh.get('commit')}" if taken else None, keys=taken,
                                set=forced))
    write_json(a.out, out)
    print(f"wrote {a.out}: {', '.join(f'{k}={choices[k]}' for k in taken) or 'nothing taken'} from {a.fresh.name}"
          + (f"; set by hand: {forced}" if forced else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
