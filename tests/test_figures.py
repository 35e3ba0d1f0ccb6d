"""Every figure, rendered on the data it shows, passes the figure rules — checked on the matplotlib objects.

Each function of :data:`dsv4lab.faces.plots.FIGURES` is drawn here through the same :mod:`dsv4lab.faces.figure_data` calls the
notebooks make, on the committed results under ``data/results/h200/`` (and on a small synthetic end-to-end file
for the measurements not committed yet), and :func:`dsv4lab.faces.plots.figure_problems` must find nothing: a title,
labelled axes, the caption saying where the numbers come from, at most 12 legend entries, no two alike. Then the
figures the issue found misleading are checked for what they must now say. The rules themselves are tested on
planted mistakes. About 30 s on one core.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest

from dsv4lab.faces import figure_data, measurements, plots
from dsv4lab.core.paths import RESULTS_DIR
from dsv4lab.tools.perf import account as perf_account
from dsv4lab.faces.plots import style

E2E_1GPU = dict(  # the fields `dsv4lab bench e2e --nproc 1 --layers 30` writes that the figures read
    benchmark="e2e", model="flash", layers=30, ranks=1, tp=1, ep=1, gpu="NVIDIA H200", torch="2.11.0+cu130",
    triton="3.6.0", commit="abc1234", copy_bw_gbps=4240.0,
    decode=[dict(batch=1, tok_s=19.3, mbu=0.038, context=144), dict(batch=8, tok_s=120.0, mbu=0.03, context=144)],
    ttft=dict(prompt_tokens=4604, ttft_s=1.25, chunk=2048),
    summary=dict(decode_tok_s=19.3, decode_batch=1, mbu=0.038, ttft_s=1.25, prefill_input_tok_s=3683.2))


@pytest.fixture
def results_with_e2e(tmp_path, monkeypatch):
    """The committed H200 results plus a synthetic one-GPU end-to-end file, as ``data/results`` for the test."""
    h200 = tmp_path / "h200"
    shutil.copytree(RESULTS_DIR / "h200", h200, ignore=shutil.ignore_patterns("logs"))
    (h200 / "e2e_1gpu.json").write_text(json.dumps(E2E_1GPU))
    (h200 / "e2e.json").unlink(missing_ok=True)
    monkeypatch.setattr(measurements, "RESULTS_DIR", tmp_path)
    return tmp_path


@pytest.fixture
def results_without_e2e(tmp_path, monkeypatch):
    h200 = tmp_path / "h200"
    shutil.copytree(RESULTS_DIR / "h200", h200, ignore=shutil.ignore_patterns("logs"))
    for name in ("e2e_1gpu.json", "e2e.json"):
        (h200 / name).unlink(missing_ok=True)
    monkeypatch.setattr(measurements, "RESULTS_DIR", tmp_path)
    return tmp_path


# ============================================================================================ one builder per figure
def _kernel_rows():
    rows = measurements.kernel_checks("reference", ["rms_norm", "rope", "linear_fp8"], max_shapes=1)["rows"]
    failing = dict(rows[-1], impl="triton:planted", ok=False, bitwise_equal=False, bound_ratio=3.0,
                   worst=dict(index=[0, 1], out=1.5, ref=1.0), message="1 element beyond its bound")
    return rows + [failing]


def _milestones(kind):
    if kind == "decode":
        account = perf_account.paper_account()
        model = {m["id"]: m for m in account["milestones"]}
        rows = [dict(id=m["id"], label=plots.headline(m["label"]), tok_s=m["tok_s"], tok_s_range=m.get("tok_s_range"),
                     modelled_tok_s=model[m["id"]]["predicted_tok_s"], independent=model[m["id"]]["independent"])
                for m in perf_account.load_paper("decode_milestones")["milestones"]]
        return plots.plot_milestones(rows, value="tok_s", unit="decode tok/s (batch 1)", predicted="modelled_tok_s",
                                     lines={"audit": dict(value=55.0, source="reported")},
                                     standing=figure_data.decode_standing(), title="decode")
    rows = [dict(id=m["id"], label=m["label"], input_tok_s=m["input_tok_s"])
            for m in perf_account.load_paper("prefill_milestones")["milestones"]]
    model = perf_account.paper_account()["prefill"]["model_input_tok_s"]
    return plots.plot_milestones(rows, value="input_tok_s", unit="prefill input tok/s",
                                 lines={"cost model": dict(value=model, source="modelled", gap=True)},
                                 standing=figure_data.prefill_standing(), title="prefill")


def _waterfall():
    rows = figure_data.milestone_rows()
    for r in rows[:-1]:
        r["label"] = plots.headline(r["label"])
    return plots.plot_step_waterfall(rows, title="decode account")


def _decode_kernels(doc=True):
    from dsv4lab.tools.perf.hardware import load_hardware
    hw = load_hardware("h200-sxm")
    data = measurements.load_results_file("decode_kernels") if doc else None
    return plots.plot_decode_kernels(figure_data.decode_kernels(data, hw), title="decode kernels",
                                     missing_note=None if doc else "not measured yet")


def _prefill(doc=True):
    data = measurements.load_results_file("prefill_kernels") if doc else None
    rows = data["rows"] if data else figure_data.prefill_model_rows(tokens=(512, 4096))
    return plots.plot_prefill_throughput(rows, peaks=figure_data.prefill_peaks(data), names=figure_data.KERNEL_NAMES,
                                         title="prefill kernels")


def _similarity():
    import torch
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7]).repeat_interleave(16) * 16 % 128 + torch.arange(128) % 16
    eye = torch.eye(128)
    return plots.plot_channel_similarity({"stored": eye[perm], "repaired": eye}, title="W2")


def _stages():
    rows = [dict(layer=i, stage1_w1_cosine=1.0, stage1_w3_cosine=1.0, stage2_w2_cosine=0.25) for i in range(4)]
    return plots.plot_stage_cosines({"faulted": rows, "repaired": [dict(r, stage2_w2_cosine=1.0) for r in rows]},
                                    highlight_layer=0)


def _layer_rows():
    rows = []
    for layer in range(3):
        for stage in ("attention output", "MoE stage 2", "compressor entries"):
            bad = layer >= 1 and stage == "compressor entries"
            rows.append(dict(block=f"layers.{layer}", stage=stage, rel_err=0.3 if bad else 0.0, ok=not bad))
    return rows


def _inventory():
    return dict(tensors=932, total_bytes=16_320_036, by_component=dict(routed_experts=5_849_088, attention=2_351_286),
                by_dtype=dict(I8=dict(count=336, bytes=5_505_024), BF16=dict(count=68, bytes=5_452_032)))


def _catalogue():
    from dsv4lab.tools.perf.hardware import catalogue
    return plots.plot_hardware_catalogue(list(catalogue().values()))


def _bytes():
    from dsv4lab.core.config import get_preset
    flash = get_preset("flash")
    return plots.plot_bytes_composition({"busiest GCD": figure_data.bytes_by_component(flash, tp=4, sharding="sglang"),
                                         "busiest GPU": figure_data.bytes_by_component(flash, tp=2)})


def _quant():
    from dsv4lab.tools.train import quant_ablation
    return plots.plot_quant_ablation(quant_ablation.load_results()["points"])


BUILDERS = {
    "plot_checkpoint_inventory": lambda: plots.plot_checkpoint_inventory(_inventory()),
    "plot_quant_ablation": _quant,
    "plot_channel_similarity": _similarity,
    "plot_stage_cosines": _stages,
    "plot_kernel_check_errors": lambda: plots.plot_kernel_check_errors(_kernel_rows()),
    "plot_divergence_vs_position": lambda: plots.plot_divergence_vs_position(
        {"reference": [0.0] * 40, "fault": [0.0] * 8 + [1e-3] * 32}, {"ratio 4": 4, "window 32": 32}, bound=1e-9),
    "plot_layer_divergence": lambda: plots.plot_layer_divergence(_layer_rows()),
    "plot_roofline": lambda: plots.plot_roofline(figure_data.roofline_panels()[0], title="roofline"),
    "plot_step_waterfall": _waterfall,
    "plot_bytes_composition": _bytes,
    "plot_hardware_catalogue": _catalogue,
    "plot_decode_kernels": _decode_kernels,
    "plot_prefill_throughput": _prefill,
    "plot_milestones": lambda: _milestones("decode"),
}
VARIANTS = {  # the same functions on the other data they meet: nothing measured, the prefill milestones
    "plot_decode_kernels (nothing measured)": lambda: _decode_kernels(doc=False),
    "plot_prefill_throughput (cost model only)": lambda: _prefill(doc=False),
    "plot_milestones (prefill)": lambda: _milestones("prefill"),
}


def test_every_figure_function_has_a_builder_here():
    assert set(BUILDERS) == set(plots.FIGURES)


@pytest.mark.parametrize("name", list(BUILDERS) + list(VARIANTS))
def test_figure_passes_the_rules(name, results_without_e2e):
    fig = {**BUILDERS, **VARIANTS}[name]()
    assert plots.figure_problems(fig) == []


def test_figures_pass_the_rules_with_end_to_end_measurements(results_with_e2e):
    for name in ("plot_roofline", "plot_milestones", "plot_step_waterfall"):
        assert plots.figure_problems(BUILDERS[name]()) == [], name
    assert plots.figure_problems(_milestones("prefill")) == []


# ============================================================================================ what the figures say
def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_gid"))
            if t.get_text()]


def _missing_notes(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_gid") and a.get_gid() == style.MISSING_GID)]


def _legend_texts(fig) -> list[str]:
    out = []
    for ax in fig.axes:
        if ax.get_legend() is not None:
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    return out


def test_roofline_shows_the_hardware_it_names_with_reported_measured_and_modelled_points(results_without_e2e):
    panels, where = figure_data.roofline_panels("h200-sxm")
    fig = plots.plot_roofline(panels, where=where)
    titles = [ax.get_title() for ax in fig.axes]
    assert "MI250" in titles[0] and "h200-sxm" in titles[1]
    assert {p["source"] for p in panels[0]["points"]} == {"reported", "modelled"}
    assert {p["source"] for p in panels[1]["points"]} == {"measured", "modelled"}
    assert len([p for p in panels[0]["points"] if p["source"] == "reported"]) == 5
    legends = _legend_texts(fig)
    assert any(t.startswith("reported by the paper") for t in legends)
    assert any(t.startswith("measured: decode kernels") for t in legends)
    assert any(t.startswith("modelled") for t in legends)
    assert not any("achieved" in t for t in legends)
    assert any("e2e_1gpu.json" in t and "not measured yet" in t for t in _missing_notes(fig))
    for p in panels[0]["points"] + panels[1]["points"]:  # every point is a number, none made up
        assert math.isfinite(p["intensity"]) and math.isfinite(p["tflops"]) and p["tflops"] > 0


def test_roofline_places_the_committed_end_to_end_step(results_with_e2e):
    panels, _ = figure_data.roofline_panels("h200-sxm")
    step = [p for p in panels[1]["points"] if p["group"].startswith("whole decode step")]
    assert len(step) == 1 and "30 of 43 layers" in step[0]["label"]
    assert not any("e2e_1gpu" in m for m in panels[1]["missing"])


def test_waterfall_prints_reported_beside_reported_and_modelled_beside_modelled(results_without_e2e):
    fig = _waterfall()
    main, side = fig.axes[0], fig.axes[1]
    labels = [t.get_text() for t in main.get_yticklabels()]
    assert len(labels) == 7 and labels[-1].startswith("2×H200")  # six milestones and the target
    column = {t.get_position()[0]: [] for t in side.texts}
    for t in side.texts:
        column[t.get_position()[0]].append(t.get_text())
    by_head = {texts[0]: texts[1:] for texts in column.values()}
    reported = by_head["reported\nby the paper"]
    modelled = by_head["modelled"]
    assert reported[:6] == ["14.6", "20.14", "25.54", "60.2", "66.1", "74.5"]
    assert modelled[3:5] == ["not modelled", "not modelled"]
    assert modelled[1].endswith("†") and modelled[5].startswith("73.")
    assert by_head["measured"][-1].startswith("not measured")


def test_kernel_tier_plots_each_check_against_what_it_is_allowed():
    rows = _kernel_rows()
    assert all(set(plots.KERNEL_CHECK_FIELDS) <= set(r) for r in rows)  # what the verifier writes, the figure reads
    ratios = {(r["op"], r["impl"]): plots.check_ratio(r) for r in rows}
    assert all(ratio == (0.0, "bound") for (op, impl), ratio in ratios.items() if impl == "reference")
    assert ratios[(rows[-1]["op"], "triton:planted")][0] > 1
    # a passing check that is not bitwise sits at its bound ratio, never in the bitwise-equal column
    passing = dict(rows[0], impl="triton:within", bitwise_equal=False, bound_ratio=0.25)
    assert plots.check_ratio(passing) == (0.25, "bound")
    with pytest.raises(ValueError, match="neither bitwise_equal nor bound_ratio"):
        plots.check_ratio({k: v for k, v in passing.items() if k != "bound_ratio"})
    exact_zero = dict(passing, impl="cuda:exact", bound_ratio=0.0)  # no error, yet not the same bits
    fig = plots.plot_kernel_check_errors(rows + [passing, exact_zero])
    xs = {line.get_label(): list(line.get_xdata()) for line in fig.axes[0].get_lines()}
    assert 0.25 in xs["measured: triton variants"] and xs["measured: cuda variants"] == [1e-4]  # not "bitwise"
    assert any("triton:planted" in t for t in _texts(fig))
    assert "0 failed" not in fig._suptitle.get_text() and "1 failed" in fig._suptitle.get_text()
    assert fig.axes[0].get_xlabel() == "worst error ÷ analytic bound"
    assert "no analytic-bound ratio" not in fig.get_supxlabel()


def test_standing_says_not_measured_yet_and_shows_measurements_when_committed(results_without_e2e, monkeypatch,
                                                                               tmp_path):
    rows = figure_data.decode_standing()
    assert [r["source"] for r in rows] == ["reported", "measured", "measured", "modelled"]
    assert all(r["value"] is None and "not measured yet" in r["missing"] for r in rows if r["source"] == "measured")
    (tmp_path / "h200" / "e2e_1gpu.json").write_text(json.dumps(E2E_1GPU))
    rows = figure_data.decode_standing()
    one = next(r for r in rows if r["source"] == "measured" and r.get("value"))
    assert one["value"] == 19.3 and "30 of 43 layers" in one["label"] and one["bound"] > one["value"]
    pre = next(r for r in figure_data.prefill_standing() if r["source"] == "measured" and r.get("value"))
    assert pre["ttft_s"] == 1.25 and round(pre["value"], 1) == 3683.2


def test_long_category_lists_are_ranked_and_counted(results_without_e2e):
    fig = _prefill()
    for ax in fig.axes:
        if ax.get_visible() and ax.get_legend() is not None:
            assert len(ax.get_legend().get_texts()) <= 6
    assert any("best 4 of" in ax.get_title() for ax in fig.axes)
    decode = _decode_kernels()
    assert len(decode.axes[0].get_yticklabels()) == len(figure_data.decode_kernels(
        measurements.load_results_file("decode_kernels"), "h200-sxm"))  # one row per kernel, not per variant


def test_prefill_figure_marks_the_models_gap_to_the_paper(results_without_e2e):
    texts = _texts(_milestones("prefill"))
    assert any(t.startswith("×4.") for t in texts)


# ============================================================================================ the rules themselves
def _bare():
    from matplotlib.figure import Figure
    fig = Figure(layout="constrained")
    return fig, fig.add_subplot()


def test_rules_catch_planted_mistakes():
    fig, ax = _bare()
    ax.plot([1, 2], [3, 4])
    problems = " ".join(plots.figure_problems(fig))
    assert "no title" in problems and "x axis has no label" in problems and "no caption" in problems
    fig, ax = _bare()
    for i in range(13):
        ax.plot([0, 1], [i, i], color=style.PALETTE[i % 10], label=f"series {i}")
    ax.legend()
    ax.set_title("t"), ax.set_xlabel("x"), ax.set_ylabel("y")
    style.caption(fig, "model", measured="here")
    problems = " ".join(plots.figure_problems(fig))
    assert "13 entries" in problems
    assert "'series 0' and 'series 10' look the same" in problems


def test_sources_never_share_a_look():
    keys = set()
    for source in style.SOURCES:
        kw = style.marker_style(source, "#4E79A7")
        keys.add((kw["marker"], kw["markerfacecolor"]))
        bar = style.bar_style(source, "#4E79A7")
        keys.add((bar["facecolor"], bar["edgecolor"], bar.get("hatch", "")))
    assert len(keys) == 2 * len(style.SOURCES)


def test_the_decode_kernel_figure_takes_no_part_or_floor_for_a_variant(tmp_path):
    """The mHC section's rows that time a part of the site (one Sinkhorn iteration, the head collapse) or a floor
    (an empty launch) sit beside its geometries; the decode-kernel figure's best variant is a geometry."""
    def row(variant, us, route):
        return dict(kernel="mhc_site", variant=variant, batch=1, time_us=us, bytes=1_638_400, gbps=1.0,
                    pct_copy_bw=1.0, route=route)
    doc = dict(gpu="NVIDIA H200", torch="2.11", triton="3.6", commit="abc1234", copy_bw_gbps=4200.0,
               rows=[row("default", 14.0, "triton"), row("n64d32f2048w8", 12.5, "triton"),
                     row("head_collapse", 5.0, "part"), row("empty_launch", 2.0, "floor")])
    path = tmp_path / "decode_kernels.json"
    path.write_text(json.dumps(doc))
    (got,) = figure_data.decode_kernels(dict(doc, _path=str(path)))
    assert (got["label"], got["best_variant"], got["variants"]) == ("mHC site (post + pre + norm)", "n64d32f2048w8", 2)


