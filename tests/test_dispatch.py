"""Kernel choice (:mod:`dsv4lab.engine.dispatch`): the kernel families' tables against the kernels, the tuned files'
schema and lookup, the committed H200 file against the measured choices it was converted from, and the benchmarks
writing the file (:mod:`dsv4lab.tools.bench.tuned`, ``scripts/rebuild_tuned.py``).

The H200's tuned file replaced two earlier formats (``data/results/h200/decode_dispatch.json`` and the ``choices`` of
``data/results/h200/prefill_kernels.json``); :func:`test_the_h200_table_chooses_what_the_earlier_files_chose` states
the earlier lookup rules here, independently of the code that converted them, and requires the same choice for
every op, shape and row count those files covered.
"""
from __future__ import annotations

import json
import subprocess
import sys
import pytest

from conftest import ROOT
from dsv4lab.core.errors import UserError
from dsv4lab.engine import kernel_families as kf
from dsv4lab.engine.dispatch import (GPU_DEFAULTS, OPS, SCHEMA, Dispatch, DispatchError, Tuned, load_tuned,
                                     parse_shape_key, read_tuned, shape_key, tuned_dir, tuned_path)

RESULTS = ROOT / "data" / "results" / "h200"
H200 = tuned_path("NVIDIA H200")
LEGACY_PROVENANCE = ("decode_kernels.json", "decode_kernels_af2b4dc_full.json", "decode_kernels_ed50478_moe.json",
                     "decode_kernels_196c88c_mhc_attention.json")


def _doc(gpu="NVIDIA H200", **ops) -> dict:
    return dict(schema=SCHEMA, gpu=gpu, sources={"t": dict(commit="abc")},
                ops={op: [dict(e, source=e.get("source", "t")) for e in es] for op, es in ops.items()})


# ============================================================================================ the families
def test_every_family_variant_builds_its_kernel_geometry_and_agrees_with_the_kernel_tables():
    """Each variant's fields build its kernel's geometry class (or name one of its configurations); the routes and
    accumulation models are the kernels' own (a route added to a kernel and not to its family could never be chosen,
    and one judged by the wrong model would be judged by the wrong bound)."""
    pytest.importorskip("triton")
    from dsv4lab.engine import triton_backend as tb
    from dsv4lab.engine.kernel_loader import kernel_module
    from dsv4lab.engine.triton_prefill import KIND_MODEL, MOE_ROUTE_KIND
    fg, ap = kernel_module("fp8_gemm"), kernel_module("attention_prefill")
    named = {"fp8_gemm": {**fg.FP8_GEMM_CONFIGS, **fg.WEIGHT_GEMM_CONFIGS},
             "attention_prefill": {**ap.ATTENTION_CONFIGS, **ap.INDEXER_CONFIGS}}
    for family in kf.FAMILIES:
        mod = kernel_module(family.kernel)
        for v in family.variants:
            assert v.runs and v.runs <= set(kf.RUNS), (family.name, v.name)
            assert set(v.ops) <= set(family.ops), (family.name, v.name)
            assert v.route is None or v.route in family.accumulation, (family.name, v.name)
            if family.geometry_class:
                getattr(mod, family.geometry_class)(**v.fields)
            elif "config" in v.fields:
                assert v.fields["config"] in named[family.kernel], (family.name, v.name)
        for model in family.accumulation.values():
            assert model in tb.ACCUMULATION_MODELS, family.name
    gemv, moe, fm = tb.gemv, tb.moe, kernel_module("fp4_moe_grouped")
    assert set(kf.GEMV.accumulation) == set(gemv.ROUTES) | {"cublas"}
    assert all(kf.GEMV.accumulation_of(r) == tb.accumulation_model(c) for r, (_, c) in gemv.ACCUMULATION.items())
    assert set(kf.MOE.accumulation) == set(moe.ROUTES) and kf.MOE_SAME_SEMANTICS == moe.SAME_SEMANTICS
    assert all(kf.MOE.accumulation_of(r) == tb.accumulation_model(c) for r, (_, c) in moe.ACCUMULATION.items())
    assert set(kf.PREFILL_MOE.accumulation) == set(fm.ROUTES)
    assert all(KIND_MODEL[MOE_ROUTE_KIND[r]] == kf.PREFILL_MOE.accumulation_of(r) for r in fm.ROUTES)
    assert set(kf.moe_tags()) == {v.name for v in kf.PREFILL_MOE.variants if "verify" not in v.runs}
    assert "f16" not in kf.moe_tags("fp8") and "f16" in kf.moe_tags("bf16") and "w16" in kf.moe_tags("scaled")
    with pytest.raises(ValueError, match="unknown run"):
        kf.variant("x", runs="nightly")


