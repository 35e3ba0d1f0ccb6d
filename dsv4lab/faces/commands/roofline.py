"""``dsv4lab roofline`` — bytes, FLOPs, roofline bound and step-time model; the account of the paper's numbers.

    dsv4lab roofline --preset flash --hardware mi250-gcd --tp 4 [--ep N --batch B --context L] [--json]
    dsv4lab roofline account [--json]                       # the paper's MI250 TP4 step, rebuilt from components
    dsv4lab roofline account --hardware h200-sxm --tp 2     # the same account from the model alone
    dsv4lab roofline compare data/results/h200/decode_kernels.json [--json]
    dsv4lab roofline hardware [--hardware NAME] [--json]    # the catalogue
"""
from __future__ import annotations

import json
import sys

from dsv4lab.core.config import get_preset, resolve_args
from dsv4lab.core.errors import UserError
from dsv4lab.tools.options import add_hardware, add_preset, int_range
from dsv4lab.tools.perf import account
from dsv4lab.tools.perf import roofline as rl
from dsv4lab.tools.perf.hardware import catalogue, list_hardware, load_hardware

NAME = "roofline"
HELP = "bytes/FLOPs per op, roofline bound and step-time model; 'account' rebuilds the paper's MI250 decode step"
DESCRIPTION = __doc__

ACTIONS = ("report", "account", "compare", "hardware")


def add_arguments(p):
    p.add_argument("action", nargs="?", default="report", choices=ACTIONS,
                   help="report (default): one step on one hardware; account: the paper's step from components "
                        "(or, with --hardware, a prediction); compare: predicted vs measured kernels; "
                        "hardware: the catalogue")
    p.add_argument("path", nargs="?", help="compare: a decode_kernels.json results file")
    add_preset(p, help="model preset (default flash)")
    p.add_argument("--config", help="a config.json or checkpoint folder instead of a preset")
    add_hardware(p)
    p.add_argument("--tp", type=int_range(1), default=None,
                   help="tensor-parallel ranks (report: 1; account prediction: 2)")
    p.add_argument("--ep", type=int_range(1), default=1, help="expert-parallel groups inside the TP group")
    p.add_argument("--batch", type=int_range(1), default=1, help="sequences per decode step")
    p.add_argument("--context", type=int_range(1), default=None,
                   help="decode: cached tokens per sequence (default 4096); prefill: prompt tokens")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    p.add_argument("--chunk", type=int_range(1), default=None, help="prefill chunk size (default: one pass)")
    p.add_argument("--kv-format", choices=("fp8", "bf16"), default="fp8",
                   help="KV cache: fp8 rows + FP4 index keys (production) or bf16 (reference)")
    p.add_argument("--sharding", choices=("ideal", "sglang", "reference"), default=None,
                   help="which weights every rank reads in full (report: ideal; account prediction: reference)")
    p.add_argument("--allreduce", choices=("library", "peer_read"), default="library",
                   help="small-message all-reduce latency to charge collectives")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--top", type=int_range(0), default=0, help="text output: show only the N most expensive ops")


def _model_args(args):
    if args.config:
        return resolve_args(None, args.config)
    return get_preset(args.preset or "flash")


