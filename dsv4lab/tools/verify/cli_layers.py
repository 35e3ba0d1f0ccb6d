"""``dsv4lab verify layers --checkpoint DIR [--backend B]`` — per layer and stage, two checks:

1. **digests** — the run of ``--backend`` (for the reference backend) or of the reference (for any other backend)
   against the golden layer digests (or, with ``--against-reference``, a live reference run): exact for the
   reference, so a faulted checkpoint is named at its first diverging layer and stage;
2. **stages** — the stage-isolated replay: the reference recorded at the op boundary on the golden layer input,
   every call replayed on the backend with the reference's inputs and judged by its error bound
   (:mod:`dsv4lab.tools.verify.stages`), so a faulted backend is named at its layer and stage.

Each stage is printed as its verdict is known; ``layers.json`` / ``layers.md`` hold both tables.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from dsv4lab.engine.loader import load
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_backend, add_device, resolve_device
from dsv4lab.tools.verify.backend_faults import BACKEND_FAULTS, inject_backend_fault
from dsv4lab.tools.verify.faults import MODEL_FAULTS, faulty_backend
from dsv4lab.tools.verify.layers import first_divergence, trace_model
from dsv4lab.tools.verify.model import find_golden, load_golden, require_recorded_from
from dsv4lab.tools.verify.report import md_table, write_report
from dsv4lab.tools.verify.stages import DECODE_PATHS, verify_stages

HELP = ("per layer and stage: the golden digests of the reference run, then the backend stage by stage on the "
        "reference's inputs, judged by error bounds")


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--golden", default=None)
    add_backend(p)
    add_device(p)
    p.add_argument("--against-reference", action="store_true",
                   help="compare with a reference-backend run of this same checkpoint instead of the golden digests")
    p.add_argument("--stages", choices=["auto", "always", "never"], default="auto",
                   help="the stage-isolated replay (auto: for every backend but the plain reference)")
    p.add_argument("--stage-tokens", type=int, default=None, metavar="N",
                   help="replay on the first N tokens of the layer input (default: all of it)")
    p.add_argument("--inject-fault", default=None, choices=sorted(MODEL_FAULTS),
                   help="a model fault in the reference backend (dsv4lab.tools.verify.faults.MODEL_FAULTS)")
    p.add_argument("--backend-fault", default=None, choices=sorted(BACKEND_FAULTS),
                   help="a fault of the backend itself (dsv4lab.tools.verify.backend_faults.BACKEND_FAULTS)")
    p.add_argument("--repairs", default=None)
    p.add_argument("--out", default=None)


def run(args) -> int:
    if args.backend_fault is not None and args.backend_fault not in BACKEND_FAULTS:
        raise UserError(f"--backend-fault {args.backend_fault}: unknown; known: {', '.join(BACKEND_FAULTS)}")
    device = resolve_device(args.device)
    gpath = Path(args.golden) if args.golden else find_golden(args.checkpoint)
    if not args.golden and not args.against_reference:  # the golden found must be this checkpoint's own
        require_recorded_from(load_golden(gpath), gpath, args.checkpoint)
    if args.inject_fault and args.backend != "reference":
        raise UserError("--inject-fault: model faults are injected into the reference backend only")
    backend = faulty_backend(args.inject_fault) if args.inject_fault else args.backend
    runner = load(args.checkpoint, device=device, backend=backend, max_batch=1, repairs=args.repairs)
    if args.backend_fault is not None:
        inject_backend_fault(runner, args.backend_fault)
    ref = load(args.checkpoint, device=device, backend="reference", max_batch=1, repairs=args.repairs)
    exact = runner.backend.startswith("reference")
    if args.against_reference or not gpath.exists():
        ids = load_golden(gpath)["layers"]["input_ids"] if gpath.exists() else list(range(2, 98))
        rt = trace_model(ref, ids)
        golden_layers = dict(input_ids=ids, order=rt.order, digests=rt.digests)
        against = "a live reference run of this checkpoint"
    else:
        golden_layers = load_golden(gpath)["layers"]
        against = f"the golden digests {gpath}"
    traced = runner if exact else ref
    print(f"verify layers: backend {runner.backend} on {args.checkpoint} ({device})", flush=True)
    print(f"1. digests of the {traced.backend} run against {against}", flush=True)
    first, rows = first_divergence(trace_model(traced, golden_layers["input_ids"]), golden_layers, traced.backend)
    for r in rows:
        val = f"jaccard {r.jaccard:.3f}" if r.jaccard is not None else (
            f"rel {r.rel_err:.3g} cos {r.cosine:.6f}" if r.rel_err is not None else r.note)
        print(f"{'ok  ' if r.ok else 'FAIL'} {r.block:<10} {r.stage:<48} {val}", flush=True)
    msg = f"first divergence: {first.block} — {first.stage} ({first.note})" if first else "no divergence"
    print(msg, flush=True)
    report = None
    if args.stages == "always" or (args.stages == "auto" and type(runner.ops).__name__ != "ReferenceOps"):
        ids = golden_layers["input_ids"][: args.stage_tokens] if args.stage_tokens else golden_layers["input_ids"]
        steps = len(DECODE_PATHS)
        print(f"2. the {runner.backend} backend stage by stage on the reference's inputs ({len(ids) - steps} prefill "
              f"tokens + {steps} decode steps: {', '.join(DECODE_PATHS)})", flush=True)
        report = verify_stages(runner, ref, ids, progress=lambda line: print(line, flush=True))
        counts = Counter(s.verdict for s in report.stages)
        print(f"{len(report.stages)} stages: " + ", ".join(f"{n} {v}" for v, n in counts.most_common())
              + (f"; first defect: {report.first.block} — {report.first.stage}" if report.first else ""), flush=True)
    table = [r.to_dict() for r in rows]
    ok = first is None and (report is None or report.ok)
    md = [f"# verify layers ({runner.backend}): {'PASS' if ok else 'FAIL'}", "", f"## Digests against {against}",
          "", msg, "", md_table(table, ["block", "stage", "ok", "rel_err", "cosine", "jaccard", "note"])]
    if report is not None:
        srows = [s.to_dict() for s in report.stages]
        md += ["", "## Stage by stage on the reference's inputs", "",
               f"first defect: {report.first.block} — {report.first.stage}" if report.first else "every stage passes",
               "", md_table(srows, ["block", "stage", "verdict", "max_ratio", "line"])]
    folder = write_report(args.out, "layers", dict(
        backend=runner.backend, ok=ok, first=first.to_dict() if first else None, rows=table,
        stages=report.to_dict() if report is not None else None), "\n".join(md))
    print(f"{'PASS' if ok else 'FAIL'}; report in {folder}")
    return 0 if ok else 1