# ================================================================================= figures that cannot mislead
@pytest.mark.parametrize("name", sorted(figure_data.FIELDS_READ))
def test_every_field_a_figure_reads_is_in_the_committed_results(name):
    doc = measurements.load_results_file(name)
    if doc is None:  # not measured yet (e2e.json, two GPUs): the one-GPU file comes from the same writer
        assert name == "e2e", f"data/results/h200/{name}.json is gone"
        doc = measurements.load_results_file("e2e_1gpu")
    assert figure_data.missing_fields(doc, figure_data.FIELDS_READ[name]) == []


def test_a_results_file_without_a_field_the_figures_read_is_refused(results_without_e2e):
    doc = dict(E2E_1GPU, summary={k: v for k, v in E2E_1GPU["summary"].items() if k != "ttft_s"})
    (results_without_e2e / "h200" / "e2e_1gpu.json").write_text(json.dumps(doc))
    with pytest.raises(measurements.RunError, match=r"lacks \['summary.ttft_s'\]"):
        figure_data.e2e_runs()
    rows = [dict(kernel="k", variant="v", tokens=512, time_us=1.0, tflops=2.0), dict(kernel="k", variant="v")]
    assert figure_data.missing_fields(dict(gpu="g", commit="c", rows=rows), figure_data.FIELDS_READ["prefill_kernels"]
                                      ) == ["rows[1].tokens", "rows[1].time_us", "rows[1].tflops"]


