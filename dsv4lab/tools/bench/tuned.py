"""How the benchmarks write the tuned file the dispatch reads (:mod:`dsv4lab.engine.dispatch`, schema there).

``dsv4lab bench kernels --suite decode|prefill`` on a GPU turns its result into tuned entries —
:func:`decode_entries` (per projection shape and batch the fastest implementation that passed its bound, per batch
the fastest routed-MoE variant of the reference's semantics and the fastest attention and mHC-site geometries; the
long-context kernels where the context sweep measured them faster, from the entries count where they start to win:
:func:`long_context_entries`) and
:func:`prefill_entries` (the result's ``choices``) — and merges them over a base (:func:`merge_tuned`: by default
the GPU's committed file, so a run that measured part of the ops keeps the rest, each entry naming the
measurement it came from). ``scripts/rebuild_tuned.py`` does the same from committed result files, and converts the
decode dispatch files written before the tuned files existed (:func:`convert_decode_dispatch`).
"""
from __future__ import annotations

from pathlib import Path

from dsv4lab.core.errors import UserError
from dsv4lab.core.paths import display_path, read_json
from dsv4lab.core.provenance import write_json
from dsv4lab.engine.dispatch import OPS, SCHEMA, DispatchError, Tuned, gpu_slug, shape_key, tuned_path
from dsv4lab.engine.kernel_families import MOE_SAME_SEMANTICS

GEOMETRY_OPS = {"decode.attention": "attn_decode", "decode.mhc_site": "mhc_site"}
"""The geometry tiers of the decode suite and the kernel of the result rows each is chosen from."""
PREFILL_CHOICE_OPS = {"prefill.moe": "moe", "prefill.moe_rows": "moe", "prefill.gemm": "gemm_backend",
                      "prefill.weight_gemm": "weight_gemm_backend", "prefill.mhc_rows": "mhc_rows",
                      "prefill.chunk": "chunk"}
"""Each prefill op and the key of the result's ``choices.why`` that explains it."""


def source_of(doc: dict, suite: str) -> tuple[str, dict]:
    """The id (``<commit>/<suite>[-quick]``, then ``:<sections>`` and ``@<batches>`` where the run was narrowed
    to them) and the provenance of a benchmark result: commit, command, GPU name, torch and triton versions. Two
    narrowed runs of one commit (``--sections gemv``, then ``--sections moe``) get two ids, so merging one into
    the other's file keeps each entry's own command."""
    quick = bool(doc.get("quick")) or doc.get("mode") == "quick"
    command = f"dsv4lab bench kernels --suite {suite}" + (" --quick" if quick else "")
    sid = f"{doc.get('commit')}/{suite}" + ("-quick" if quick else "")
    default = {"decode": ("moe", "gemv", "mhc") if quick else ("moe", "gemv", "mhc", "attention", "layer"),
               "prefill": ("moe", "chunks", "dense", "glue", "attention")}[suite]
    if doc.get("sections") and set(doc["sections"]) != set(default):
        command += " --sections " + ",".join(doc["sections"])
        sid += ":" + ",".join(doc["sections"])
    if doc.get("batches"):
        command += " --batches " + ",".join(str(b) for b in doc["batches"])
        sid += "@" + ",".join(str(b) for b in doc["batches"])
    info = dict(commit=doc.get("commit"), command=command, gpu=doc.get("gpu"), torch=doc.get("torch"),
                triton=doc.get("triton"))
    return sid, info


def tuned_doc(gpu: str, sources: dict, ops: dict) -> dict:
    """A tuned file's document (validated: a malformed entry raises naming it)."""
    doc = dict(schema=SCHEMA, gpu=gpu, sources=dict(sorted(sources.items())),
               ops={op: sorted(ops[op], key=lambda e: (e.get("shape") or "", e["rows"])) for op in OPS if ops.get(op)})
    Tuned(doc, "the tuned entries built")
    return doc


