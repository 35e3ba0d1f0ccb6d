"""``bench e2e``'s fused-path A/B (:mod:`dsv4lab.tools.bench.e2e_fusions`): the choice it makes from synthetic
measurements (CPU timings mean nothing), the tuned entries it writes and the dispatch reading them, the default
batches. The run itself on the smoke model: ``tests/test_bench_e2e.py``."""
from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from conftest import ROOT
from dsv4lab.core.errors import UserError
from dsv4lab.engine.dispatch import (GPU_DEFAULTS, INTERPRETER_DEFAULTS, SCHEMA, Dispatch, Tuned, read_tuned,
                                     shape_key)
from dsv4lab.engine.kernel_families import FUSION_NAMES
from dsv4lab.faces.figure_data import fusion_table
from dsv4lab.tools.bench import e2e, e2e_fusions
from dsv4lab.tools.bench.e2e_fusions import (MIN_MARGIN, configurations, format_fusions, fusion_section, recommend,
                                             tuned_ops, with_fusions)
from dsv4lab.tools.bench.tuned import TunedWriter, merge_tuned


def _row(batch, config, speedup=1.0, launches=100, equal=True, rounds=(100.0, 100.0)):
    return dict(batch=batch, config=config, speedup=speedup, launches_per_step=launches, ids_equal_off=equal,
                rounds_tok_s=list(rounds))


def test_a_path_is_recommended_when_it_beats_off_by_the_noise_of_the_off_rounds():
    """Per batch: the margin is the spread of that batch's off rounds (at least MIN_MARGIN); a path above 1 +
    margin with equal ids and fewer launches is recommended, one below it, or saving no launch, is not."""
    rows = [_row(1, "off", rounds=(100.0, 102.0, 98.0, 100.0)),  # spread 4 % of the median
            _row(1, "p", speedup=1.05, launches=90), _row(1, "q", speedup=1.03, launches=97),
            _row(1, "r", speedup=1.2, launches=100),  # faster by chance: it launched what off launched
            _row(8, "off", rounds=(200.0, 200.0)),  # no spread: the floor
            _row(8, "p", speedup=1.0 + MIN_MARGIN / 2, launches=90), _row(8, "q", speedup=1.0 + 2 * MIN_MARGIN,
                                                                          launches=97)]
    out = recommend(rows, names=("p", "q", "r", "s"))
    assert out["noise"] == {"1": 0.04, "8": 0.0} and out["margin"] == {"1": 0.04, "8": MIN_MARGIN}
    assert out["recommended"] == {"1": ["p"], "8": ["q"]} and out["mismatches"] == []
    assert out["why"]["1"]["q"].startswith("speedup 1.03 < 1 + margin 0.04")
    assert out["why"]["1"]["r"].startswith("no launch saved") and out["why"]["1"]["s"] == "not measured"


def test_where_all_on_wins_the_paths_not_slower_alone_are_taken_too():
    """Each path saves a launch per layer or so, below the noise alone: where all on clears the margin, a path at
    speedup >= 1 alone joins; one slower alone, saving no launch or with other ids does not; all on below the
    margin takes nothing extra."""
    off = _row(1, "off", rounds=(100.0, 102.0, 98.0, 100.0))  # margin 0.04
    paths = [_row(1, "p", speedup=1.01, launches=97), _row(1, "q", speedup=0.99, launches=97),
             _row(1, "r", speedup=1.02, launches=100), _row(1, "s", speedup=1.0, launches=98)]
    out = recommend([off, *paths, _row(1, "all", speedup=1.06, launches=90)], names=("p", "q", "r", "s"))
    assert out["recommended"] == {"1": ["p", "s"]}
    assert out["why"]["1"]["p"].startswith("speedup 1.01 >= 1 and all on 1.06")
    assert out["why"]["1"]["q"].startswith("speedup 0.99 < 1 + margin") and out["why"]["1"]["r"].startswith("no launch")
    out = recommend([off, *paths, _row(1, "all", speedup=1.03, launches=90)], names=("p", "q", "r", "s"))
    assert out["recommended"] == {"1": []}
    out = recommend([off, *paths, _row(1, "all", speedup=1.06, launches=90), _row(1, "t", equal=False)],
                    names=("p", "q", "r", "s", "t"))
    assert out["recommended"] == {"1": []}  # a mismatch anywhere: nothing rides on all on