def _measurement_keys(notebook: str) -> dict:
    """The key results a notebook records about its measurements, computed as the notebook computes them."""
    if notebook == "03_decode_ablation":
        return dict(decode_measurements_present=measurements.load_results_file("decode_kernels") is not None)
    if notebook == "04_prefill_ablation":
        return dict(prefill_measurements_present=measurements.load_results_file("prefill_kernels") is not None)
    if notebook == "05_roofline":
        panels, _ = figure_data.roofline_panels("h200-sxm")
        return dict(roofline_measured_points=sum(p["source"] == "measured" for p in panels[1]["points"]))
    return dict(e2e_runs_committed=sum(r["present"] for r in figure_data.e2e_runs()))


@pytest.mark.parametrize("notebook", ["03_decode_ablation", "04_prefill_ablation", "05_roofline", "06_paper_figures"])
def test_a_run_without_its_measurements_is_missing_never_ok(notebook, tmp_path, monkeypatch):
    from dsv4lab.faces import runs
    expectations = runs.load_expectations()

    def statuses():
        doc = dict(parameters=dict(checkpoint="data/tiny"), key_results=_measurement_keys(notebook))
        return {r["key"]: r["status"] for r in runs.compare_with_expectations({notebook: doc}, expectations, True)
                if r["key"] in doc["key_results"]}
    committed = statuses()
    assert committed and set(committed.values()) == {"ok"}, committed  # the committed H200 results are there
    (tmp_path / "h200").mkdir()  # the GPU's folder, empty: nothing measured
    monkeypatch.setattr(measurements, "RESULTS_DIR", tmp_path)
    assert set(statuses().values()) == {"missing"}