# ============================================================================================ decode
def decode_entries(doc: dict, shapes: dict, source: str) -> dict[str, list[dict]]:
    """The tuned entries a decode-suite result measured: ``shapes`` maps a projection's row name to ``(N, K per
    group, groups, weight format, act_quant)`` (``bench.decode.gemv.projection_shapes``). Each entry keeps the
    times it was chosen from."""
    rows = doc["rows"]
    gemv = []
    for kernel, (N, Kg, G, fmt, aq) in shapes.items():
        for T in sorted({r["batch"] for r in rows if r["kernel"] == kernel}):
            cands = [r for r in rows if r["kernel"] == kernel and r["batch"] == T and r.get("choice")]
            if cands:
                best = min(cands, key=lambda r: r["time_us"])
                gemv.append(dict(shape=shape_key(N, Kg, G, fmt, aq), rows=T, choice=best["choice"], source=source,
                                 kernel=kernel, us=best["time_us"], pct_copy_bw=best["pct_copy_bw"],
                                 alternatives={r["variant"]: r["time_us"] for r in cands}))
    moe = []
    for T in sorted({r["batch"] for r in rows if r["kernel"] == "moe_decode"}):
        cands = [r for r in rows if r["kernel"] == "moe_decode" and r["batch"] == T
                 and r.get("route") in MOE_SAME_SEMANTICS]
        if cands:
            best = min(cands, key=lambda r: r["time_us"])
            moe.append(dict(rows=T, choice=dict(route=best["route"], **best["geometry_fields"]), source=source,
                            us=best["time_us"], pct_copy_bw=best["pct_copy_bw"],
                            alternatives={r["variant"]: r["time_us"] for r in cands}))
    out = {"decode.gemv": gemv, "decode.moe": moe}
    for op, kernel in GEOMETRY_OPS.items():  # only geometries whose check passed were timed
        tier = [r for r in rows if r["kernel"] == kernel and r.get("route") == "triton" and r.get("geometry_fields")]
        out[op] = []
        for T in sorted({r["batch"] for r in tier}):
            cands = [r for r in tier if r["batch"] == T]
            best = min(cands, key=lambda r: r["time_us"])
            out[op].append(dict(rows=T, choice=best["geometry_fields"], source=source, variant=best["variant"],
                                us=best["time_us"], alternatives={r["variant"]: r["time_us"] for r in cands}))
    out.update(long_context_entries(rows, source))
    return out


LONG_CONTEXT_OPS = {"decode.indexer": (("indexer_ctx",), "fused"),
                    "decode.attention_split": (("attn_hca_ctx", "attn_csa_ctx"), "slices")}
"""The long-context ops, the result rows of the decode suite's context sweep (kernel names up to the context) and
the ``kernel`` a choice names where today's kernel stays (``bench.decode.long_context``)."""


def long_context_entries(rows: list[dict], source: str) -> dict[str, list[dict]]:
    """Per batch, from the context sweep's rows (``today`` and each long-context variant, with their ``entries``):
    the variant fastest at the most entries measured (the regime these kernels are for; rows of one entry count
    summed: HCA and CSA may list as many rows), chosen (``kernel`` ``split``) if it beats today's kernel there,
    from ``min_entries`` = the fewest entries from which it is faster at every count with at least as many; else an
    entry naming today's kernel, so a base file's older choice does not survive the measurement."""
    out: dict[str, list[dict]] = {}
    for op, (prefixes, today_kernel) in LONG_CONTEXT_OPS.items():
        sweep = [r for r in rows if r["kernel"].startswith(prefixes) and "entries" in r]
        out[op] = []
        for T in sorted({r["batch"] for r in sweep}):
            at = [r for r in sweep if r["batch"] == T]
            today = {(r["kernel"], r["entries"]): r["time_us"] for r in at if r.get("route") == "today"}
            by_variant: dict[str, dict] = {}
            for r in at:
                if r.get("route") == "split" and (r["kernel"], r["entries"]) in today:
                    by_variant.setdefault(r["variant"], {})[(r["kernel"], r["entries"])] = r
            if not today or not by_variant:
                continue
            longest = max(e for _, e in today)
            at_longest = [key for key in today if key[1] == longest]
            cands = {v: rs for v, rs in by_variant.items() if all(key in rs for key in at_longest)}
            if not cands:
                continue
            name, picked = min(cands.items(), key=lambda kv: sum(kv[1][key]["time_us"] for key in at_longest))

            def totals(e, picked=picked, today=today):
                keys = [key for key in today if key[1] == e]
                if not all(key in picked for key in keys):
                    return None
                return sum(picked[key]["time_us"] for key in keys), sum(today[key] for key in keys)
            threshold = None
            for e in sorted({e for _, e in today}, reverse=True):  # from the longest down, while it wins
                t = totals(e)
                if t is None or t[0] >= t[1]:
                    break
                threshold = e
            # the evidence: each candidate's and today's µs summed over the sweep's rows (the batch's contexts)
            sums = {v: round(sum(r["time_us"] for r in rs.values()), 2) for v, rs in by_variant.items()}
            evidence = dict(source=source, rows=T, alternatives=sums | {"today": round(sum(today.values()), 2)})
            if threshold is None:
                out[op].append(dict(choice=dict(kernel=today_kernel), variant="today", **evidence))
            else:
                geometry = next(iter(picked.values()))["geometry_fields"]
                out[op].append(dict(choice=dict(kernel="split", min_entries=threshold, **geometry), variant=name,
                                    **evidence))
    return out