# ============================================================================================ the tuned table
def test_lookup_takes_the_fewest_rows_at_or_above_the_call_and_the_defaults_elsewhere():
    key = shape_key(96, 256, 1, "fp8", True)
    d = Dispatch(Tuned(_doc(**{"decode.gemv": [
        dict(shape=key, rows=1, choice=dict(impl="triton", route="fma", block_n=16, block_k=128, split_k=2)),
        dict(shape=key, rows=8, choice=dict(impl="cublas", cublas_out="bfloat16"))],
        "decode.moe": [dict(rows=4, choice=dict(route="fma", block_n_up=32))],
        "prefill.gemm": [dict(rows=4096, choice=dict(backend="triton"))]}), "t.json"), GPU_DEFAULTS)
    assert d.gemv(96, 256, 1).route == "fma" and d.gemv(96, 256, 1).fields["split_k"] == 2
    assert d.gemv(96, 256, 2).impl == "cublas:bfloat16"  # the fewest measured rows ≥ 2 are 8
    assert d.gemv(96, 256, 33).impl == "cublas:bfloat16"  # above every tier: the most rows
    own = d.gemv(96, 256, 1, act_quant=False)  # another shape key: the own kernel's default
    assert (own.impl, own.route, own.where) == ("triton", "dot", "default")
    assert own.fields == dict(block_n=32, block_k=256, split_k=1)  # K is one tile: nothing to split
    assert d.own_gemv(96, 4096).fields == dict(block_n=32, block_k=512, split_k=8)  # 3 row blocks: K split 8 ways
    assert d.moe(1).route == "fma" and d.moe(1).fields == dict(block_n_up=32)
    assert d.moe().route == "fma" and d.moe().fields == GPU_DEFAULTS.moe_geometry  # the stages: the default
    assert d.prefill("gemm_backend", 64) == "triton" and d.prefill("gemm_backend") == "triton"
    assert d.prefill("weight_gemm_backend", 64) == "auto" and d.prefill("moe_decode") is None
    assert d.attention(1).fields == GPU_DEFAULTS.attention_geometry and d.mhc_site(1) is None
    assert "t.json: decode.gemv[0]" in d.gemv(96, 256, 1).where and len(d.tuned) == 4
    assert parse_shape_key(key) == (96, 256, 1, "fp8", True)


@pytest.mark.parametrize("doc, message", [
    (dict(schema="dsv4lab.tuned/0"), "schema 'dsv4lab.tuned/0'"),
    (_doc(**{"decode.gemm": []}), "unknown op 'decode.gemm'"),
    (_doc(**{"decode.moe": [dict(choice={})]}), r"decode.moe\[0\]: needs 'rows'"),
    (_doc(**{"decode.moe": [dict(rows="one", choice={})]}), "'rows' must be an integer"),
    (_doc(**{"decode.gemv": [dict(rows=1, choice={})]}), r"decode.gemv\[0\]: needs 'shape'"),
    (_doc(**{"decode.moe": [dict(rows=1, choice={}, source="x")]}), "source 'x' is not among 'sources'"),
    (_doc(**{"prefill.gemm": [dict(rows=1, choice=dict(backnd="triton"))]}), r"unknown choice field\(s\) backnd"),
    (_doc(**{"decode.fusion": [dict(rows=1, choice=dict(moe_sites=True))]}), r"unknown choice field\(s\) moe_sites"),
    (_doc(**{"decode.fusion": [dict(rows=1, choice=dict(greedy=1))]}), "each fused path is true or false"),
])
def test_a_malformed_tuned_file_is_refused_naming_the_entry(doc, message):
    with pytest.raises(DispatchError, match=message):
        Tuned(doc, "bad.json")


