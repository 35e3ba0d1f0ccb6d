"""Build or update a GPU's tuned file (``kernels/dsv4lab_kernels/tuned/<gpu>.json``) from committed benchmark results,
the same way ``dsv4lab bench kernels`` writes it after a run (:mod:`dsv4lab.tools.bench.tuned`).

    python scripts/rebuild_tuned.py RESULT.json [RESULT.json …] [--base TUNED.json] [--ops OP,…]
                                    [--set OP.FIELD=VALUE …] --out TUNED.json

Each RESULT is a ``bench kernels --suite decode`` result (its rows), a ``--suite prefill`` result (its
``choices``), a ``bench e2e`` result (the ``decode.fusion`` entries its ``fusions`` section recommends:
:func:`dsv4lab.tools.bench.e2e_fusions.tuned_ops`), a tuned file, or a decode dispatch file of the earlier format
(``dsv4lab.decode-dispatch/1``: converted entry by entry, each naming the measurement of its commit — give those
results with ``--provenance``). Later results win over earlier ones, all over ``--base`` (an op, shape and row count
a result does not hold keeps the base's entry).
``--ops`` takes only those ops from the results; ``--set OP.FIELD=VALUE`` (a JSON value, else a string) forces a
field of every entry of OP by hand — an ablation, recorded as a source of its own.

The committed H200 file was made so (``tests/test_dispatch.py`` rebuilds it and compares)::

    python scripts/rebuild_tuned.py data/results/h200/decode_dispatch.json data/results/h200/prefill_kernels.json \\
        --provenance data/results/h200/decode_kernels.json data/results/h200/decode_kernels_af2b4dc_full.json \\
        data/results/h200/decode_kernels_ed50478_moe.json data/results/h200/decode_kernels_196c88c_mhc_attention.json \\
        --out kernels/dsv4lab_kernels/tuned/h200.json
"""
from __future__ import annotations

import argparse
import json
import sys

from dsv4lab.core.config import get_preset
from dsv4lab.core.errors import DSV4LabError, UserError
from dsv4lab.core.paths import read_json
from dsv4lab.core.provenance import write_json
from dsv4lab.engine.dispatch import SCHEMA
from dsv4lab.tools.bench.decode.gemv import projection_shapes
from dsv4lab.tools.bench.e2e_fusions import tuned_ops as e2e_fusion_ops
from dsv4lab.tools.bench.tuned import (LEGACY_DISPATCH_FORMAT, convert_decode_dispatch, decode_entries,
                                       merge_tuned, prefill_entries, prefill_headline, source_of, take_ops,
                                       tuned_doc)


def entries_of(doc: dict, name: str, provenance: dict[str, dict]) -> dict:
    """The tuned document one result file holds (a tuned file: itself)."""
    if doc.get("schema") == SCHEMA:
        return doc
    if doc.get("format") == LEGACY_DISPATCH_FORMAT:
        return convert_decode_dispatch(doc, provenance)
    if doc.get("suite") == "decode" and "rows" in doc:
        source = source_of(doc, "decode")
        ops = decode_entries(doc, projection_shapes(get_preset(doc.get("model") or "flash")), source[0])
    elif doc.get("benchmark") == "e2e":
        try:
            source, ops = e2e_fusion_ops(doc)
        except UserError as err:
            raise UserError(f"{name}: {err}") from None
    elif doc.get("suite") == "prefill" and doc.get("choices"):
        if doc.get("smoke"):
            raise UserError(f"{name}: a smoke run (tiny shapes) chooses nothing")
        source = source_of(doc, "prefill")
        ops = prefill_entries(doc["choices"], prefill_headline(doc), source[0])
    else:
        raise UserError(f"{name}: neither a decode result (suite 'decode' with rows), a prefill result with "
                        f"'choices', a bench e2e result nor a decode dispatch file ({LEGACY_DISPATCH_FORMAT})")
    return tuned_doc(doc["gpu"], {source[0]: source[1]}, ops)


def set_by_hand(doc: dict, assignments: list[str]) -> dict:
    """``doc`` with ``OP.FIELD=VALUE`` forced into every entry of OP, their source a by-hand one."""
    if not assignments:
        return doc
    ops = {op: [dict(e, choice=dict(e["choice"])) for e in es] for op, es in doc["ops"].items()}
    sid = "set-by-hand"
    for item in assignments:
        target, eq, value = item.partition("=")
        op, dot, fld = target.rpartition(".")
        if not eq or not dot or not op:
            raise UserError(f"--set {item!r}: expected OP.FIELD=VALUE (e.g. prefill.mhc_rows.enabled=false)")
        if not ops.get(op):
            raise UserError(f"--set {item!r}: the tuned file has no entries of {op}")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        for e in ops[op]:
            e["choice"][fld], e["source"] = parsed, sid
    sources = dict(doc["sources"], **{sid: dict(command="scripts/rebuild_tuned.py --set " + " --set ".join(
        assignments))})
    used = {e["source"] for es in ops.values() for e in es}
    return tuned_doc(doc["gpu"], {k: v for k, v in sources.items() if k in used}, ops)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="bench kernels or bench e2e results, tuned files or earlier decode "
                   "dispatch files, in order")
    p.add_argument("--provenance", nargs="*", default=[], help="decode results naming the commits of a dispatch file")
    p.add_argument("--base", help="a tuned file (same GPU) whose entries the results do not replace are kept")
    p.add_argument("--ops", help="comma-separated ops taken from the results (default: all)")
    p.add_argument("--set", action="append", default=[], metavar="OP.FIELD=VALUE", help="force a choice by hand")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    try:
        provenance = {}
        for path in a.provenance:
            doc = read_json(path, UserError)
            provenance[doc.get("commit")] = doc
        out = read_json(a.base, UserError) if a.base else None
        name = a.base
        for path in a.results:
            fresh = take_ops(entries_of(read_json(path, UserError), path, provenance),
                             a.ops.split(",") if a.ops else None)
            out, name = merge_tuned(out, fresh, name), path
        out = set_by_hand(out, a.set)
    except DSV4LabError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    write_json(a.out, out)
    counts = ", ".join(f"{op} {len(es)}" for op, es in out["ops"].items())
    print(f"wrote {a.out} for {out['gpu']}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