def test_a_path_whose_kernels_failed_is_reported_and_the_others_still_chosen():
    """A configuration that raised (a compile error, a launch) is a row with its error and no timing: that path is
    never recommended, the others are judged as before; where all on failed no path is (interactions unseen); the
    section, its tuned entries and the printed lines take such rows."""
    off = _row(1, "off", rounds=(100.0, 100.0))
    failed = dict(batch=1, config="q", on=["q"], error="CompilationError: at 25:47:")
    out = recommend([off, _row(1, "p", speedup=1.05, launches=90), failed], names=("p", "q"))
    assert out["recommended"] == {"1": ["p"]} and out["errors"] == {"q": "CompilationError: at 25:47:"}
    assert out["why"]["1"]["q"] == "failed: CompilationError: at 25:47:" and out["mismatches"] == []
    out = recommend([off, _row(1, "p", speedup=1.05, launches=90), dict(failed, config="all")], names=("p",))
    assert out["recommended"] == {"1": []} and out["why"]["1"]["p"].startswith("all on failed")
    rows = [dict(off, config="off", tok_s=100.0, launches_per_layer=1.0),
            dict(_row(1, "p", speedup=1.05, launches=90), tok_s=105.0, launches_per_layer=0.9), failed]
    doc = dict(commit="abc1234", gpu="NVIDIA H200")
    section = fusion_section(rows, doc, dict(layers=30, fusion_batches=[1], decode_tokens=64, rounds=4, smoke=False,
                                             fusions=["p", "q"]))
    assert section["errors"] == {"q": "CompilationError: at 25:47:"}
    assert section["tuned"]["decode.fusion"][0]["speedup"] == {"p": 1.05}
    printed = "\n".join(format_fusions(dict(doc, fusions=section)))
    assert "FUSION FAILED: q: CompilationError" in printed and "p 105.0 tok/s" in printed
    table = fusion_table(dict(fusions=section))
    assert {"config": "q", "batch": 1, "error": "CompilationError: at 25:47:"} in table


def test_a_failing_path_is_a_row_with_its_error_and_the_a_b_goes_on(monkeypatch):
    """``fusion_rows`` on the smoke interpreter model with one path's kernels raising (as the greedy kernel's
    compile error did on the H200 at 11a5fe7, which lost the whole A/B): that path and all on become rows with their
    error, off and the other path are timed with equal ids, and the choice leaves the failed path out."""
    o = dict(seed=0, fusion_batches=[1], fusions=["x_projections", "attention_norms"], fusion_tokens=1, rounds=1,
             smoke=True)
    runner = e2e_fusions.smoke_runner(o)
    counted = e2e_fusions._launches

    def failing(runner_, step, tokens):
        if runner_.ops.config.fused("x_projections", tokens.shape[0]):
            raise RuntimeError("CompilationError: the kernel refused\nsecond line")
        return counted(runner_, step, tokens)
    monkeypatch.setattr(e2e_fusions, "_launches", failing)

    class Clock:
        def sync(self):
            pass
    rows = {r["config"]: r for r in e2e_fusions.fusion_rows(runner, Clock(), 1, o)}
    assert set(rows) == {"off", "x_projections", "attention_norms", "all"}
    refused = "RuntimeError: CompilationError: the kernel refused"
    assert rows["x_projections"]["error"] == rows["all"]["error"] == refused
    assert rows["off"]["ids_equal_off"] and rows["attention_norms"]["ids_equal_off"]
    assert rows["attention_norms"]["launches_saved"] > 0 and "error" not in rows["off"]
    out = recommend(list(rows.values()), names=o["fusions"])
    assert set(out["errors"]) == {"x_projections", "all"} and out["recommended"] == {"1": []}


