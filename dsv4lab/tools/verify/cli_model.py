"""``dsv4lab verify model --checkpoint DIR [--backend B]`` — the model-level tiers against the golden oracles.

Exits 0 when every binding tier passes; prints each tier as it finishes. For the reference backend the oracles,
the trajectory hash and the teacher-forced KL are exact, and on failure the layer oracle names the first layer and
stage that diverge from the golden digests. For any other backend the binding tiers are the checkpoint (the
reference run against the golden digests), the stage-isolated replay of the backend on the reference's inputs, and
the teacher-forced KL tiers read against the checkpoint's rounding floor (docs/verification.md). Writes
``model.json`` and ``model.md`` to ``--out``.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dsv4lab.engine.loader import load
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_backend, add_device, resolve_device
from dsv4lab.tools.verify.backend_faults import BACKEND_FAULTS, inject_backend_fault
from dsv4lab.tools.verify.faults import MODEL_FAULTS, faulty_backend
from dsv4lab.tools.verify.model import (KL_TIERS, TIERS, find_golden, load_golden, require_recorded_from,
                                        verify_model)
from dsv4lab.tools.verify.report import md_table, write_report
from dsv4lab.tools.verify.speculative import render_speculative, verify_speculative

HELP = ("fixed-id oracles, 256-token hash, teacher-forced KL around every boundary, the checkpoint and the backend "
        "stage by stage; localises failures")


def add_arguments(p):
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--golden", default=None, help="golden JSON (default: data/golden/<checkpoint folder name>.json, "
                   "else the golden recorded from a checkpoint with this config; a golden found so must have been "
                   "recorded from this checkpoint's content, while --golden compares any checkpoint with it, e.g. a "
                   "suspect copy with a trusted golden)")
    add_backend(p)
    add_device(p)
    p.add_argument("--kl-bound", type=float, default=None,
                   help="a per-position teacher-forced KL bound (default: 1e-9 for the reference; for other backends "
                        "k × the checkpoint's rounding floor measured in the same run)")
    p.add_argument("--skip-trajectory", action="store_true", help="skip the 256-token trajectory tier")
    p.add_argument("--layers", choices=["on-failure", "always", "never"], default="on-failure")
    p.add_argument("--repairs", default=None, help="a layout repair spec applied while loading")
    p.add_argument("--inject-fault", default=None, choices=sorted(MODEL_FAULTS),
                   help="run the reference backend with a deliberate model fault (dsv4lab.tools.verify.faults.MODEL_FAULTS) "
                        "to see how the harness reports it")
    p.add_argument("--backend-fault", default=None, choices=sorted(BACKEND_FAULTS),
                   help="run the backend with a deliberate fault of its own (see dsv4lab.tools.verify.backend_faults: "
                        "w2_one_expert, bf16_accumulation) to see the stage tier name it")
    p.add_argument("--stage-tokens", type=int, default=None, metavar="N",
                   help="shorten the stage tier's input to N tokens (default: the golden layer input)")
    p.add_argument("--tiers", default=None, metavar="A,B",
                   help=f"run only these tiers (default: all; of {', '.join(TIERS)}) — e.g. checkpoint,stages for "
                        "a fast backend under the CPU interpreter, where the decoding tiers take long")
    p.add_argument("--speculative", default=None, choices=("mtp",),
                   help="also decode the oracles and the trajectory self-speculatively (must equal the golden ids) "
                        "and check teacher-forced logits across rollbacks at every boundary")
    p.add_argument("--draft-tokens", type=int, default=1, help="MTP draft tokens per forward for --speculative")
    p.add_argument("--out", default=None)


def render(res: dict, golden_path) -> str:
    t = res["tiers"]
    kl = any(name in t for name in KL_TIERS)
    lines = [f"# verify model: {'PASS' if res['ok'] else 'FAIL'}", "",
             f"backend `{res['backend']}`, golden `{golden_path}`, checkpoint matches the golden's: "
             f"{res['checkpoint_matches_golden']}" + (f", teacher-forced KL bound {res['kl_bound']:g}" if kl else "")
             + f"; tiers run: {', '.join(t)}", ""]
    if "oracles" in t:
        lines += ["## Fixed-id oracles", "", md_table(
            [dict(r, got=r["hash"], expected=r["expected_hash"]) for r in t["oracles"]["rows"]],
            ["name", "ok", "got", "expected", "first_mismatch", "got_token", "expected_token"]), ""]
    if "trajectory" in t:
        tr = t["trajectory"]
        lines += [f"## {tr['n_tokens']}-token trajectory", "",
                  f"hash {tr['hash']} (golden {tr['expected_hash']}): {'ok' if tr['ok'] else 'MISMATCH at token ' + str(tr['first_mismatch'])}", ""]
    rule = res.get("kl_rule", {})
    if rule.get("kind") == "calibrated":
        lines += [f"KL rule: mean ≤ {rule['k_mean']} × floor mean ({rule['mean_kl']:.3g}) and every position ≤ "
                  f"{rule['k_max']} × floor max ({rule['max_kl']:.3g}); floor mean {rule['floor_mean']:.3g}, "
                  f"max {rule['floor_max']:.3g} (docs/verification.md)", ""]

    def kl_section(title, c, extra=""):
        return [title, "", f"{'ok' if c['ok'] else 'FAIL'}: mean KL {c['mean_kl']:.3g}, max KL {c['max_kl']:.3g} at "
                f"position {c['max_position']}, first position above the bound: {c['first_divergence']}{extra}", "",
                md_table(c["boundaries"], ["boundary", "positions", "max_kl", "ok"]), ""]
    if "cached_vs_recompute" in t:
        c = t["cached_vs_recompute"]
        lines += kl_section("## Teacher-forced cached vs recompute", c,
                            f", argmax agreement {c['argmax_agreement']:.4f}")
    if "chunked_vs_recompute" in t:
        c = t["chunked_vs_recompute"]
        lines += kl_section(f"## Teacher-forced chunked prefill (chunks of {c['chunk']}) vs one-shot", c)
    if "vs_reference" in t:
        lines += kl_section("## Teacher-forced agreement with the reference", t["vs_reference"])
    if "noise_floor" in t:
        f = t["noise_floor"]
        ratio = f["backend_mean_over_floor"]
        lines += ["## Rounding-noise floor of this checkpoint (not binding)", "",
                  f"the reference with fp32 instead of exact reductions, against the reference: mean KL "
                  f"{f['mean_kl']:.3g}, max {f['max_kl']:.3g}"
                  + (f"; the backend's mean KL is {ratio:.3g}x this floor" if ratio is not None else "") + ". "
                  "A correct backend that is not bit-exact drifts by about this much on this checkpoint; a layout "
                  "fault is orders of magnitude above it (docs/troubleshooting.md).", ""]
    if "checkpoint" in t:
        c = t["checkpoint"]
        lines += ["## Checkpoint: the reference run against the golden layer digests", "",
                  f"{'ok' if c['ok'] else '**FAIL**'}: {c['summary']}", ""]
    if "stages" in t:
        st = t["stages"]
        lines += ["## Backend stage by stage on the reference's inputs", "", f"{'ok' if st['ok'] else '**FAIL**'}: "
                  f"{st['summary']}", ""]
        rows = [r for r in st["stages"] if not r["ok"]] or [r for r in st["stages"] if r["verdict"] != "bit-identical"]
        if rows:
            lines += [md_table([dict(r, worst=r.get("line", "")) for r in rows[:40]],
                               ["block", "stage", "verdict", "max_ratio", "worst"]), ""]
    if any(name.startswith(("speculative_", "rollback_")) for name in t):
        lines += render_speculative(t)
    if "layers" in res and res["layers"].get("note"):
        lines += ["## Layer oracle", "", res["layers"]["note"], ""]
    elif "layers" in res:
        L = res["layers"]
        if L["first"]:
            f = L["first"]
            lines += ["## Layer oracle", "", f"**first divergence: {f['block']} — {f['stage']}** ({f['note']})", ""]
        else:
            lines += ["## Layer oracle", "", "every traced stage matches the golden digests", ""]
        bad = [r for r in L["rows"] if not r["ok"]][:20]
        if bad:
            lines += [md_table(bad, ["block", "stage", "rel_err", "cosine", "jaccard", "note"])]
    return "\n".join(lines)


def _tiers(spec: str | None) -> tuple[str, ...]:
    if spec is None:
        return TIERS
    tiers = tuple(t.strip() for t in spec.split(",") if t.strip())
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise UserError(f"--tiers {spec}: unknown tier(s) {', '.join(unknown) or '(none given)'}; known: "
                        f"{', '.join(TIERS)}")
    return tiers


def run(args) -> int:
    if args.backend_fault is not None and args.backend_fault not in BACKEND_FAULTS:
        raise UserError(f"--backend-fault {args.backend_fault}: unknown; known: {', '.join(BACKEND_FAULTS)}")
    tiers = _tiers(args.tiers)
    gpath = Path(args.golden) if args.golden else find_golden(args.checkpoint)
    golden = load_golden(gpath)
    if not args.golden:  # the golden found for a checkpoint must be its own; --golden compares deliberately
        require_recorded_from(golden, gpath, args.checkpoint)
    device = resolve_device(args.device)
    if args.inject_fault and args.backend != "reference":
        raise UserError("--inject-fault: model faults are injected into the reference backend only")
    backend = faulty_backend(args.inject_fault) if args.inject_fault else args.backend
    runner = load(args.checkpoint, device=device, dtype=torch.bfloat16, backend=backend, max_batch=1,
                  repairs=args.repairs)
    if args.backend_fault is not None:
        inject_backend_fault(runner, args.backend_fault)
    ref = None
    if runner.backend != "reference":
        ref = load(args.checkpoint, device=device, dtype=torch.bfloat16, backend="reference", max_batch=1,
                           repairs=args.repairs)
    print(f"verify model: backend {runner.backend} on {args.checkpoint} ({device}), golden {gpath}", flush=True)
    res = verify_model(runner, golden, Path(args.checkpoint), ref, args.kl_bound, args.skip_trajectory, args.layers,
                       tiers=tiers, progress=lambda line: print(line, flush=True), stage_tokens=args.stage_tokens)
    if args.speculative:
        res["tiers"].update(verify_speculative(runner, golden, res["kl_bound"], args.draft_tokens, args.skip_trajectory))
        res["ok"] = all(t["ok"] for t in res["tiers"].values() if t.get("binding", True))
    if hasattr(runner.ops, "report"):
        res["backend_report"] = runner.ops.report()
    md = render(res, gpath)
    folder = write_report(args.out, "model", dict(res, checkpoint=str(args.checkpoint), golden=str(gpath)), md)
    for name, tier in res["tiers"].items():  # the speculative tiers (the others printed as they finished)
        if not name.startswith(("speculative_", "rollback_")):
            continue
        flag = "ok  " if tier["ok"] else ("FAIL" if tier.get("binding", True) else "diff")
        extra = ""
        if name == "oracles":
            extra = ", ".join(f"{r['name']}: {r['hash']}" for r in tier["rows"])
        elif name == "trajectory":
            extra = f"hash {tier['hash']} (golden {tier['expected_hash']})"
        elif "summary" in tier:
            extra = tier["summary"]
        elif name == "noise_floor":
            ratio = tier["backend_mean_over_floor"]
            extra = (f"rounding-only change of the reference: mean KL {tier['mean_kl']:.3g}, max {tier['max_kl']:.3g}"
                     + (f"; the backend's mean KL is {ratio:.3g}x this floor" if ratio is not None else ""))
        else:
            extra = f"max KL {tier['max_kl']:.3g}, first divergence {tier['first_divergence']}"
        print(f"{flag} {name}: {extra}")
    if "layers" in res and res["layers"].get("note"):
        print(f"layer oracle: {res['layers']['note']}")
    elif "layers" in res:
        f = res["layers"]["first"]
        print(f"layer oracle: first divergence at {f['block']} — {f['stage']} ({f['note']})" if f
              else "layer oracle: every traced stage matches the golden digests")
    f = res.get("first_divergence")
    if f is not None and f["where"] != "layers":
        print(f"first divergence ({f['where']}): {f['block']} — {f['stage']}")
    print(f"{'PASS' if res['ok'] else 'FAIL'}; report in {folder}")
    return 0 if res["ok"] else 1
