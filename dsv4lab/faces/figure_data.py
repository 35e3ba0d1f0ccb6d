"""What each notebook figure plots: committed measurements, the paper's numbers and the cost model, put side by side.

The notebooks call these functions and hand the result to :mod:`dsv4lab.faces.plots`; ``tests/test_figures.py`` calls
the same ones, so every figure is tested on the data it shows. Every number keeps its kind (``source``:
``measured`` on this project's hardware, ``modelled`` by :mod:`dsv4lab.tools.perf`, or ``reported`` by the paper) and
every measured set its provenance, so a figure can say where each number comes from.

End-to-end measurements (:func:`e2e_runs`) come from ``data/results/<gpu>/e2e_1gpu.json`` (one GPU, a ``--layers``
cut of the model that fits it) and ``e2e.json`` (two GPUs, the whole model); either may be absent — the figures
then say "not measured yet" and show the command that measures it. Fields read (``dsv4lab bench e2e``):
``gpu, commit, ranks, tp, ep, layers`` (absent: the whole model), ``copy_bw_gbps``, ``summary.{decode_tok_s,
mbu, ttft_s, prefill_input_tok_s}``, ``ttft.prompt_tokens``, ``decode[].{batch, tok_s, mbu, context}``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from dsv4lab.core.config import ModelArgs, get_preset
from dsv4lab.core.errors import RunError
from dsv4lab.faces.measurements import load_results_file, provenance, results_path
from dsv4lab.core.paths import REPO_ROOT, display_path
from dsv4lab.tools.perf import account as perf_account
from dsv4lab.tools.perf.costmodel import decode_step, prefill
from dsv4lab.tools.perf.hardware import Hardware, load_hardware
from dsv4lab.tools.perf.roofline import compare_kernel_results, kernel_predictions, roofline_report

MEASURED, MODELLED, REPORTED = "measured", "modelled", "reported"

E2E_FILES = (  # (file under data/results/<gpu>/, what it is, the command that writes it on the GPU machine)
    ("e2e_1gpu", "one GPU, a --layers cut", "dsv4lab bench e2e --nproc 1 --layers 30 --out data/results/h200/e2e_1gpu.json"),
    ("e2e", "two GPUs, TP2, the whole model", "dsv4lab bench e2e --nproc 2 --tp 2 --out data/results/h200/e2e.json"),
)
PAPER_CONTEXT = 140  # mean position of the paper's 256-token decode run after a short prompt (perf.account)

_E2E_FIELDS = ("gpu", "commit", "tp", "copy_bw_gbps", "summary.decode_tok_s", "summary.mbu", "summary.ttft_s",
               "summary.prefill_input_tok_s", "ttft.prompt_tokens")
FIELDS_READ: dict[str, tuple[str, ...]] = {
    # decode_kernels: 03's kernel figure and ablation table, 05's measured roofline points
    "decode_kernels": ("gpu", "commit", "copy_bw_gbps", "rows[].kernel", "rows[].variant", "rows[].batch",
                       "rows[].time_us", "rows[].bytes", "rows[].gbps", "rows[].pct_copy_bw"),
    # prefill_kernels: 04's throughput figure (tokens against tflops) and sorter table, 05's GEMM points
    "prefill_kernels": ("gpu", "commit", "rows[].kernel", "rows[].variant", "rows[].tokens", "rows[].time_us",
                        "rows[].tflops"),
    # e2e_1gpu, e2e: 05's whole-step point, 06's decode and prefill standing, 05's waterfall (e2e_runs)
    "e2e_1gpu": _E2E_FIELDS, "e2e": _E2E_FIELDS,
}
"""The fields of each committed results file (``data/results/<gpu>/<name>.json``) the figures read: ``a.b`` a
nested field, ``rows[].x`` a field of every row. ``tests/test_figures.py`` checks every committed file has them, so
a figure never draws a default in place of a field a benchmark stopped writing."""


def missing_fields(doc: Mapping[str, Any], fields: Sequence[str]) -> list[str]:
    """The ``fields`` (as in :data:`FIELDS_READ`) ``doc`` lacks: ``rows[7].tflops`` names the first row without it."""
    lacking = []
    for spec in fields:
        if "[]." in spec:
            head, tail = spec.split("[].", 1)
            items = doc.get(head)
            if not isinstance(items, list):
                lacking.append(head)
                continue
            bad = next((i for i, r in enumerate(items) if not isinstance(r, Mapping) or tail not in r), None)
            if bad is not None:
                lacking.append(f"{head}[{bad}].{tail}")
            continue
        node: Any = doc
        for part in spec.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if node is None:
            lacking.append(spec)
    return list(dict.fromkeys(lacking))


# ============================================================================================ end to end
def flash_cut(layers: int | None) -> ModelArgs:
    """DeepSeek-V4-Flash with only its first ``layers`` main layers (their real SWA/CSA/HCA ratios, MTP kept):
    the cut ``bench e2e --layers`` measures on one GPU. ``None`` or the full count: the whole model."""
    flash = get_preset("flash")
    if not layers or layers >= flash.n_layers:
        return flash
    ratios = flash.compress_ratios[:layers] + flash.compress_ratios[flash.n_layers:]
    return flash.replace(n_layers=layers, compress_ratios=ratios, n_hash_layers=min(flash.n_hash_layers, layers))


def e2e_runs(gpu: str = "h200", files: Sequence[tuple[str, str, str]] = E2E_FILES,
             paths: Mapping[str, str | Path] | None = None) -> list[dict[str, Any]]:
    """One entry per end-to-end results file, present or not.

    Present: ``present=True`` and ``gpus, tp, ep, layers, full_layers, decode_tok_s, mbu, ttft_s,
    prompt_tokens, prefill_input_tok_s, copy_bw_gbps, gpu, commit, provenance, label`` (``None`` where the file
    does not say). Absent: ``present=False`` with the ``file`` and the ``command`` that measures it. ``paths``
    overrides a file's location (tests)."""
    full = get_preset("flash").n_layers
    out = []
    for name, what, command in files:
        path = Path(paths[name]) if paths and name in paths else results_path(name, gpu)
        doc = load_results_file(name, gpu, path=path)
        entry: dict[str, Any] = dict(name=name, what=what, file=display_path(path), command=command,
                                     present=doc is not None)
        if doc is None:
            out.append(entry)
            continue
        lacking = missing_fields(doc, FIELDS_READ.get(name, _E2E_FIELDS))
        if lacking:
            raise RunError(f"{display_path(path)}: lacks {lacking}, which the end-to-end figures read")
        summary = doc.get("summary") or {}
        gpus = int(doc.get("ranks") or doc.get("nproc") or 1)
        layers = int(doc.get("layers") or full)
        ttft = doc.get("ttft") or {}
        entry.update(gpus=gpus, tp=doc.get("tp"), ep=doc.get("ep"), layers=layers, full_layers=full,
                     decode_tok_s=_num(summary.get("decode_tok_s")), mbu=_num(summary.get("mbu")),
                     ttft_s=_num(summary.get("ttft_s")), prompt_tokens=ttft.get("prompt_tokens"),
                     prefill_input_tok_s=_num(summary.get("prefill_input_tok_s")),
                     copy_bw_gbps=_num(doc.get("copy_bw_gbps")), gpu=doc.get("gpu"), commit=doc.get("commit"),
                     decode=list(doc.get("decode") or []), provenance=provenance(doc),
                     label=f"{gpus}×{_gpu_short(doc.get('gpu'))}" + (f", {layers} of {full} layers"
                                                                     if layers < full else ", whole model"))
        out.append(entry)
    return out


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _gpu_short(name: str | None) -> str:
    return str(name or "GPU").replace("NVIDIA ", "")