# ============================================================================================ prefill
def prefill_entries(choices: dict, headline: int, source: str) -> dict[str, list[dict]]:
    """The tuned entries of a prefill-suite result's ``choices`` (measured at ``headline`` tokens; the sorter rows
    and the chunk per token count), each with the ``why`` the benchmark gave."""
    why = choices.get("why", {})

    def entry(op: str, rows: int, **choice) -> dict:
        e = dict(rows=rows, choice=choice, source=source)
        if why.get(PREFILL_CHOICE_OPS[op]):
            e["why"] = why[PREFILL_CHOICE_OPS[op]]
        return e
    out: dict[str, list[dict]] = {op: [] for op in PREFILL_CHOICE_OPS}
    if "moe_route" in choices:  # the fields the result holds (an absent one: the launch variant's, else the kernel's)
        moe = {f: choices[k] for f, k in (("route", "moe_route"), ("tag", "moe_tag"), ("decode", "moe_decode"),
                                          ("persistent", "moe_persistent"), ("scale_per_byte", "moe_scale_per_byte"))
               if choices.get(k) is not None}
        out["prefill.moe"].append(entry("prefill.moe", headline, **moe))
    out["prefill.moe_rows"] = [entry("prefill.moe_rows", T, sorter_rows=rows)
                               for T, rows in choices.get("moe_rows_by_tokens", [])]
    for op, key in (("prefill.gemm", "gemm_backend"), ("prefill.weight_gemm", "weight_gemm_backend")):
        if choices.get(key):
            out[op].append(entry(op, headline, backend=choices[key]))
    if choices.get("mhc_rows") is not None:
        mhc = dict(enabled=bool(choices["mhc_rows"]))
        if choices.get("mhc_rows_geometry"):
            mhc["geometry"] = choices["mhc_rows_geometry"]
        out["prefill.mhc_rows"].append(entry("prefill.mhc_rows", headline, **mhc))
    out["prefill.chunk"] = [entry("prefill.chunk", P, chunk=c) for P, c in choices.get("chunk_by_prompt", [])]
    return out


def prefill_headline(doc: dict) -> int:
    """The token count a prefill result's choices of one value were measured at (``headline``; before it was
    recorded, the suite's 4,096)."""
    return int(doc.get("headline") or 4096)