def test_a_fused_path_runs_where_the_tuned_entry_or_the_device_default_says():
    """``decode.fusion``: the entry's choice for the names it gives, the device default for the others (the GPU's:
    none until measured; the interpreter's: all, the same bits with fewer launches)."""
    from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS
    tuned = Tuned(_doc(**{"decode.fusion": [dict(rows=4, choice=dict(moe_site=True)),
                                            dict(rows=16, choice=dict(moe_site=False, greedy=True))]}), "t.json")
    gpu = Dispatch(tuned, GPU_DEFAULTS)
    assert gpu.fused("moe_site", 1) and not gpu.fused("greedy", 1)  # greedy: not in the entry, off by default
    assert not gpu.fused("moe_site", 8) and gpu.fused("greedy", 8)
    assert not any(Dispatch(None, GPU_DEFAULTS).fused(n, 1) for n in kf.FUSION_NAMES)
    assert all(Dispatch(None, INTERPRETER_DEFAULTS).fused(n, 1) for n in kf.FUSION_NAMES)
    with pytest.raises(ValueError, match="unknown fused path 'argmax'"):
        gpu.fused("argmax", 1)


def test_a_field_the_kernel_lacks_is_refused_naming_the_entry():
    pytest.importorskip("triton")
    from dsv4lab.core.model.numerics import Numerics
    from dsv4lab.engine.triton_backend import TritonOps
    ops = TritonOps(Numerics(), Dispatch(Tuned(_doc(**{"decode.attention": [dict(rows=1, choice=dict(block_q=3))]}),
                                              "bad.json"), GPU_DEFAULTS))
    with pytest.raises(DispatchError, match=r"bad.json: decode.attention\[0\] \(t\): AttentionGeometry: .*block_q"):
        ops.attention_choice(1)


def test_the_tuned_file_of_the_gpu_and_the_environment(tmp_path, monkeypatch):
    """A GPU reads ``tuned/<its name>.json`` (or the file ``DSV4LAB_TUNED`` names) only if it was measured on it;
    ``DSV4LAB_TUNED=off`` and no GPU give the defaults; the retired variables are refused naming the new one."""
    assert H200 == tuned_dir() / "h200.json" and H200.is_file()
    assert tuned_path("NVIDIA H100 80GB HBM3").name == "h100_80gb_hbm3.json"
    assert len(load_tuned("NVIDIA H200")) > 0 and load_tuned("NVIDIA H200").gpu == "NVIDIA H200"
    assert len(load_tuned("NVIDIA A100-SXM4-80GB")) == 0 and len(load_tuned(None)) == 0
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps(_doc(**{"prefill.mhc_rows": [dict(rows=4096, choice=dict(enabled=False))]})))
    monkeypatch.setenv("DSV4LAB_TUNED", str(fresh))
    assert Dispatch(load_tuned("NVIDIA H200")).prefill("mhc_rows", 4096) is False
    assert len(load_tuned("NVIDIA A100-SXM4-80GB")) == 0  # measured elsewhere: the defaults
    monkeypatch.setenv("DSV4LAB_TUNED", "off")
    assert len(load_tuned("NVIDIA H200")) == 0
    monkeypatch.setenv("DSV4LAB_TUNED", str(tmp_path / "absent.json"))
    with pytest.raises(DispatchError, match="absent.json does not exist"):
        load_tuned("NVIDIA H200")
    monkeypatch.delenv("DSV4LAB_TUNED")
    fresh.write_text("{")
    with pytest.raises(DispatchError, match="not valid JSON"):
        read_tuned(fresh)
    monkeypatch.setenv("DSV4LAB_DECODE_DISPATCH", "off")
    with pytest.raises(DispatchError, match="DSV4LAB_DECODE_DISPATCH is no longer read: point DSV4LAB_TUNED"):
        load_tuned("NVIDIA H200")


# ============================================================================================ the committed file
def _convert_the_earlier_files() -> dict:
    from dsv4lab.tools.bench.tuned import (convert_decode_dispatch, merge_tuned, prefill_entries, prefill_headline,
                                           source_of, tuned_doc)
    provenance = {d["commit"]: d for d in (json.loads((RESULTS / n).read_text()) for n in LEGACY_PROVENANCE)}
    decode = convert_decode_dispatch(json.loads((RESULTS / "decode_dispatch.json").read_text()), provenance)
    pre = json.loads((RESULTS / "prefill_kernels.json").read_text())
    sid, info = source_of(pre, "prefill")
    prefill = tuned_doc(pre["gpu"], {sid: info}, prefill_entries(pre["choices"], prefill_headline(pre), sid))
    return merge_tuned(decode, prefill, "decode_dispatch.json")