def e2e_bounds(run: Mapping[str, Any], hardware: str | Hardware = "h200-sxm", context: int = 4096) -> dict[str, float]:
    """The cost model's roofline for the setting a run measured (its cut, GPUs and TP): decode tok/s at batch 1
    and prefill input tok/s of its prompt. Bandwidth at the run's own measured copy bandwidth when it has one."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    args = flash_cut(run.get("layers"))
    tp = int(run.get("tp") or run.get("gpus") or 1)
    ep = int(run.get("ep") or 1)
    dec = roofline_report(args, hw, tp=tp, ep=ep, batch=1, context=context)
    pre = roofline_report(args, hw, tp=tp, ep=ep, phase="prefill", context=int(run.get("prompt_tokens") or 4604))
    return dict(decode_bound_tok_s=dec["bound_tok_s"], prefill_bound_tok_s=pre["bound_tok_s"],
                decode_bytes_per_token_per_gpu=dec["bytes_per_token_per_rank"],
                decode_flops_per_token_per_gpu=dec["flops_per_token_per_rank"])


# ============================================================================================ 06: where we stand
def decode_standing(gpu: str = "h200") -> list[dict[str, Any]]:
    """Batch-1 decode, the paper beside this project: one bar each with its roofline bound (tok/s)."""
    headline = perf_account.load_paper("headline")
    paper = perf_account.paper_account()
    rows = [dict(label="paper: 4×MI250 GCD, TP4", value=float(headline["decode"]["tok_s"]), source=REPORTED,
                 bound=paper["bandwidth"]["bound_tok_s"])]
    target = perf_account.predict_account("h200-sxm")
    for run in e2e_runs(gpu):
        if not run["present"]:
            rows.append(dict(label=f"dsv4lab: {run['what']}", value=None, source=MEASURED,
                             missing=f"not measured yet\n({run['file']})"))
            continue
        rows.append(dict(label=f"dsv4lab: {run['label']}", value=run["decode_tok_s"], source=MEASURED,
                         bound=e2e_bounds(run)["decode_bound_tok_s"], provenance=run["provenance"]))
    rows.append(dict(label="cost model: 2×H200, TP2", value=target["predicted_tok_s"], source=MODELLED,
                     bound=target["bound_tok_s"]))
    return rows


def prefill_standing(gpu: str = "h200") -> list[dict[str, Any]]:
    """Prefill input tok/s of the paper's 4,604-token prompt (TTFT), the paper beside this project."""
    pf = perf_account.paper_account()["prefill"]
    rows = [dict(label="paper: 4×MI250 GCD, TP4", value=pf["reported_input_tok_s"], source=REPORTED,
                 bound=pf["bound_input_tok_s"], ttft_s=pf["reported_ttft_s"])]
    for run in e2e_runs(gpu):
        if not run["present"] or run.get("prefill_input_tok_s") is None:
            rows.append(dict(label=f"dsv4lab: {run['what']}", value=None, source=MEASURED,
                             missing=f"not measured yet\n({run['file']})"))
            continue
        rows.append(dict(label=f"dsv4lab: {run['label']}", value=run["prefill_input_tok_s"], source=MEASURED,
                         bound=e2e_bounds(run)["prefill_bound_tok_s"], ttft_s=run["ttft_s"],
                         provenance=run["provenance"]))
    rows.append(dict(label="cost model: 4×MI250 GCD, TP4", value=pf["model_input_tok_s"], source=MODELLED,
                     bound=pf["bound_input_tok_s"]))
    return rows


