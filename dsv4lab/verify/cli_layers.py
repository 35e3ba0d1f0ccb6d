"""``dsv4lab verify layers --checkpoint DIR [--backend B]`` — per layer, per stage, against the golden digests
(or, with ``--against-reference``, against a live reference run of the same checkpoint)."""
from __future__ import annotations

from pathlib import Path

from ..engine.loader import load
from ..options import add_backend, add_device, resolve_device
from .layers import first_divergence, trace_model
from .model import find_golden, load_golden
from .report import md_table, write_report

HELP = "per-layer, per-stage comparison (router, stage 1, activation, stage 2, MoE, attention, compressor, indexer, mHC)"


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--golden", default=None)
    add_backend(p)
    add_device(p)
    p.add_argument("--against-reference", action="store_true",
                   help="compare with a reference-backend run of this same checkpoint instead of the golden digests")
    p.add_argument("--repairs", default=None)
    p.add_argument("--out", default=None)


def run(args) -> int:
    device = resolve_device(args.device)
    runner = load(args.checkpoint, device=device, backend=args.backend, max_batch=1, repairs=args.repairs)
    gpath = Path(args.golden) if args.golden else find_golden(args.checkpoint)
    if args.against_reference:
        ref = load(args.checkpoint, device=device, backend="reference", max_batch=1, repairs=args.repairs)
        ids = load_golden(gpath)["layers"]["input_ids"] if gpath.exists() else list(range(2, 98))
        rt = trace_model(ref, ids)
        golden_layers = dict(input_ids=ids, order=rt.order, digests=rt.digests)
    else:
        golden_layers = load_golden(gpath)["layers"]
    tracer = trace_model(runner, golden_layers["input_ids"])
    first, rows = first_divergence(tracer, golden_layers, runner.backend)
    table = [r.to_dict() for r in rows]
    for r in rows:
        val = f"jaccard {r.jaccard:.3f}" if r.jaccard is not None else (
            f"rel {r.rel_err:.3g} cos {r.cosine:.6f}" if r.rel_err is not None else r.note)
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.block:<10} {r.stage:<48} {val}")
    msg = f"first divergence: {first.block} — {first.stage} ({first.note})" if first else "no divergence"
    print(msg)
    md = "\n".join([f"# verify layers ({runner.backend})", "", msg, "",
                    md_table(table, ["block", "stage", "ok", "rel_err", "cosine", "jaccard", "note"])])
    folder = write_report(args.out, "layers", dict(backend=runner.backend, first=first.to_dict() if first else None,
                                                   rows=table), md)
    print(f"report in {folder}")
    return 0 if first is None else 1