def test_the_committed_h200_file_is_the_conversion_of_the_earlier_files():
    """``kernels/dsv4lab_kernels/tuned/h200.json`` is exactly what ``scripts/rebuild_tuned.py`` makes of the decode
    dispatch file and the prefill benchmark's choices (the command in its docstring)."""
    assert json.loads(H200.read_text()) == _convert_the_earlier_files()


def _earlier_tier(entries: list[dict], rows: int) -> dict:
    """The earlier decode dispatch's rule: the entry at the smallest measured batch ≥ rows, else the largest."""
    table = {int(e["batch"]): e["choice"] for e in entries}
    above = [b for b in table if b >= rows]
    return table[min(above)] if above else table[max(table)]


def _earlier_lookup(pairs: list, n: int, default):
    """The earlier prefill choices' rule: the first (up to, value) with n ≤ up to, else the last value."""
    return next((v for upto, v in pairs if n <= upto), pairs[-1][1] if pairs else default)


def test_the_h200_table_chooses_what_the_earlier_files_chose():
    old = json.loads((RESULTS / "decode_dispatch.json").read_text())
    d = Dispatch(read_tuned(H200), GPU_DEFAULTS)
    # what the earlier format meant where a choice left a field out (its GemvChoice / MoeChoice defaults)
    gemv_defaults = dict(impl="triton", route="dot", block_n=32, block_k=256, split_k=1, num_warps=4, num_stages=3,
                         unroll=1, prequant=False, cublas_out="float32")
    moe_defaults = dict(route="dot", block_n_up=32, block_n_down=32, block_k=256, slot_split=0, num_warps=2,
                        num_stages=3, decode="auto", prequant=False, fma_sums="group")
    rows_checked = (*range(1, 65), 100, 4096)
    checked = 0
    for key in {e["shape"] for e in old["gemv"]}:
        n, k, groups, weight, aq = parse_shape_key(key)
        for rows in rows_checked:
            want = {**gemv_defaults, **_earlier_tier([e for e in old["gemv"] if e["shape"] == key], rows)}
            impl, out = want.pop("impl"), want.pop("cublas_out")
            got = d.gemv(n // groups, k, rows, groups, weight, aq)
            assert (got.impl, got.route, got.fields) == (
                impl if impl != "cublas" or out == "float32" else f"cublas:{out}", want.pop("route"), want), (key, rows)
            checked += 1
    for rows in rows_checked:
        want = {**moe_defaults, **_earlier_tier(old["moe"], rows)}
        got = d.moe(rows)
        assert (got.route, got.fields) == (want.pop("route"), want), rows
        assert d.attention(rows).fields == _earlier_tier(old["attention"], rows), rows
        assert d.mhc_site(rows).fields == _earlier_tier(old["mhc_site"], rows), rows
        checked += 3
    c = json.loads((RESULTS / "prefill_kernels.json").read_text())["choices"]
    for tokens in (1, 63, 64, 100, 512, 513, 1024, 2048, 3000, 4096, 4605, 8192, 9000, 20000):
        for name in ("moe_route", "moe_tag", "moe_decode", "moe_persistent", "moe_scale_per_byte", "gemm_backend",
                     "weight_gemm_backend", "mhc_rows", "mhc_rows_geometry"):
            assert d.prefill(name, tokens) == c[name], (name, tokens)
        assert d.prefill("moe_rows", tokens) == _earlier_lookup(c["moe_rows_by_tokens"], tokens, 64), tokens
        checked += 10
    for prompt in range(1, 20001, 13):
        chunk = _earlier_lookup(c["chunk_by_prompt"], prompt, None)
        want = min(prompt, 4096) if chunk is None else prompt if chunk == 0 else min(chunk, prompt)
        assert d.chunk(prompt) == want, prompt
        checked += 1
    assert checked > 2500  # every shape × 66 row counts, the other ops, 1,539 prompt lengths


def test_every_committed_tuned_entry_builds_its_kernels_geometry():
    pytest.importorskip("triton")
    from dsv4lab.engine.kernel_loader import kernel_module
    files = sorted(tuned_dir().glob("*.json"))
    assert H200 in files
    for path in files:
        t = read_tuned(path)
        for op, (_, own, cls) in OPS.items():
            for e in t.entries(op):
                if cls:
                    module, name = cls.split(".")
                    getattr(kernel_module(module), name)(**{k: v for k, v in e["choice"].items() if k not in own})
        d = Dispatch(t)
        assert d.prefill("moe_tag") in kf.moe_tags() and d.prefill("gemm_backend") in ("triton", "cublas", "auto")
        assert d.prefill("mhc_rows_geometry") in ("", *kernel_module("mhc").ROWS_GEOMETRIES)


# ============================================================================================ writing it
def test_bench_writes_the_entries_it_measured():
    """Per shape and batch the fastest row that passed (rows exist only for variants that passed), never a
    baseline; per batch the fastest MoE of the reference's semantics and the fastest geometries (not the mHC parts
    and floors); the dispatch reads them back."""
    from dsv4lab.core.config import get_preset
    from dsv4lab.tools.bench.decode import projection_shapes
    from dsv4lab.tools.bench.tuned import decode_entries, tuned_doc
    dot = dict(impl="triton", route="dot", block_n=16, block_k=256, split_k=8, num_warps=1, num_stages=3)
    attn = dict(block_h=16, block_r=64, splits=16, num_warps=8, two_pass=False, combine_columns=0)
    rows = [dict(kernel="fp8_gemv_wq_a+wkv", variant="dot:n16", batch=1, time_us=7.0, pct_copy_bw=20, choice=dot),
            dict(kernel="fp8_gemv_wq_a+wkv", variant="cublas_scaled_mm_blockwise", batch=1, time_us=6.0,
                 pct_copy_bw=25, choice=dict(impl="cublas")),
            dict(kernel="fp8_gemv_wq_a+wkv", variant="dot:n16", batch=8, time_us=7.5, pct_copy_bw=20, choice=dot),
            dict(kernel="moe_decode", variant="dot:n32", batch=1, time_us=40.0, pct_copy_bw=45, route="dot",
                 geometry_fields=dict(block_n_up=32, block_n_down=32)),
            dict(kernel="moe_decode", variant="torch_sum_read", batch=1, time_us=20.0, pct_copy_bw=90,
                 route="baseline"),
            dict(kernel="attn_decode", variant="h16r32_s16_1p", batch=1, time_us=31.0, route="triton",
                 geometry_fields=dict(attn, block_r=32)),
            dict(kernel="attn_decode", variant="h16r64_s16_1p", batch=1, time_us=23.0, route="triton",
                 geometry_fields=attn),
            dict(kernel="attn_decode", variant="torch_gather", batch=1, time_us=20.0, route="baseline"),
            dict(kernel="mhc_site", variant="default", batch=1, time_us=14.0, route="triton",
                 geometry_fields=dict(splits=128, block_d=32, block_dn=2048, num_warps=8)),
            dict(kernel="mhc_site", variant="head_collapse", batch=1, time_us=5.0, route="part"),
            dict(kernel="mhc_site", variant="empty_launch", batch=1, time_us=2.0, route="floor")]
    doc = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc", rows=rows)
    ops = decode_entries(doc, projection_shapes(get_preset("flash")), "abc/decode")
    d = Dispatch(Tuned(tuned_doc("NVIDIA H200", {"abc/decode": {}}, ops)))
    assert d.gemv(1536, 4096, 1).impl == "cublas"  # faster and passed
    assert d.gemv(1536, 4096, 4).route == "dot"  # batch 8's choice
    assert d.moe(1).route == "dot" and d.moe(1).fields["block_n_up"] == 32  # never the baseline
    assert d.attention(1).fields == attn and [e["variant"] for e in ops["decode.mhc_site"]] == ["default"]


def test_a_run_cut_short_keeps_the_base_entries_it_did_not_measure(tmp_path):
    """The fresh run's entries win, the others come from the base with the measurement they name; a base from
    another GPU model is refused before the run, naming the file."""
    from argparse import Namespace

    from dsv4lab.tools.bench.tuned import TunedWriter, merge_tuned

    def entry(shape, rows, split, source="old"):
        return dict(shape=shape, rows=rows, source=source, choice=dict(impl="triton", route="fma", split_k=split))
    a, b = shape_key(1536, 4096, 1, "fp8", True), shape_key(4096, 8192, 1, "fp8", True)
    base = _doc(**{"decode.gemv": [entry(a, 1, 3), entry(b, 1, 5), entry(b, 8, 7, "older")],
                   "decode.moe": [dict(rows=1, choice=dict(route="fma"), source="old"),
                                  dict(rows=8, choice=dict(route="dot"), source="old")]})
    base["sources"] = {"old": dict(commit="old"), "older": dict(commit="older"), "gone": dict(commit="gone")}
    fresh = _doc(**{"decode.gemv": [entry(a, 1, 6, "new")], "decode.moe": [dict(rows=1, choice=dict(route="dot"),
                                                                                  source="new")]})
    fresh["sources"] = {"new": dict(commit="new")}
    m = merge_tuned(base, fresh, "base.json")
    by = {(e["shape"], e["rows"]): e for e in m["ops"]["decode.gemv"]}
    assert by[(a, 1)]["choice"]["split_k"] == 6 and by[(a, 1)]["source"] == "new"  # the fresh run wins
    assert by[(b, 1)]["source"] == "old" and by[(b, 8)]["source"] == "older"  # carried, each with its source
    assert {e["rows"]: e["source"] for e in m["ops"]["decode.moe"]} == {1: "new", 8: "old"}
    assert set(m["sources"]) == {"new", "old", "older"}  # a source no entry names is dropped
    with pytest.raises(UserError, match="base.json: measured on 'NVIDIA H100'"):
        merge_tuned(dict(base, gpu="NVIDIA H100"), fresh, "base.json")
    with pytest.raises(UserError, match=r"base.json: decode.moe\[0\]: needs 'rows'"):  # a malformed base, named
        merge_tuned(dict(base, ops={"decode.moe": [dict(choice={})]}), fresh, "base.json")
    other = tmp_path / "a100.json"
    other.write_text(json.dumps(_doc(gpu="NVIDIA A100-SXM4-80GB")))
    args = Namespace(tuned_out=None, tuned_base=str(other), tuned_ops=None)
    with pytest.raises(UserError, match="a100.json: measured on 'NVIDIA A100-SXM4-80GB', this GPU is 'NVIDIA H200'"):
        TunedWriter(args, tmp_path / "decode.json", "NVIDIA H200", enabled=True)
    out = TunedWriter(Namespace(tuned_out=None, tuned_base="none", tuned_ops="decode.moe"), tmp_path / "d.json",
                      "NVIDIA H200", enabled=True).write(("new", dict(commit="new")), fresh["ops"])
    assert out == tmp_path / "tuned_h200.json" and set(json.loads(out.read_text())["ops"]) == {"decode.moe"}


def test_rebuild_script_takes_some_ops_and_sets_a_choice_by_hand(tmp_path):
    """``scripts/rebuild_tuned.py``: a fresh prefill result's mHC choice over the committed file, the rest kept;
    a choice forced by hand is recorded as such; a result of another GPU and a bad ``--set`` are refused in one
    line, writing nothing."""
    fresh = tmp_path / "glue.json"
    fresh.write_text(json.dumps(dict(suite="prefill", gpu="NVIDIA H200", commit="f00d", torch="2.11", triton="3.6",
                                     mode="quick", sections=["glue"], headline=4096,
                                     choices=dict(mhc_rows=False, mhc_rows_geometry="m64d4w4", why={}))))
    script = [sys.executable, str(ROOT / "scripts" / "rebuild_tuned.py")]
    out = tmp_path / "h200.json"
    r = subprocess.run(script + [str(fresh), "--base", str(H200), "--ops", "prefill.mhc_rows", "--set",
                                 "prefill.gemm.backend=triton", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d, committed = Dispatch(read_tuned(out)), Dispatch(read_tuned(H200))
    assert (d.prefill("mhc_rows"), d.prefill("mhc_rows_geometry")) == (False, "m64d4w4")
    assert d.prefill("gemm_backend") == "triton" and d.prefill("moe_route") == committed.prefill("moe_route")
    doc = json.loads(out.read_text())
    assert doc["ops"]["prefill.mhc_rows"][0]["source"] == "f00d/prefill-quick:glue"
    assert doc["sources"]["f00d/prefill-quick:glue"]["command"].endswith("--quick --sections glue")
    assert doc["ops"]["prefill.gemm"][0]["source"] == "set-by-hand" and doc["ops"]["decode.gemv"] == json.loads(
        H200.read_text())["ops"]["decode.gemv"]
    fresh.write_text(json.dumps(dict(json.loads(fresh.read_text()), gpu="NVIDIA A100-SXM4-80GB")))
    r = subprocess.run(script + [str(fresh), "--base", str(H200), "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "A100" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run(script + [str(H200), "--set", "prefill.gemm", "--out", str(tmp_path / "x.json")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "expected OP.FIELD=VALUE" in r.stderr and not (tmp_path / "x.json").exists()


def test_two_narrowed_runs_of_one_commit_keep_their_own_sources():
    """A ``--sections gemv --batches 1,2,4`` run and a ``--sections moe --batches 1,8`` run of the same commit
    merged into one tuned file: each entry still names the command that measured it (one id for both used to
    give the gemv entries the moe run's command)."""
    from dsv4lab.tools.bench.tuned import merge_tuned, source_of, tuned_doc
    base = dict(suite="decode", gpu="NVIDIA H100 80GB HBM3", commit="f00d", torch="2.11", triton="3.6", quick=True)
    gemv_id, gemv_info = source_of(dict(base, sections=["gemv"], batches=[1, 2, 4]), "decode")
    moe_id, moe_info = source_of(dict(base, sections=["moe"], batches=[1, 8]), "decode")
    assert gemv_id != moe_id and source_of(dict(base), "decode")[0] == "f00d/decode-quick"
    assert moe_info["command"] == "dsv4lab bench kernels --suite decode --quick --sections moe --batches 1,8"
    moe = dict(route="fma", block_n_up=8, block_n_down=8)
    gemv = dict(impl="cublas")
    shape = shape_key(32768, 1024, 1, "fp8", True)
    a = tuned_doc(base["gpu"], {gemv_id: gemv_info}, {"decode.gemv": [dict(shape=shape, rows=2, choice=gemv,
                                                                           source=gemv_id)]})
    b = tuned_doc(base["gpu"], {moe_id: moe_info}, {"decode.moe": [dict(rows=8, choice=moe, source=moe_id)]})
    merged = merge_tuned(a, b)
    assert merged["sources"] == {gemv_id: gemv_info, moe_id: moe_info}
    assert merged["ops"]["decode.gemv"][0]["source"] == gemv_id and merged["ops"]["decode.moe"][0]["source"] == moe_id


def test_family_lists_reach_the_benchmarks():
    """The benchmarks iterate the families' lists: the decode suite's MoE and GEMV variants per mode, the
    prefill suite's plan of configurations."""
    from dsv4lab.tools.bench.decode import gemv_variants, moe_variants
    from dsv4lab.tools.bench.prefill import plan_variants
    assert [(v.route, v.block_n, v.prequant, v.fma_rows) for v in gemv_variants(False, True)] == [
        ("fma", 32, False, 1), ("fma", 16, False, 1), ("fma", 64, False, 1), ("dot", 16, False, 1),
        ("dot", 64, True, 1), ("fma", 32, False, 2), ("fma", 64, False, 2)]
    assert [n for _, n, _ in moe_variants(False, True)] == [
        "n32k256w2s3", "n8k256w1s2", "n8k256w1s2:bytewise:prequant", "n16k256w1s2", "n16k256w1s2", "n64k128w4s3",
        "n32x64k128w4s3:tile"]  # the last two: the fp8lut route's
    assert len(moe_variants(False, False)) == len(kf.MOE.runs("full")) and len(moe_variants(True, False)) == 5
    quick, full = plan_variants("quick", ("bf16", "fp8"), "bf16"), plan_variants("full", ("bf16",), "bf16")
    assert quick["tags"] == ["f16", "persistent", "w16"] and quick["gemm"] == ("m128n128",)
    assert full["gemm"] == ("m128n128", "m128n256", "m64n128") and full["indexer"][1] == "q2t64x8"


def test_the_decode_ops_redefine_no_private_helper_of_the_prefill_ops():
    """TritonOps subclasses TritonPrefillOps: a private helper of the same name in the subclass silently replaces
    the prefill's (a decode-MoE ``_moe_plan`` once took the prefill chunks' calls, with other arguments)."""
    from dsv4lab.engine.triton_backend import TritonOps
    from dsv4lab.engine.triton_prefill import TritonPrefillOps
    helpers = {n for n in vars(TritonPrefillOps) if n.startswith("_") and not n.startswith("__")}
    assert not helpers & set(vars(TritonOps)), sorted(helpers & set(vars(TritonOps)))