def run(args) -> int:
    if args.path and args.action != "compare":
        raise UserError(f"unexpected argument {args.path!r} (only 'compare' takes a file)")

    if args.action == "hardware":
        entries = {args.hardware: load_hardware(args.hardware)} if args.hardware else catalogue()
        if args.json:
            print(json.dumps({n: dict(title=h.title, numbers=h.table(), sources=h.sources) for n, h in entries.items()},
                             indent=2))
        else:
            for name, h in entries.items():
                print(f"# {name}: {h.title}")
                for row in h.table():
                    rng = f" [{row['range'][0]:g}-{row['range'][1]:g}]" if "range" in row else ""
                    val = "—" if row["value"] is None else f"{row['value']:g}"
                    print(f"  {row['key']:<42} {val:>10}{rng}")
        return 0

    if args.action == "compare":
        if not args.path:
            raise UserError("compare needs a results file, e.g. data/results/h200/decode_kernels.json")
        res = rl.compare_kernel_results(args.path, args.hardware or "h200-sxm",
                                        context=args.context or 4096)
        if args.json:
            print(json.dumps(res, indent=2))
        else:
            print(f"# {res['file']}: {res['gpu']}, torch {res['torch']}, triton {res['triton']}, commit "
                  f"{res['commit']}, copy {res['copy_bw_gbps']:.0f} GB/s")
            print(f"{'kernel':<16} {'variant':<18} {'B':>3} {'measured us':>12} {'model us':>9} {'ratio':>6} "
                  f"{'floor us':>9} {'%copy':>6}")
            for r in res["rows"]:
                pred = "—" if r["predicted_us"] is None else f"{r['predicted_us']:.1f}"
                ratio = "—" if r["predicted_us"] is None else f"{r['measured_over_predicted']:.2f}"
                print(f"{r['kernel']:<16} {str(r['variant']):<18} {r['batch']:>3} {r['measured_us']:>12.1f} "
                      f"{pred:>9} {ratio:>6} {r['floor_us_at_copy_bw']:>9.1f} {r['pct_copy_bw']:>6.1f}")
        return 0

    if args.action == "account":
        if args.hardware and load_hardware(args.hardware).name != "mi250-gcd":
            acc = account.predict_account(args.hardware, tp=args.tp or 2, ep=args.ep, batch=args.batch,
                                     context=args.context or 4096, sharding=args.sharding or "reference",
                                     allreduce=args.allreduce, args=_model_args(args))
            _print_prediction(acc, args)
            return 0
        acc = account.paper_account(context=args.context or 140)
        acc["h200"] = {k: v for k, v in account.predict_account("h200-sxm").items() if k != "ops"}
        if args.json:
            print(json.dumps(acc, indent=2))
        else:
            _print_paper_account(acc)
        return 0

    # report
    if not args.hardware:
        raise UserError(f"give --hardware NAME; the catalogue has: {', '.join(list_hardware())}")
    hw = load_hardware(args.hardware)
    margs = _model_args(args)
    context = args.context if args.context is not None else (4096 if args.phase == "decode" else 4096)
    rep = rl.roofline_report(margs, hw, tp=args.tp or 1, ep=args.ep, batch=args.batch, context=context,
                             phase=args.phase, chunk=args.chunk, kv_format=args.kv_format,
                             sharding=args.sharding or "ideal", allreduce=args.allreduce)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0
    _print_report(rep, args.top)
    return 0


def _print_report(rep: dict, top: int) -> None:
    unit = "token" if rep["phase"] == "decode" else "prompt token"
    print(f"# {rep['phase']} on {rep['hardware']} ({rep['hardware_title']}), TP{rep['tp']}/EP{rep['ep']}, "
          f"batch {rep['batch']}, context {rep['context']}, KV {rep['kv_format']}, sharding {rep['sharding']}")
    print(f"weight bytes per {unit} (whole model)   {rep['bytes_per_token']:>18,.0f}")
    print(f"bytes per {unit} on the busiest rank     {rep['bytes_per_token_per_rank']:>18,.0f}  "
          f"(weights {rep['weight_bytes_per_token_per_rank']:,.0f}, KV {rep['kv_bytes_per_token_per_rank']:,.0f})")
    print(f"FLOPs per {unit}                          {rep['flops_per_token']:>18,.0f}")
    print(f"roofline bound (peak bandwidth and compute)  {rep['bound_tok_s']:>10,.1f} tok/s   bytes alone: "
          f"{rep['bandwidth_bound_tok_s']:,.1f} at {rep['bandwidth_gbps_peak']:,.0f} GB/s peak, "
          f"{rep['bandwidth_bound_tok_s_achievable']:,.1f} at {rep['bandwidth_gbps_achievable']:,.0f} GB/s achievable")
    pred = rep["predicted"]
    print(f"model with penalties ({pred['allreduce']} all-reduce)   {pred['tok_s']:>10,.1f} tok/s   "
          f"step {pred['step_us']:,.0f} us, MBU {pred['mbu_pct']:.1f}%  "
          f"[{rep['kernel_launches']:.0f} launches, {rep['collectives']:.0f} collectives]")
    print("  " + ", ".join(f"{k} {v:,.0f} us" for k, v in pred["components_us"].items()))
    for note in pred["assumptions"]:
        print(f"  note: {note}")
    ops = sorted(rep["ops"], key=lambda o: -o["total_us"]) if top else rep["ops"]
    ops = ops[:top] if top else ops
    print(f"\n{'op':<26} {'launch':>6} {'MB/rank':>10} {'GFLOP/rank':>11} {'FLOP/B':>8} {'bound us':>9} "
          f"{'model us':>9}  limiter")
    for o in ops:
        print(f"{o['name']:<26} {o['launches']:>6.0f} {o['bytes_rank'] / 1e6:>10.2f} {o['flops_rank'] / 1e9:>11.3f} "
              f"{o['intensity_flop_per_byte']:>8.2f} {o['bound_us']:>9.1f} {o['total_us']:>9.1f}  {o['limiter']}")
    for c in rep["collective_ops"]:
        print(f"{c['name']:<26} {c['launches']:>6.1f} {'':>10} {'':>11} {'':>8} {'':>9} {c['total_us']:>9.1f}  "
              f"collective")