def test_a_path_whose_ids_differ_anywhere_is_never_recommended():
    """Bit-exactness is the fused paths' claim: ids differing at one batch block the path at every batch; all on
    differing (an interaction) or off differing from itself blocks every path."""
    fast = dict(speedup=1.5, launches=50)
    base = [_row(1, "off"), _row(1, "p", **fast), _row(1, "q", **fast), _row(8, "off"), _row(8, "p", **fast)]
    out = recommend(base + [_row(8, "q", equal=False, **fast)], names=("p", "q"))
    assert out["recommended"] == {"1": ["p"], "8": ["p"]} and out["mismatches"] == ["q at batch 8"]
    assert out["why"]["1"]["q"] == "ids differ from off's"
    out = recommend(base + [_row(8, "q", **fast), _row(1, "all", equal=False, **fast)], names=("p", "q"))
    assert out["recommended"] == {"1": [], "8": []} and out["mismatches"] == ["all at batch 1"]
    out = recommend([_row(1, "off", equal=False), _row(1, "p", **fast)], names=("p",))
    assert out["recommended"] == {"1": []} and "differs from itself" in out["mismatches"][0]


def _measured(recommended_at: dict[int, set]) -> tuple[list[dict], dict]:
    """Synthetic rows of every ``FUSION_NAMES`` path at batches 1 and 8 where the paths of ``recommended_at`` win."""
    rows = []
    for b in (1, 8):
        rows.append(dict(_row(b, "off", rounds=(100.0, 100.5)), tok_s=100.0))
        for n in FUSION_NAMES:
            wins = n in recommended_at.get(b, set())
            rows.append(dict(_row(b, n, speedup=1.08 if wins else 0.99, launches=90), tok_s=100.0))
    doc = dict(commit="abc1234", gpu="NVIDIA H200", torch="2.11", triton="3.6")
    o = dict(layers=30, fusion_batches=[1, 8], decode_tokens=128, rounds=3, smoke=False,
             out="runs/h200/e2e_1gpu.json")
    return rows, dict(doc, benchmark="e2e", smoke=False, fusions=fusion_section(rows, doc, o))


def test_the_recommended_entries_are_what_the_dispatch_then_chooses(tmp_path):
    """The section's tuned entries (one per batch, every path named) read by the dispatch give, at every row
    count, the choice of the batch that holds it (up to 1: batch 1's; 2 to 8 and above: batch 8's); merged into a
    tuned file by the benchmarks' writer over a base, the base's other entries and its other rows stay."""
    first = FUSION_NAMES[0]
    _, doc = _measured({1: {first}, 8: set(FUSION_NAMES)})
    f = doc["fusions"]
    assert f["recommended"] == {"1": [first], "8": list(FUSION_NAMES)}
    (sid, source), = f["tuned"]["sources"].items()
    assert sid == "abc1234/e2e" and source["result"] == "e2e_1gpu.json" and "--fusion-batches 1,8" in source["command"]
    d = Dispatch(Tuned(dict(schema=SCHEMA, gpu="NVIDIA H200", sources=f["tuned"]["sources"],
                            ops={"decode.fusion": f["tuned"]["decode.fusion"]}), "pasted"), GPU_DEFAULTS)
    for rows in (1, 2, 8, 32):
        assert {n for n in FUSION_NAMES if d.fused(n, rows)} == ({first} if rows == 1 else set(FUSION_NAMES))
    base = tmp_path / "base.json"
    moe = dict(rows=1, source="old", choice=dict(route="fma"))
    old_fusion = dict(rows=64, source="old", choice={n: True for n in FUSION_NAMES})
    base.write_text(json.dumps(dict(schema=SCHEMA, gpu="NVIDIA H200", sources={"old": {}},
                                    ops={"decode.moe": [moe], "decode.fusion": [old_fusion]})))
    out = tmp_path / "tuned.json"
    writer = TunedWriter(argparse.Namespace(tuned_out=str(out), tuned_base=str(base)), tmp_path / "e2e.json",
                         "NVIDIA H200", enabled=True)
    assert writer.write(*tuned_ops(doc)) == out
    merged = read_tuned(out)
    assert [e["rows"] for e in merged.entries("decode.fusion")] == [1, 8, 64] and merged.entries("decode.moe")
    assert Dispatch(merged).moe(1).route == "fma" and Dispatch(merged).fused(first, 1)
    with pytest.raises(UserError, match="smoke run"):
        tuned_ops(dict(doc, smoke=True))
    with pytest.raises(UserError, match="timed no fused path"):
        tuned_ops(dict(doc, fusions=None))