def test_a_misspelt_gpu_is_an_error_naming_it_not_an_empty_figure():
    for call in (lambda: measurements.availability("h200x"), lambda: figure_data.e2e_runs("h200x"),
                 lambda: figure_data.decode_standing("h200x"), lambda: figure_data.milestone_rows("h200x"),
                 lambda: figure_data.roofline_panels("h200-sxm", gpu="h200x")):
        with pytest.raises(measurements.RunError, match=r"GPU='h200x': no measurements folder .*h200"):
            call()


def test_the_catalogue_draws_each_bandwidth_as_what_it_is():
    from dsv4lab.tools.perf.hardware import catalogue, load_hardware
    assert plots.perf.achievable_bandwidth(load_hardware("mi250-gcd")) == (1.25, "reported")  # the paper's figure
    assert plots.perf.achievable_bandwidth(load_hardware("h200-sxm"))[1] == "measured"
    assert plots.perf.achievable_bandwidth(load_hardware("b200")) == (None, None)
    hws = list(catalogue().values())
    fig = _catalogue()
    bw = fig.axes[0]
    legend = [t.get_text() for t in bw.get_legend().get_texts()]
    assert "reported by the paper: achievable" in legend and "measured: achievable (copy kernel)" in legend
    unmeasured = [h for h in hws if plots.perf.achievable_bandwidth(h)[0] is None]
    assert [t.get_text() for t in bw.texts].count("not\nmeasured") == len(unmeasured) > 0
    no_peak = [h for h in hws if not h.get("memory.bw_peak_gbps")]
    assert [t.get_text() for t in bw.texts].count("not in\ncatalogue") == len(no_peak)
    heights = [b.get_height() for c in bw.containers for b in c]
    assert len(heights) == 2 * len(hws) - len(unmeasured) - len(no_peak) and min(heights) > 0  # none for "unknown"


