"""``dsv4lab dispatch`` — what the Triton backend's dispatch runs for each decode projection, the routed MoE, the
attention and the mHC site at each row count on a GPU, which fused paths are on, and the prefill settings per prompt
length; where each choice comes from; no GPU needed.

The dispatch (:mod:`dsv4lab.engine.dispatch`) reads the GPU's tuned file (``kernels/dsv4lab_kernels/tuned/<gpu>.json``,
or ``--tuned FILE``) over the GPU defaults; an entry measured at ``r`` rows serves every row count from the entry
below it up to ``r`` (the first entry with ``rows ≥`` the step's). A step's rows are ``batch × tokens per sequence``
— a speculative verify step of ``k`` drafts carries ``k + 1`` per sequence — so ``--rows 1,2,3,4`` shows what a
verify step runs beside the one-token step::

    dsv4lab dispatch --rows 1,2,4,8            # the H200's committed choices
    dsv4lab dispatch --tuned runs/h200/tuned_h200.json --json
"""
from __future__ import annotations

import json

from dsv4lab.core.config import get_preset
from dsv4lab.engine.dispatch import GPU_DEFAULTS, Dispatch, load_tuned, read_tuned, shape_key, tuned_path
from dsv4lab.engine.kernel_families import FUSION_NAMES
from dsv4lab.tools import options

NAME = "dispatch"
HELP = "show the kernel choice per decode projection, routed MoE and attention at given row counts (no GPU needed)"


def add_arguments(p):
    p.add_argument("--gpu", default="NVIDIA H200", help="the GPU's name as torch reports it, or its tuned file's name "
                   "(h200) (default: %(default)s); its committed tuned file, or the GPU defaults where there is none")
    p.add_argument("--tuned", metavar="FILE", help="read this tuned file instead of the GPU's committed one")
    p.add_argument("--rows", default="1,2,3,4,8", help="token rows of a step, comma-separated (default: %(default)s)")
    p.add_argument("--prompt-tokens", default="1024,4604,65536",
                   help="prompt lengths whose prefill settings are shown, comma-separated (default: %(default)s)")
    options.add_preset(p, "flash", help="the model whose projections are listed")
    p.add_argument("--json", action="store_true", help="print one JSON object")


PREFILL_SHOWN = ("chunk", "moe_route", "moe_tag", "moe_rows", "gemm_backend", "weight_gemm_backend", "mhc_rows")
"""The prefill settings shown per prompt length (:data:`~dsv4lab.engine.dispatch.PREFILL_SETTINGS`)."""


def describe_pick(pick) -> str:
    """A choice in a few characters: ``cublas``, or the route and tile (``fma n32k256s6w4``, ``:pq`` for prequant,
    ``:r2`` for two rows per fma program), or the MoE/attention's fields."""
    if pick is None:
        return "kernel default"
    if pick.impl.startswith("cublas"):
        return pick.impl
    f = pick.fields
    if "block_n" in f and "block_k" in f:
        text = f"{pick.route} n{f['block_n']}k{f['block_k']}s{f.get('split_k', 1)}"
        text += f"w{f['num_warps']}" if "num_warps" in f else ""
        return text + (":pq" if f.get("prequant") else "") + (f":r{f['fma_rows']}" if f.get("fma_rows", 1) > 1 else "")
    fields = " ".join(f"{k}={v}" for k, v in sorted(f.items()))
    return f"{pick.route} {fields}" if pick.route else fields


def _pick_json(pick, measured_at: int | None) -> dict:
    out = dict(text=describe_pick(pick), measured_at_rows=measured_at)
    if pick is not None:
        out.update(impl=pick.impl, route=pick.route, fields=pick.fields, where=pick.where)
    return out


def _gpu_name(gpu: str) -> str:
    """The name the GPU's tuned file records, when ``gpu`` names that file ("h200", "nvidia h200"): the dispatch
    uses a file only for the GPU it was measured on, and a short name must not fall back to the defaults."""
    p = tuned_path(gpu)
    return (read_tuned(p).gpu or gpu) if p.is_file() else gpu


def run(args) -> int:
    from dsv4lab.tools.bench.decode.gemv import projection_shapes  # (imports torch)

    rows = options.positive_ints(args.rows, "--rows")
    prompts = options.positive_ints(args.prompt_tokens, "--prompt-tokens")
    tuned = read_tuned(args.tuned) if args.tuned else load_tuned(_gpu_name(args.gpu))
    d = Dispatch(tuned, GPU_DEFAULTS)

    def measured(op: str, r: int, shape: str | None = None) -> int | None:
        e = tuned.lookup(op, r, shape)
        return None if e is None else e["rows"]

    choices = {}
    for name, (n, k, groups, weight, aq) in projection_shapes(get_preset(args.preset)).items():
        key = shape_key(n, k, groups, weight, aq)
        choices[name] = dict(shape=key, by_rows={r: (d.gemv(n // groups, k, r, groups, weight, aq),
                                                     measured("decode.gemv", r, key)) for r in rows})
    choices["routed MoE"] = dict(shape=None, by_rows={r: (d.moe(r), measured("decode.moe", r)) for r in rows})
    choices["attention"] = dict(shape=None, by_rows={r: (d.attention(r), measured("decode.attention", r))
                                                     for r in rows})
    choices["mHC site"] = dict(shape=None, by_rows={r: (d.mhc_site(r), measured("decode.mhc_site", r)) for r in rows})
    fused = {r: [name for name in FUSION_NAMES if d.fused(name, r)] for r in rows}
    prefill = {n: {name: (d.chunk(n) if name == "chunk" else d.prefill(name, n)) for name in PREFILL_SHOWN}
               for n in prompts}
    if args.json:
        print(json.dumps(dict(dispatch=d.describe(), rows=rows, choices={
            name: dict(shape=c["shape"], by_rows={str(r): _pick_json(p, at) for r, (p, at) in c["by_rows"].items()})
            for name, c in choices.items()}, fused_paths={str(r): v for r, v in fused.items()},
            prefill={str(n): v for n, v in prefill.items()}), indent=1))
        return 0
    print(d.describe())
    print("each cell: the choice, and @N the rows its tuned entry was measured at (an entry serves the row counts "
          "above the entry before it, up to N); 'default': nothing measured")
    cells = {name: [f"{describe_pick(p)} {'default' if at is None else f'@{at}'}" for p, at in c["by_rows"].values()]
             for name, c in choices.items()}
    width = max(len(name) for name in cells)
    cw = max([len(f"rows {r}") for r in rows]
             + [len(x) for name, cs in cells.items() for x in cs if name not in LONG])
    print(f"{'':{width}}  " + "  ".join(f"{'rows ' + str(r):{cw}}" for r in rows))
    for name, cs in cells.items():
        if name in LONG:  # long field lists: one line per row count
            for r, x in zip(rows, cs):
                print(f"{name:{width}}  rows {r}: {x}")
        else:
            print(f"{name:{width}}  " + "  ".join(f"{x:{cw}}" for x in cs))
    for r in rows:
        print(f"{'fused paths':{width}}  rows {r}: {', '.join(fused[r]) or 'none'}")
    for n in prompts:
        print(f"{'prefill':{width}}  {n} tokens: "
              + "  ".join(f"{k}={'-' if v in ('', None) else v}" for k, v in prefill[n].items()))
    return 0


LONG = ("routed MoE", "attention", "mHC site")