def test_rebuild_tuned_takes_the_fusion_entries_of_an_e2e_result():
    """``scripts/rebuild_tuned.py`` takes an e2e result's ``decode.fusion`` entries (the route from a committed result
    to the committed tuned file), merged over the committed H200 file; an e2e result that timed none is refused
    naming the file."""
    spec = importlib.util.spec_from_file_location("rebuild_tuned", ROOT / "scripts" / "rebuild_tuned.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    _, doc = _measured({1: set(FUSION_NAMES)})
    committed = json.loads((ROOT / "kernels/dsv4lab_kernels/tuned/h200.json").read_text())
    out = merge_tuned(committed, script.entries_of(doc, "e2e_1gpu.json", {}))
    d = Dispatch(Tuned(out, "rebuilt"))
    assert all(d.fused(n, 1) and not d.fused(n, 8) for n in FUSION_NAMES) and d.tuned.entries("decode.gemv")
    with pytest.raises(UserError, match="e2e_1gpu.json: this bench e2e result timed no fused path"):
        script.entries_of(dict(doc, fusions=None), "e2e_1gpu.json", {})


def test_each_configuration_replaces_only_the_fusion_choice_of_the_engines_dispatch():
    """``with_fusions``: the engine's tuned entries and defaults kept (a configuration changes nothing but the fused
    paths), its ``decode.fusion`` replaced at every row count; the configurations are off, each alone, all."""
    key = shape_key(1536, 4096, 1, "fp8", True)
    gemv = dict(shape=key, rows=8, source="m", choice=dict(impl="triton", route="fma", block_n=16))
    engine = Dispatch(Tuned(dict(schema=SCHEMA, gpu="NVIDIA H200", sources={"m": {}}, ops={
        "decode.gemv": [gemv], "decode.fusion": [dict(rows=1, source="m", choice={n: True for n in FUSION_NAMES})]}),
        "h200.json"), INTERPRETER_DEFAULTS)
    configs = configurations()
    assert list(configs)[:len(FUSION_NAMES) + 1] == ["off", *FUSION_NAMES]
    assert list(configurations(FUSION_NAMES[:1])) == ["off", FUSION_NAMES[0], "all"]  # --fusions: a subset alone
    assert ("all" in configs) == (len(FUSION_NAMES) > 1)
    for name, choice in configs.items():
        d = with_fusions(engine, choice, name)
        pick, kept = d.gemv(1536, 4096, 8), engine.gemv(1536, 4096, 8)
        assert d.defaults is INTERPRETER_DEFAULTS and (pick.impl, pick.route, pick.fields) == ("triton", "fma",
                                                                                               kept.fields)
        assert kept.fields == dict(block_n=16) and d.own_gemv(64, 256) == engine.own_gemv(64, 256)
        assert all(d.fused(n, rows) == choice[n] for n in FUSION_NAMES for rows in (1, 8, 64))
    assert all(engine.fused(n, 1) for n in FUSION_NAMES)  # the engine's own dispatch untouched


def test_the_fused_paths_are_timed_by_default_on_a_gpu_run_of_one_rank():
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)

    def batches(*argv):
        return e2e.options(p.parse_args(list(argv)))["fusion_batches"]
    assert batches() == [1, 8] and batches("--batches", "1,4") == [1] and batches("--fusion-batches", "") == []
    assert batches("--nproc", "2", "--tp", "2") == [] and batches("--backend", "reference") == []
    assert batches("--smoke") == [] and batches("--smoke", "--fusion-batches", "1") == [1]
    assert batches("--fusion-batches", "2,16") == [2, 16]