def test_one_modelled_paper_prefill_in_notebooks_04_and_06():
    account = perf_account.paper_account()["prefill"]
    rows = figure_data.prefill_chunk_account("h200-sxm", account["prompt_tokens"], (512, account["chunk"], None))
    paper = next(r for r in rows if r.get("reported_rate") is not None)
    assert paper["label"].endswith(f"chunk {account['chunk']}")
    assert paper["modelled_input_tok_s"] == account["model_input_tok_s"]  # 04's waterfall row is 06's line


def test_multitoken_tables_read_the_rows_bench_e2e_writes():
    """The verify table states each step's cost over its bytes ratio; a part the run skipped is an empty table."""
    doc = dict(decode=[dict(batch=8, tok_s=253.1, mbu=0.18, path="graph", bytes_per_step=23_600_000_000)],
               verify=[dict(draft_tokens=2, verify_over_step=3.0, bytes_ratio=2.0, cycle_over_step=3.5,
                            cycle_bytes_ratio=2.2, step_us=6400.0, verify_us=19200.0)],
               speculative=[dict(alpha=0.8, draft_tokens=2, tok_s=190.0, greedy_tok_s=152.0, speedup=1.25,
                                 ideal_speedup_modelled=1.3, of_ideal=0.962, equal_to_greedy=True)])
    t = figure_data.multitoken_tables(doc)
    assert t["batches"] == [dict(batch=8, tok_s=253.1, mbu=0.18, path="graph", gb_per_step=23.6)]
    assert t["verify"][0]["over_bytes_ratio"] == 1.5
    assert t["speculative"][0]["equal_to_greedy"] is True
    assert figure_data.multitoken_tables(dict(decode=doc["decode"]))["verify"] == []
    assert figure_data.multitoken_tables(None) == dict(batches=[], verify=[], speculative=[])


def test_fusion_table_reads_the_fused_path_rows_and_the_recommendation():
    """Each configuration's row with whether the run recommends it at that batch; a run without the part: empty."""
    rows = [dict(batch=1, config=c, tok_s=t, speedup=x, launches_per_layer=n, ids_equal_off=True)
            for c, t, x, n in (("off", 150.0, 1.0, 26.4), ("x_projections", 153.0, 1.02, 25.4),
                               ("all", 160.0, 1.067, 19.1))]
    doc = dict(fusions=dict(rows=rows, recommended={"1": ["x_projections"]}))
    t = figure_data.fusion_table(doc)
    assert [r["recommended"] for r in t] == [False, True, False] and t[1]["launches_per_layer"] == 25.4
    assert figure_data.fusion_table(dict(decode=[])) == [] and figure_data.fusion_table(None) == []