# ============================================================================================ 03: steps of many tokens
def multitoken_tables(doc: Mapping[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """The rows of a ``bench e2e`` run that carry more than one token a step, as three tables: ``batches`` (tok/s,
    MBU and bytes per step at every batch), ``verify`` (the verify step of ``k`` drafts and the whole speculative
    cycle against the one-token step, beside the bytes ratios of the same steps) and ``speculative`` (injected
    acceptance α: tok/s against plain greedy of the same run, the modelled bytes-bound ideal beside it, and whether
    every output equalled plain greedy). A table the run did not measure is empty; ``doc`` None gives three."""
    doc = doc or {}
    batches = [dict(batch=r["batch"], tok_s=r["tok_s"], mbu=r["mbu"], path=r.get("path"),
                    gb_per_step=round(r["bytes_per_step"] / 1e9, 3) if r.get("bytes_per_step") else None)
               for r in doc.get("decode") or []]
    verify = [dict(draft_tokens=r["draft_tokens"], verify_over_step=r["verify_over_step"], bytes_ratio=r["bytes_ratio"],
                   over_bytes_ratio=round(r["verify_over_step"] / r["bytes_ratio"], 3),
                   cycle_over_step=r.get("cycle_over_step"), cycle_bytes_ratio=r.get("cycle_bytes_ratio"),
                   step_us=r.get("step_us"), verify_us=r.get("verify_us"))
              for r in doc.get("verify") or []]
    speculative = [dict(alpha=r["alpha"], draft_tokens=r["draft_tokens"], tok_s=r["tok_s"],
                        greedy_tok_s=r.get("greedy_tok_s"), speedup=r["speedup"],
                        ideal_speedup_modelled=r.get("ideal_speedup_modelled"), of_ideal=r.get("of_ideal"),
                        equal_to_greedy=r["equal_to_greedy"])
                   for r in doc.get("speculative") or []]
    return dict(batches=batches, verify=verify, speculative=speculative)


def fusion_table(doc: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The fused-path A/B of a ``bench e2e`` run (its ``fusions`` section): per batch and configuration (off, each
    path alone, all on) tok/s, the speedup over off, launches per layer, whether the ids equal off's, and whether
    the run recommends the path at that batch; a configuration whose kernels failed carries its ``error`` and no
    timing. Empty where the run did not time them (``doc`` None too)."""
    f = (doc or {}).get("fusions") or {}
    chosen = f.get("recommended") or {}
    return [dict(batch=r["batch"], config=r["config"], error=r["error"]) if r.get("error") else
            dict(batch=r["batch"], config=r["config"], tok_s=r["tok_s"], speedup=r["speedup"],
                 launches_per_layer=r["launches_per_layer"], ids_equal_off=r["ids_equal_off"],
                 recommended=r["config"] in chosen.get(str(r["batch"]), []))
            for r in f.get("rows") or []]


# ============================================================================================ 03: decode kernels
KERNEL_NAMES = {"moe_decode": "routed MoE (6 experts)", "attn_decode": "attention", "decode_layer": "whole CSA layer",
                "mhc_site": "mHC site (post + pre + norm)",
                "moe_grouped_gemm": "grouped FP4 MoE GEMM", "attn_prefill": "sparse attention (prefill)",
                "indexer": "indexer scores", "fp8_gemm": "FP8 block-scaled GEMM", "moe_sort": "expert sorter",
                "compressor_pool": "compressor pooling", "chunked_prefill": "one chunked-prefill layer"}


NOT_A_VARIANT = ("baseline", "part", "floor")
"""Decode rows that time something beside a kernel's variants: torch baselines, parts of a kernel's time (the mHC
site with one Sinkhorn iteration, …) and floors (an empty launch)."""


def kernel_name(kernel: str) -> str:
    """A readable name for a benchmarked kernel (``fp8_gemv_wq_a`` → ``FP8 GEMV wq_a``, ``bf16_gemv_head`` →
    ``BF16 GEMV head``)."""
    return KERNEL_NAMES.get(kernel, kernel.replace("fp8_gemv_", "FP8 GEMV ").replace("bf16_gemv_", "BF16 GEMV "))


def _doc_path(doc: Mapping[str, Any]) -> Path:
    """The file a results document was read from (:func:`~dsv4lab.faces.measurements.load_results_file` keeps it in
    ``_path``, relative to the repository when inside it)."""
    p = Path(str(doc["_path"]))
    return p if p.is_absolute() else REPO_ROOT / p


def _is_library(row: Mapping[str, Any]) -> bool:
    """A vendor-library row (cuBLAS): by its route, or by its name in files that predate the route."""
    return row.get("route") == "cublas" or "cublas" in str(row["variant"])


def decode_kernels(doc: Mapping[str, Any] | None, hardware: str | Hardware = "h200-sxm",
                   batch: int = 1) -> list[dict[str, Any]]:
    """One row per decode kernel at ``batch``: the best own (Triton) variant, the other variants, cuBLAS, the
    same bytes read by ``torch.sum``, the cost model's time and the floor (the kernel's bytes at the copy bandwidth
    measured in the same run). Without ``doc`` (nothing committed): the model and its floor only."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    if doc is None:
        return [dict(kernel=k, label=kernel_name(k), modelled_us=p["time_us"], floor_us=p["floor_us"],
                     variants=0) for k, p in kernel_predictions(hw, batch=batch).items()]
    compared = compare_kernel_results(_doc_path(doc), hw)["rows"]
    raw = {(r["kernel"], r["variant"], int(r["batch"])): r for r in doc["rows"]}
    by_kernel: dict[str, list[dict]] = {}
    for r in compared:
        if r["batch"] == batch:
            by_kernel.setdefault(r["kernel"], []).append(dict(r, route=raw[(r["kernel"], r["variant"], batch)]
                                                              .get("route", "")))
    rows = []
    for kernel, rs in by_kernel.items():
        library = [r for r in rs if _is_library(r)]
        own = [r for r in rs if r["route"] not in NOT_A_VARIANT and not _is_library(r)]
        if not own:
            continue
        best = min(own, key=lambda r: r["measured_us"])
        read = [r for r in rs if r["variant"] == "torch_sum_read"]
        rows.append(dict(kernel=kernel, label=kernel_name(kernel), best_variant=best["variant"],
                         best_us=best["measured_us"], pct_copy_bw=best["pct_copy_bw"],
                         other_us=[r["measured_us"] for r in own if r is not best],
                         library_us=min((r["measured_us"] for r in library), default=None),
                         library_variant=min(library, key=lambda r: r["measured_us"])["variant"] if library else None,
                         read_us=read[0]["measured_us"] if read else None,
                         modelled_us=best.get("predicted_us"), floor_us=best["floor_us_at_copy_bw"],
                         variants=len(own)))
    return rows


def decode_variant_table(doc: Mapping[str, Any], batch: int = 1, top: int = 3) -> list[dict[str, Any]]:
    """The variant ablation as a compact table: per kernel its ``top`` fastest variants at ``batch``."""
    out = []
    by_kernel: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        if int(r["batch"]) == batch:
            by_kernel.setdefault(r["kernel"], []).append(r)
    for kernel, rs in by_kernel.items():
        rs = sorted(rs, key=lambda r: r["time_us"])
        for rank, r in enumerate(rs[:top], 1):
            out.append(dict(kernel=kernel, rank=rank, variant=r["variant"], route=r.get("route"),
                            time_us=r["time_us"], pct_copy_bw=r["pct_copy_bw"],
                            of=len(rs) if rank == 1 else None))
    return out


# ============================================================================================ 04: prefill
def prefill_model_rows(hardware: str | Hardware = "h200-sxm", tokens: Sequence[int] = (512, 1024, 2048, 4096, 8192)
                       ) -> list[dict[str, Any]]:
    """The cost model's whole-prefill rate against prompt length, per GPU (no measurements): rows like
    ``prefill_kernels.json``'s with ``source="modelled"``."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    mi250 = load_hardware("mi250-gcd")
    flash = get_preset("flash")
    rows = []
    for name, h, tp in ((f"{hw.name}, one GPU", hw, 1), ("mi250-gcd, TP4 (per GCD)", mi250, 4)):
        for n in tokens:
            rep = roofline_report(flash, h, tp=tp, phase="prefill", context=n)
            tok_s = rep["predicted"]["tok_s"]
            rows.append(dict(kernel="whole prefill", variant=name, tokens=n, input_tok_s=tok_s, source=MODELLED,
                             tflops=rep["flops_per_token_per_rank"] * tok_s / 1e12))
    return rows


def prefill_peaks(doc: Mapping[str, Any] | None, hardware: str | Hardware = "h200-sxm") -> dict[str, tuple[float, str]]:
    """Matrix peaks for the prefill figure: measured in the same run when the file has them, else the datasheet
    (``{dtype: (TFLOP/s, "measured" | "datasheet")}``)."""
    if doc is not None and doc.get("peaks"):
        return {k.removesuffix("_tflops"): (float(v), MEASURED) for k, v in doc["peaks"].items()
                if k.endswith("_tflops")}
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    return {d: (hw.matrix_tflops(d), "datasheet") for d in ("bf16", "fp8") if hw.matrix_tflops(d)}


def prefill_chunk_account(hardware: str | Hardware, prompt_tokens: int, chunks: Sequence[int | None]
                          ) -> list[dict[str, Any]]:
    """Notebook 04's chunk account: the cost model's prefill of a ``prompt_tokens`` prompt on MI250 GCDs in the
    paper's setting (:data:`~dsv4lab.tools.perf.account.PAPER_PREFILL_SETTING`, the same as the paper's prefill
    account that notebook 06 plots, so one modelled paper prefill has one value) at each chunk size, with the
    paper's reported rate beside its chunk (2,048), then ``hardware`` in one pass. Rows for
    :func:`dsv4lab.faces.plots.plot_step_waterfall` (``label, tokens, components_us, reported_rate,
    reported_step_us``) and ``modelled_input_tok_s``."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    mi250, flash = load_hardware("mi250-gcd"), get_preset("flash")
    final = {m["id"]: m for m in perf_account.load_paper("prefill_milestones")["milestones"]}["sorter_64"]
    setting = perf_account.PAPER_PREFILL_SETTING
    rows = []
    for chunk in chunks:
        rep = roofline_report(flash, mi250, phase="prefill", context=prompt_tokens, chunk=chunk, **setting)
        paper = chunk == perf_account.PAPER_PREFILL_CHUNK
        rows.append(dict(label=f"4×MI250 GCD TP{setting['tp']}, chunk {chunk or 'none'}", tokens=prompt_tokens,
                         components_us=rep["predicted"]["components_us"],
                         modelled_input_tok_s=rep["predicted"]["tok_s"],
                         reported_rate=final["input_tok_s"] if paper else None,
                         reported_step_us=final["ttft_s"] * 1e6 if paper else None))
    rep = roofline_report(flash, hw, tp=1, phase="prefill", context=prompt_tokens)
    rows.append(dict(label=f"1×{hw.name}, one pass", tokens=prompt_tokens,
                     components_us=rep["predicted"]["components_us"], modelled_input_tok_s=rep["predicted"]["tok_s"]))
    return rows


# ============================================================================================ 05: roofline
def step_points(report: Mapping[str, Any], group: str) -> list[dict[str, Any]]:
    """The ops of a modelled step as roofline points (at the rate the step-time model gives each)."""
    pts = []
    for o in report["ops"]:
        flops, nbytes, us = float(o["flops_rank"]), float(o["bytes_rank"]), float(o["total_us"])
        if flops > 0 and nbytes > 0 and us > 0:
            pts.append(dict(label=o["name"], intensity=flops / nbytes, tflops=flops / (us * 1e-6) / 1e12,
                            source=MODELLED, group=group, us=us))
    return pts


def paper_points(context: int = PAPER_CONTEXT) -> list[dict[str, Any]]:
    """The paper's MI250 measurements as roofline points: reported times, with the FLOPs and bytes of the same
    work counted by the cost model (the paper's TP4 weight layout)."""
    flash = get_preset("flash")
    mi250 = load_hardware("mi250-gcd")
    headline = perf_account.load_paper("headline")
    micro = perf_account.load_paper("microbenchmarks")["entries"]
    step = decode_step(flash, tp=4, context=context, sharding="sglang")
    L = flash.n_layers
    pts = []

    def add(label, flops, nbytes, seconds, offset=(5, -2)):
        pts.append(dict(label=label, intensity=flops / nbytes, tflops=flops / seconds / 1e12, source=REPORTED,
                        group="times on MI250 GCDs", annotate=True, offset=offset))

    dec = roofline_report(flash, mi250, tp=4, context=context, sharding="sglang")
    add("whole decode step (74.5 tok/s)", dec["flops_per_token_per_rank"], dec["bytes_per_token_per_rank"],
        1.0 / float(headline["decode"]["tok_s"]))
    moe = [step.op(n) for n in ("routed.w13", "routed.act", "routed.w2")]
    add("routed-MoE stage", sum(o.flops_rank for o in moe) / L, sum(o.bytes_rank for o in moe) / L,
        float(micro["routed_moe_stage_decode"]["us_per_layer"]) * 1e-6)
    attn = step.op("attn.core")
    add("attention kernel", attn.flops_rank / attn.launches, attn.bytes_rank / attn.launches,
        float(micro["attention_decode"]["us_per_call"]) * 1e-6)
    m2048 = prefill(flash, tokens=2048, tp=4, sharding="sglang")
    pmoe = [m2048.op(n) for n in ("routed.w13", "routed.w2")]
    ms = float(micro["routed_moe_prefill_m2048"]["gate_up_ms"][1]) + float(micro["routed_moe_prefill_m2048"]["down_ms"][1])
    add("MoE prefill, M=2048", sum(o.flops_rank for o in pmoe) / L, sum(o.bytes_rank for o in pmoe) / L, ms * 1e-3,
        offset=(5, -9))
    pf = roofline_report(flash, mi250, tp=4, phase="prefill", context=int(headline["prefill"]["prompt_tokens"]),
                         chunk=2048, sharding="sglang")
    add("whole prefill (2,234 tok/s)", pf["flops_per_token_per_rank"], pf["bytes_per_token_per_rank"],
        1.0 / float(headline["prefill"]["input_tok_s"]), offset=(6, 3))
    return pts


def measured_points(gpu: str = "h200", hardware: str | Hardware = "h200-sxm", batch: int = 1
                    ) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """This project's measurements as roofline points: ``(points, provenance lines, notes on what is missing)``.

    Decode kernels (best own variant at ``batch``; bytes as measured, FLOPs of the same call from the cost
    model), prefill GEMMs at 4,096 tokens (FP8 projections: FLOPs and bytes from their shapes; grouped MoE: the
    cost model's count), and the whole decode step of the one-GPU end-to-end run."""
    hw = hardware if isinstance(hardware, Hardware) else load_hardware(hardware)
    pts: list[dict[str, Any]] = []
    where: list[str] = []
    missing: list[str] = []
    dec = load_results_file("decode_kernels", gpu)
    if dec is None:
        missing.append(f"decode kernels: not measured yet ({display_path(results_path('decode_kernels', gpu))})")
    else:
        where.append(provenance(dec))
        flops = {k: p["flops"] for k, p in kernel_predictions(hw, batch=batch).items()}
        for r in decode_kernels(dec, hw, batch):
            raw = next(x for x in dec["rows"] if x["kernel"] == r["kernel"] and x["variant"] == r["best_variant"]
                       and int(x["batch"]) == batch)
            if r["kernel"] in flops and flops[r["kernel"]] > 0:
                pts.append(dict(label=r["label"], intensity=flops[r["kernel"]] / float(raw["bytes"]),
                                tflops=flops[r["kernel"]] / (r["best_us"] * 1e-6) / 1e12, source=MEASURED,
                                group=f"decode kernels, batch {batch} (best variant)"))
    pre = load_results_file("prefill_kernels", gpu)
    if pre is None:
        missing.append(f"prefill kernels: not measured yet ({display_path(results_path('prefill_kernels', gpu))})")
    else:
        where.append(provenance(pre))
        gemms: dict[str, dict] = {}
        for r in pre["rows"]:
            if r["kernel"] == "fp8_gemm" and r.get("n") and r.get("k") and r.get("tokens") == 4096 and r.get("tflops"):
                name = str(r["variant"]).split(":")[0]
                if name not in gemms or r["tflops"] > gemms[name]["tflops"]:
                    gemms[name] = r
        for name, r in gemms.items():
            t, n, k = 4096, int(r["n"]), int(r["k"])
            nbytes = n * k + t * k + 2 * t * n  # FP8 weight and activation, bf16 output
            pts.append(dict(label=name, intensity=2.0 * t * n * k / nbytes, tflops=float(r["tflops"]),
                            source=MEASURED, group="FP8 GEMM prefill, 4,096 tokens"))
        moe = [r for r in pre["rows"] if r["kernel"] == "moe_grouped_gemm" and r.get("tokens") == 4096
               and str(r["variant"]).endswith(":total") and r.get("tflops")]
        if moe:
            best = max(moe, key=lambda r: r["tflops"])
            step = prefill(get_preset("flash"), tokens=4096)
            ops = [step.op(n) for n in ("routed.w13", "routed.w2")]
            pts.append(dict(label=f"grouped MoE ({best['variant'].removesuffix(':total')})",
                            intensity=sum(o.flops_rank for o in ops) / sum(o.bytes_rank for o in ops),
                            tflops=float(best["tflops"]), source=MEASURED, group="grouped FP4 MoE prefill, 4,096 tokens"))
    runs = [r for r in e2e_runs(gpu) if r["name"] == "e2e_1gpu"]
    run = runs[0] if runs else None
    if run is None or not run["present"]:
        missing.append("whole decode step: not measured yet (" + (run["file"] if run else "e2e_1gpu.json") + ")")
    elif run.get("decode_tok_s"):
        b = e2e_bounds(run, hw)
        where.append(run["provenance"])
        pts.append(dict(label=f"whole step, {run['label']}", source=MEASURED, group="whole decode step (end to end)",
                        intensity=b["decode_flops_per_token_per_gpu"] / b["decode_bytes_per_token_per_gpu"],
                        tflops=b["decode_flops_per_token_per_gpu"] * run["decode_tok_s"] / 1e12, annotate=True))
    return pts, where, missing


def roofline_panels(hardware: str = "h200-sxm", *, tp: int = 1, batch: int = 1, context: int = 4096,
                    gpu: str = "h200") -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The two panels of notebook 05's roofline: the paper's MI250 GCD with its reported points, and
    ``hardware`` with this project's measured points; each with the modelled ops of one decode step.
    Returns ``(panels, caption)`` (caption: ``measured`` / ``modelled`` / ``reported`` / ``note`` texts)."""
    flash = get_preset("flash")
    mi250 = load_hardware("mi250-gcd")
    hw = load_hardware(hardware)
    paper_step = roofline_report(flash, mi250, tp=4, context=PAPER_CONTEXT, sharding="sglang")
    ours = roofline_report(flash, hw, tp=tp, batch=batch, context=context)
    measured, where, missing = measured_points(gpu, hw, batch)
    panels = [dict(hardware=mi250, title="the paper: MI250 GCD, TP4, batch 1",
                   points=paper_points() + step_points(paper_step, "ops of one decode step (cost model)")),
              dict(hardware=hw, title=f"this project: {hw.name}, TP{tp}, batch {batch}",
                   points=measured + step_points(ours, "ops of one decode step (cost model)"), missing=missing)]
    caption = dict(measured="; ".join(where) or None,
                   modelled=f"cost model (dsv4lab.tools.perf) on the catalogue entries, context {context}",
                   reported="the paper's times on MI250 GCDs (data/paper/)",
                   note="FLOPs and bytes of reported and measured points are counted by the cost model "
                        "(FP8 GEMMs: from their shapes)")
    return panels, caption


# ============================================================================================ 05: account
def milestone_rows(gpu: str = "h200") -> list[dict[str, Any]]:
    """The decode waterfall's rows: the paper's six milestones (reported step time; the model's components where
    it can state them) and the model's H200 TP2 target (with the measured two-GPU run when committed)."""
    account = perf_account.paper_account()
    target = perf_account.predict_account("h200-sxm")
    rows = []
    for m in reversed(account["milestones"]):
        modelled = not m["basis"].startswith("no component time")
        rows.append(dict(label=m["label"], reported_rate=m["reported_tok_s"], reported_step_us=m["reported_step_us"],
                         components_us=m["components_us"] if modelled else None,
                         implied=modelled and not m["independent"], basis=m["basis"]))
    two = next((r for r in e2e_runs(gpu) if r["name"] == "e2e"), None)
    row = dict(label="2×H200, TP2 (this project's target)", components_us=target["components_us"])
    if two is not None:
        row["measured_rate"] = two.get("decode_tok_s") if two["present"] else None
        row["measured_missing"] = None if two["present"] else "not measured\nyet"
    rows.append(row)
    return rows


def bytes_by_component(args: ModelArgs, *, tp: int = 1, ep: int = 1, context: int = 4096,
                       sharding: str = "ideal") -> dict[str, float]:
    """Bytes the busiest rank moves per generated token (batch 1), by §5.1 component, plus the KV cache and
    activations it reads."""
    step = decode_step(args, tp=tp, ep=ep, batch=1, context=context, sharding=sharding)
    out: dict[str, float] = {}
    other = 0.0
    for o in step.compute_ops:
        share = o.weight_bytes_rank / o.weight_bytes if o.weight_bytes else 0.0
        comps = o.components or ({o.component: o.weight_bytes} if o.weight_bytes else {})
        for comp, b in comps.items():
            out[comp] = out.get(comp, 0.0) + b * share
        other += o.other_bytes_rank
    out["KV cache and activations"] = other
    return {k: v / step.tokens for k, v in out.items() if v > 0}


__all__ = ["E2E_FILES", "FIELDS_READ", "missing_fields", "KERNEL_NAMES", "flash_cut", "e2e_runs", "e2e_bounds",
           "decode_standing", "prefill_standing", "kernel_name", "decode_kernels", "decode_variant_table",
           "prefill_model_rows", "prefill_peaks", "prefill_chunk_account", "step_points", "paper_points",
           "measured_points", "roofline_panels", "milestone_rows", "bytes_by_component"]
