"""Rebuild a decode dispatch from a committed ``bench kernels --suite decode`` result, optionally completed by the
entries of an earlier dispatch the run did not measure (a run its budget cut short) — the same code path as the
suite's ``--dispatch-base``, for results that were measured before it existed.

    python scripts/rebuild_decode_dispatch.py RESULT.json [--base DISPATCH.json] --out DISPATCH.json
"""
from __future__ import annotations

import argparse
import sys

from dsv4lab.core.provenance import write_json
from dsv4lab.tools.bench.decode import build_dispatch, merge_dispatch
from dsv4lab.core.config import get_preset
from dsv4lab.core.errors import UserError
from dsv4lab.core.paths import read_json


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a bench kernels --suite decode JSON")
    p.add_argument("--base", help="an earlier dispatch (same GPU) whose unmeasured entries are kept")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    try:
        doc = read_json(a.result, UserError)
        if not isinstance(doc, dict) or doc.get("suite") != "decode" or "rows" not in doc:
            raise UserError(f"{a.result}: not a bench kernels --suite decode result (no suite 'decode' with rows)")
        fresh = build_dispatch(doc, get_preset(doc.get("model") or "flash"))
        out = merge_dispatch(read_json(a.base, UserError), fresh, a.base) if a.base else fresh
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_json(a.out, out)
    print(f"wrote {a.out}: {len(out['gemv'])} projection entries, {len(out['moe'])} MoE tiers"
          + (f" ({out['merged_from'][1]['entries']} carried from {a.base})" if a.base else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