# ============================================================================================ files
def merge_tuned(base: dict | None, fresh: dict, base_name: str = "the base tuned file") -> dict:
    """``fresh`` completed by the entries of ``base`` it does not replace (same op, shape and rows); the sources
    no entry names any more are dropped. Both must be for the same GPU model."""
    if base is None:
        return fresh
    if not isinstance(base, dict):
        raise UserError(f"{base_name}: not a tuned file (a JSON object of schema {SCHEMA!r})")
    try:
        Tuned(base, base_name)
    except DispatchError as err:
        raise UserError(str(err)) from None
    if base.get("gpu") != fresh.get("gpu"):
        raise UserError(f"{base_name}: measured on {base.get('gpu')!r}, these entries on {fresh.get('gpu')!r}: a "
                        "tuned file holds for the GPU it was measured on")
    ops = {op: list(es) for op, es in fresh["ops"].items()}
    for op, entries in base["ops"].items():
        have = {(e.get("shape"), int(e["rows"])) for e in ops.get(op, [])}
        ops.setdefault(op, []).extend(e for e in entries if (e.get("shape"), int(e["rows"])) not in have)
    used = {e["source"] for es in ops.values() for e in es}
    sources = {k: v for k, v in {**base.get("sources", {}), **fresh.get("sources", {})}.items() if k in used}
    return tuned_doc(fresh["gpu"], sources, ops)


def take_ops(doc: dict, ops: list[str] | None) -> dict:
    """``doc`` with only the entries of ``ops`` (None: all)."""
    if ops is None:
        return doc
    unknown = set(ops) - set(OPS)
    if unknown:
        raise UserError(f"unknown op(s) {', '.join(sorted(unknown))}")
    kept = {op: es for op, es in doc["ops"].items() if op in ops}
    used = {e["source"] for es in kept.values() for e in es}
    return tuned_doc(doc["gpu"], {k: v for k, v in doc["sources"].items() if k in used}, kept)


def add_tuned_arguments(p, out_help: str | None = None, ops: bool = True) -> None:
    """``--tuned-out`` and ``--tuned-base`` of ``bench kernels`` (both suites) and of ``bench e2e`` (its own
    ``out_help``), and ``--tuned-ops`` where ``ops``."""
    p.add_argument("--tuned-out", default=None,
                   help=out_help or "where a GPU run writes its measured choices as a tuned file (default: "
                        "tuned_<gpu>.json beside --out); copy it to kernels/dsv4lab_kernels/tuned/ to make it the "
                        "GPU's, or point DSV4LAB_TUNED at it")
    p.add_argument("--tuned-base", default=None,
                   help="the tuned file (same GPU) whose entries this run does not measure are kept in the one it "
                        "writes, each naming its measurement (default: this GPU's file in the kernels package, "
                        "if any; 'none': only this run's entries)")
    if not ops:
        return
    p.add_argument("--tuned-ops", default=None,
                   help="comma-separated ops of the tuned file this run writes (default: every op it measured; "
                        "e.g. prefill.mhc_rows from a --quick run, whose other choices come from fewer variants)")


class TunedWriter:
    """Where a benchmark run writes its tuned entries and the base they are merged over — read before the run
    (the output may be the base itself), and refused before it when measured on another GPU. ``enabled`` False
    (no GPU, or a smoke run: tiny shapes measure nothing worth choosing by) writes nothing."""

    def __init__(self, args, out: Path, gpu: str | None, enabled: bool):
        self.enabled = enabled and gpu is not None
        self.path = Path(getattr(args, "tuned_out", None) or out.with_name(f"tuned_{gpu_slug(gpu or '')}.json"))
        base = getattr(args, "tuned_base", None)
        if base == "none":
            base_path = None
        elif base:
            base_path = Path(base)
        else:
            default = tuned_path(gpu or "")
            base_path = default if default.is_file() else None
        self.base_name = display_path(base_path) if base_path else None
        self.base = read_json(base_path, UserError) if base_path is not None and self.enabled else None
        if self.base is not None and self.base.get("gpu") != gpu:
            raise UserError(f"{self.base_name}: measured on {self.base.get('gpu')!r}, this GPU is {gpu!r}: a tuned "
                            "file only holds for the GPU it was measured on")
        self.gpu = gpu
        spec = getattr(args, "tuned_ops", None)
        self.ops = [o for o in spec.split(",") if o] if spec else None
        if self.ops is not None and set(self.ops) - set(OPS):
            raise UserError(f"--tuned-ops: unknown op(s) {', '.join(sorted(set(self.ops) - set(OPS)))}; known: "
                            f"{', '.join(OPS)}")

    def write(self, source: tuple[str, dict], ops: dict[str, list[dict]]) -> Path | None:
        """Merge ``ops`` (measured by ``source``: id and provenance) over the base and write the file."""
        if self.ops is not None:
            ops = {op: es for op, es in ops.items() if op in self.ops}
        if not self.enabled or not any(ops.values()):
            return None
        fresh = tuned_doc(self.gpu, {source[0]: source[1]}, ops)
        write_json(self.path, merge_tuned(self.base, fresh, self.base_name))
        return self.path