def _print_paper_account(acc: dict) -> None:
    print(f"# {acc['what']}")
    print(f"reported {acc['reported_tok_s']} tok/s ({acc['reported_step_us']:,.0f} us/token); "
          f"predicted {acc['predicted_tok_s']:.1f} tok/s ({acc['step_us']:,.0f} us), error {acc['error_pct']:+.1f}%; "
          f"input ranges give {acc['range_tok_s']['slow']:.1f}-{acc['range_tok_s']['fast']:.1f} tok/s")
    for k, v in acc["components_us"].items():
        print(f"  {k:<24} {v:>9,.0f} us  {100 * acc['components_share'][k]:5.1f}%")
    for k, v in acc["structural_what_if_tok_s"].items():
        print(f"  what if {k}: {v:.1f} tok/s")
    r = acc["routed_moe"]
    print(f"routed-MoE stage: reported {r['reported_us_per_layer']} us/layer, bytes at achievable bandwidth "
          f"{r['bandwidth_floor_us_per_layer']:.1f} us/layer")
    print(acc["bandwidth"]["statement"])
    print("\nmilestones (tok/s)            reported  modelled  basis")
    for m in acc["milestones"]:
        print(f"  {m['id']:<26} {m['reported_tok_s']:>8.2f} {m['predicted_tok_s']:>9.2f}  {m['basis']}")
    pf = acc["prefill"]
    print(f"\nprefill: reported {pf['reported_input_tok_s']:,.0f} input tok/s = {pf['achieved_tflops_all_gcds']:.1f} "
          f"TFLOP/s on 4 GCDs ({pf['mfma_utilization_pct']:.1f}% of BF16 MFMA peak); M=2048 MoE kernels "
          f"{pf['moe_m2048']['pct_of_int8_mfma_peak']:.1f}% of INT8 MFMA peak")
    h = acc.get("h200")
    if h:
        print(f"\nH200 TP{h['tp']} (model only): {h['predicted_tok_s']:.1f} tok/s, MBU {h['mbu_pct']:.1f}% "
              f"of measured copy bandwidth; bound {h['bound_tok_s']:.0f} tok/s")
    for note in acc["assumptions"]:
        print(f"note: {note}", file=sys.stderr)


def _print_prediction(acc: dict, args) -> None:
    if args.json:
        print(json.dumps({k: v for k, v in acc.items()}, indent=2))
        return
    print(f"# {acc['hardware']} TP{acc['tp']}/EP{acc['ep']}, batch {acc['batch']}, context {acc['context']}, "
          f"sharding {acc['sharding']}, {acc['allreduce']} all-reduce")
    print(f"predicted {acc['predicted_tok_s']:.1f} tok/s ({acc['step_us']:,.0f} us/step), MBU {acc['mbu_pct']:.1f}% "
          f"({acc['mbu_basis']}); roofline bound {acc['bound_tok_s']:.0f} tok/s")
    for k, v in acc["components_us"].items():
        print(f"  {k:<24} {v:>9,.0f} us  {100 * acc['components_share'][k]:5.1f}%")
    for k, v in acc["what_if"].items():
        print(f"  what if {k}: {v:.1f} tok/s")
    for note in acc["assumptions"]:
        print(f"note: {note}", file=sys.stderr)