# ============================================================================================ earlier formats
LEGACY_DISPATCH_FORMAT = "dsv4lab.decode-dispatch/1"
_LEGACY_GEMV = dict(impl="triton", route="dot", block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3,
                    unroll=1, prequant=False, cublas_out="float32")
"""What a choice of the earlier decode dispatch file meant where it left a field out."""
_LEGACY_MOE = dict(route="dot", block_n_up=32, block_n_down=32, block_k=256, slot_split=0, num_warps=2,
                   num_stages=3, decode="auto", prequant=False, fma_sums="group")


def convert_decode_dispatch(old: dict, results: dict[str, dict]) -> dict:
    """The tuned file equivalent to a decode dispatch file of the earlier format (``dsv4lab.decode-dispatch/1``,
    ``data/results/h200/decode_dispatch.json``): every entry, its choice completed with the defaults that format
    gave an absent field, each naming the measurement of its commit — ``results`` (commit → that decode result) for
    the versions and the command, the dispatch file's own header for its commit."""
    if old.get("format") != LEGACY_DISPATCH_FORMAT:
        raise UserError(f"not a decode dispatch file of format {LEGACY_DISPATCH_FORMAT!r}")
    sources: dict[str, dict] = {}

    def source(commit: str) -> str:
        res = results.get(commit)
        if res is None and commit == old.get("commit"):
            res = dict(commit=commit, gpu=old.get("gpu"), torch=old.get("torch"), triton=old.get("triton"),
                       quick="--quick" in (old.get("source") or ""))
        if res is None:
            raise UserError(f"no decode result given for commit {commit} of the dispatch file")
        sid, info = source_of(res, "decode")
        sources[sid] = info
        return sid

    def evidence(e: dict, *keys) -> dict:
        return {k: e[k] for k in keys if k in e}
    ops: dict[str, list[dict]] = {"decode.gemv": [], "decode.moe": []}
    for e in old.get("gemv", []):
        choice = {**_LEGACY_GEMV, **e["choice"]}
        ops["decode.gemv"].append(dict(shape=e["shape"], rows=int(e["batch"]), choice=choice,
                                       source=source(e.get("commit", old.get("commit"))),
                                       **evidence(e, "kernel", "us", "pct_copy_bw", "alternatives")))
    for e in old.get("moe", []):
        ops["decode.moe"].append(dict(rows=int(e["batch"]), choice={**_LEGACY_MOE, **e["choice"]},
                                      source=source(e.get("commit", old.get("commit"))),
                                      **evidence(e, "us", "pct_copy_bw", "alternatives")))
    for tier, op in (("attention", "decode.attention"), ("mhc_site", "decode.mhc_site")):
        ops[op] = [dict(rows=int(e["batch"]), choice=dict(e["choice"]),
                        source=source(e.get("commit", old.get("commit"))),
                        **evidence(e, "variant", "us", "alternatives")) for e in old.get(tier, [])]
    return tuned_doc(old["gpu"], sources, ops)


__all__ = ["GEOMETRY_OPS", "PREFILL_CHOICE_OPS", "LONG_CONTEXT_OPS", "long_context_entries", "source_of",
           "tuned_doc", "decode_entries", "prefill_entries",
           "prefill_headline", "merge_tuned", "take_ops", "add_tuned_arguments", "TunedWriter",
           "LEGACY_DISPATCH_FORMAT", "convert_decode_dispatch"]
