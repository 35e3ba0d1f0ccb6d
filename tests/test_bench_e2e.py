"""The end-to-end benchmark's generated model and its smoke run (the GPU run itself is `dsv4lab bench e2e`)."""
from __future__ import annotations

import contextlib
import io
import json
import time

import pytest
import torch
from conftest import once_per_run

import dsv4lab
from dsv4lab.faces import cli
from dsv4lab.tools.bench import e2e, e2e_parts
from dsv4lab.tools.bench.e2e_multitoken import speculative_mismatches
from dsv4lab.core.checkpoint import expected_tensors
from dsv4lab.core.config import get_preset
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.dispatch import GPU_DEFAULTS, SCHEMA, Dispatch, Tuned
from dsv4lab.engine.kernel_families import FUSION_NAMES
from dsv4lab.tools.verify.model import trajectory_hash

TINY = get_preset("tiny")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_random_checkpoint_is_the_inventory_and_depends_on_seed_and_name_only():
    a, b, c = RandomCheckpoint(TINY, 3), RandomCheckpoint(TINY, 3), RandomCheckpoint(TINY, 4)
    assert {s.name: (s.dtype, tuple(s.shape)) for s in expected_tensors(TINY)} == \
        {n: (i.dtype, i.shape) for n, i in a.tensors.items()}
    names = ["layers.2.ffn.experts.7.w2.weight", "layers.2.ffn.experts.7.w2.scale", "layers.0.attn.wq_b.weight",
             "layers.0.attn.wq_b.scale", "embed.weight", "layers.0.ffn.gate.tid2eid", "layers.1.hc_attn_scale"]
    forward = {n: _bytes(a.get(n)) for n in names}
    backward = {n: _bytes(b.get(n)) for n in reversed(names)}  # a scale asked before its weight: the same scale
    assert all(torch.equal(forward[n], backward[n]) for n in names)
    assert not any(torch.equal(forward[n], _bytes(c.get(n))) for n in names)
    w = a.get("layers.0.attn.wq_b.weight").float()
    assert w.abs().sum() > 0 and torch.isfinite(w).all()
    sl = a.get_slice("layers.0.attn.wq_b.weight", 0, 64, 128)
    assert torch.equal(_bytes(sl), _bytes(a.get("layers.0.attn.wq_b.weight")[64:128]))
    with pytest.raises(KeyError, match="not a tensor of this model"):
        a.info("layers.0.attn.nope.weight")


def test_bench_e2e_smoke_on_two_ranks_writes_the_fields_and_the_single_process_oracle(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert cli.main(["bench", "e2e", "--smoke", "--nproc", "2", "--tp", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["batch"] for r in doc["decode"]] == [1, 2]
    assert all(r["tok_s"] > 0 and "mbu" in r for r in doc["decode"])
    assert {r["chunk"] for r in doc["prefill"]} == {16, 40} and all(r["ttft_s"] > 0 for r in doc["prefill"])
    assert doc["ttft"]["chunk"] in (16, 40) and doc["ranks"] == 2 and doc["commit"]
    assert len({r["first_token"] for r in doc["prefill"]}) == 1  # chunking does not change the first token
    fp = doc["first_prompt"]  # after the warm-up: each length's first prompt against the same prompt warm
    assert doc["warmup"]["prefill_path"] == doc["prefill_path"] == "eager" and fp["after_warmup"]
    assert [r["prompt_tokens"] for r in fp["rows"]] == [1, 17] and all(r["same_token"] for r in fp["rows"])
    assert all(r["first_ttft_s"] > 0 and r["ratio"] == pytest.approx(r["first_ttft_s"] / r["warm_ttft_s"], rel=1e-2)
               for r in fp["rows"])
    pb = doc["prefill_breakdown"]  # the fastest chunk's prefill, op by op, beside the cost model
    assert pb["chunk"] == doc["ttft"]["chunk"] and pb["measured_total_us"] > 0 and pb["predicted_total_us"] > 0
    assert {"linear", "routed_experts", "sparse_attention"} <= set(pb["measured_op_us"])
    assert sum(pb["measured_op_us"].values()) + pb["untimed_us"] == pytest.approx(pb["measured_total_us"], abs=1.0)
    # the two-rank split of the generated model is the same model as one process
    one = dsv4lab.load(RandomCheckpoint(TINY, 0), max_batch=1, validate=False)
    assert doc["oracle_hash"] == trajectory_hash(one.generate(doc["oracle"]["prompt_ids"], 32, stop_at_eos=False))
    assert "oracle hash" in capsys.readouterr().out
    # the paper-figures notebook reads it like the committed file will be read
    from dsv4lab.faces import measurements
    head = measurements.e2e_headline(measurements.load_results_file("e2e", path=out))
    assert head["decode_tok_s"] == doc["decode"][0]["tok_s"] and head["ttft_s"] == doc["ttft"]["ttft_s"]
    assert head["prefill_input_tok_s"] == pytest.approx(40 / doc["ttft"]["ttft_s"], rel=1e-3)


def test_bench_e2e_refuses_bad_splits(capsys):
    assert cli.main(["bench", "e2e", "--smoke", "--nproc", "3", "--tp", "2"]) == 2
    assert "--nproc 3" in capsys.readouterr().err


@pytest.mark.parametrize("argv,named", [
    (["bench", "e2e", "--batches", "1,8", "--breakdown-batches", "32"], "--breakdown-batches '32'"),
    (["bench", "e2e", "--batches", "1,8", "--fusion-batches", "16"], "--fusion-batches '16'"),
    (["bench", "e2e", "--fusion-batches", "1,x"], "--fusion-batches '1,x'"),
    (["bench", "e2e", "--fusion-batches", "0"], "--fusion-batches '0'"),
    (["bench", "e2e", "--nproc", "2", "--tp", "2", "--fusion-batches", "1"], "one rank (--nproc 1)"),
    (["bench", "e2e", "--backend", "reference", "--fusion-batches", "1"], "--backend triton"),
    (["bench", "e2e", "--fusions", "moe_site,nope"], "--fusions 'moe_site,nope'"),
    (["bench", "e2e", "--fusions", "greedy,greedy"], "--fusions 'greedy,greedy'"),
    (["bench", "kernels", "--suite", "decode", "--batches", "8,0"], "--batches '8,0'"),
])
def test_row_counts_out_of_range_are_refused_before_any_work(argv, named, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1


def test_the_default_breakdown_batches_follow_the_batches_a_run_decodes():
    """Batch 8's step is profiled by default only where the run decodes 8 rows: ``--batches 1`` is not refused."""
    import argparse
    from dsv4lab.tools.bench import e2e
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    assert e2e.options(p.parse_args(["--batches", "1"]))["breakdown_batches"] == []
    assert e2e.options(p.parse_args([]))["breakdown_batches"] == [8]
    assert e2e.options(p.parse_args(["--breakdown-batches", "8,32"]))["breakdown_batches"] == [8, 32]


def test_op_timer_times_outermost_calls_and_puts_the_ops_back():
    from dsv4lab.tools.bench.common import OpTimer

    class Ops:
        def inner(self, x):
            time.sleep(0.002)
            return x + 1

        def outer(self, x):
            return self.inner(x) * 2

    ops = Ops()
    with OpTimer(ops, ("outer", "inner", "absent"), cuda=False) as timer:
        assert ops.outer(1) == 4 and ops.inner(1) == 2
        assert "outer" in vars(ops) and "inner" in vars(ops)  # wrapped on the instance
    t = timer.totals_us()
    assert set(t) == {"outer", "inner"} and len(timer.events["inner"]) == 1  # the nested call counts in "outer"
    assert t["outer"] >= 2000 and t["inner"] >= 2000
    assert "outer" not in vars(ops) and "inner" not in vars(ops) and ops.outer(1) == 4  # the class methods again


def test_the_decode_breakdown_names_its_kernels():
    """``top_kernels``: per kernel name its family (the glue's first), µs and launches per call and µs per launch,
    most time first — so a family total, ``other`` included, can be taken apart."""
    from types import SimpleNamespace

    from dsv4lab.tools.bench.e2e import top_kernels
    evs = [SimpleNamespace(key="_mhc_site_kernel", device_time_total=2 * 888.0, count=2 * 62),
           SimpleNamespace(key="_swiglu_kernel", device_time_total=2 * 90.0, count=2 * 30),
           SimpleNamespace(key="_attn_decode_kernel", device_time_total=2 * 400.0, count=2 * 30),
           SimpleNamespace(key="cpu_only_event", device_time_total=0.0, count=5)]
    rows = top_kernels(SimpleNamespace(key_averages=lambda: evs), calls=2, n=2)
    assert rows == [dict(name="_mhc_site_kernel", family="mhc", us=888.0, launches=62.0, us_per_launch=14.32),
                    dict(name="_attn_decode_kernel", family="attention", us=400.0, launches=30.0,
                         us_per_launch=13.33)]
    assert top_kernels(SimpleNamespace(key_averages=lambda: evs), calls=2)[2]["family"] == "other"
    from dsv4lab.tools.bench.e2e import kernel_profile  # the family totals come from the same events
    assert kernel_profile(SimpleNamespace(key_averages=lambda: evs), calls=2) == (
        {"mhc": 888.0, "attention": 400.0, "other": 90.0}, {"mhc": 62.0, "attention": 30.0, "other": 30.0})


def test_a_failing_part_is_recorded_and_the_others_still_run(capsys):
    """One rank: a part that raises is listed under ``failed`` with its error, ``recover`` runs, and the parts after
    it still run (a broken breakdown must not lose the TTFT measured after it)."""
    recovered = []
    parts = e2e_parts.Parts(0, time.perf_counter(), budget_s=60.0, world=1, recover=lambda: recovered.append(True))

    def broken():
        raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED\nsecond line")
    assert parts.run("breakdown", broken) is None
    assert parts.run("ttft", lambda: [1.0]) == [1.0]
    assert parts.failed == {"breakdown": "RuntimeError: it->second->use_count > 0 INTERNAL ASSERT FAILED"}
    assert recovered == [True] and "ttft" in parts.timing and "breakdown" not in parts.timing
    assert "breakdown: FAILED" in capsys.readouterr().err


def test_a_part_overrunning_the_budget_is_stopped_and_the_run_ends(capsys):
    """One rank: a part still running ``overrun_s`` past the budget is stopped (listed as failed, timed out), the
    parts after it are skipped, and the call returns — a GPU visit's run always writes its JSON in time."""
    parts = e2e_parts.Parts(0, time.perf_counter(), budget_s=0.2, world=1, overrun_s=0.3)
    t0 = time.perf_counter()
    assert parts.run("speculative", lambda: time.sleep(30)) is None
    assert time.perf_counter() - t0 < 5
    assert parts.failed["speculative"].startswith("PartTimedOut: speculative timed out")
    assert parts.run("ttft", lambda: [1.0]) is None and parts.skipped == ["ttft"]
    assert parts.run("late", lambda: 1) is None  # and nothing is left armed
    fast = e2e_parts.Parts(0, time.perf_counter(), budget_s=60.0, world=1, overrun_s=30.0)
    assert fast.run("decode_b1", lambda: {"tok_s": 1.0}) == {"tok_s": 1.0} and not fast.failed
    assert "decode_b1 result: {\"tok_s\":1.0}" in capsys.readouterr().err


SMOKE_FUSIONS = ("x_projections",)
"""The fused path the shared smoke run times alone (it engages on both layers of its interpreter model; each
configuration costs four interpreter steps)."""


@pytest.fixture(scope="module")
def one_rank_smoke(tmp_path_factory):
    """One single-process ``bench e2e --smoke`` run shared by the tests of its parts (once per pytest run, under
    pytest-xdist too): ``(exit code, JSON, stdout, stderr)``. It times the fused paths too (``--fusion-batches 1``:
    a Triton-interpreter model of its own; one of them alone, :data:`SMOKE_FUSIONS`, beside off and all on: each
    configuration is a few interpreter steps)."""
    def produce(folder):
        out = folder / "e2e.json"
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = cli.main(["bench", "e2e", "--smoke", "--batches", "1", "--contexts", "", "--fusion-batches", "1",
                             "--fusions", ",".join(SMOKE_FUSIONS), "--out", str(out)])
        return code, json.loads(out.read_text()), stdout.getvalue(), stderr.getvalue()
    return once_per_run(tmp_path_factory, "e2e_one_rank_smoke", produce)


def test_a_speculative_output_unlike_plain_greedy_is_named_for_the_failure():
    """Greedy speculation is lossless: each row whose ids differ from plain greedy's is named (draft count and α,
    or the checkpoint of a row without injection) — ``bench e2e`` lists them under ``failed``."""
    rows = [dict(draft_tokens=1, alpha=0.5, equal_to_greedy=True),
            dict(draft_tokens=2, alpha=0.8, equal_to_greedy=False),
            dict(draft_tokens=3, checkpoint="this run's model", equal_to_greedy=False)]
    assert speculative_mismatches(rows) == ["k=2 alpha=0.8", "k=3 (this run's model)"]
    assert speculative_mismatches(rows[:1]) == []


def test_bench_e2e_smoke_measures_the_verify_step_and_speculation_with_injected_acceptance(one_rank_smoke):
    """One rank (the multi-token parts are measured there): decode rows carry bytes per step; verify rows per k with
    the time and bytes ratios; speculative rows per (α, k) whose output equals plain greedy's, with drafts accepted
    (injected); rows without injection (random weights) and data/tiny-py's natural acceptance; the targets list
    them; the summary prints them."""
    code, doc, printed, logged = one_rank_smoke
    assert code == 0
    assert not doc["failed"] and doc["decode"][0]["bytes_per_step"] > doc["decode"][0]["weight_bytes_per_step"] > 0
    assert [r["draft_tokens"] for r in doc["verify"]] == [1, 2]
    for r in doc["verify"]:
        assert r["verify_over_step"] > 0 and r["cycle_over_step"] > 0 and 1 < r["bytes_ratio"] < r["cycle_bytes_ratio"]
    rows = doc["speculative"]
    assert {(r["alpha"], r["draft_tokens"]) for r in rows} == {(0.5, 1), (0.7, 1), (0.5, 2), (0.7, 2)}
    assert all(r["equal_to_greedy"] and r["tok_s"] > 0 and r["speedup"] > 0 and r["ideal_speedup_modelled"] > 0
               for r in rows)
    assert sum(r["acceptance_rate"] for r in rows) > 0  # injected: some drafts held
    natural = doc["speculative_natural"]
    assert [r["draft_tokens"] for r in natural] == [1, 2, 1, 2] and all(r["equal_to_greedy"] for r in natural)
    trained = [r for r in natural if "tiny-py" in r["checkpoint"]]  # its MTP block drafts for real
    assert len(trained) == 2 and all(r["acceptance_rate"] > 0.3 for r in trained)
    assert {"verify_k1_over_step", "speculative_alpha0.8_speedup", "batch32_mbu"} <= set(doc["targets"])
    assert "verify k=1" in printed and "speculative α=0.5 k=2" in printed and "without injection" in printed
    # each part's numbers are logged as it ends (a run killed by a time limit keeps them): the verify rows as written
    line = next(ln for ln in logged.splitlines() if ln.startswith("[bench e2e] verify result: "))
    assert json.loads(line.split("result: ", 1)[1]) == doc["verify"]


def test_bench_e2e_smoke_times_the_fused_paths_off_alone_and_all_on(one_rank_smoke):
    """The fused paths of the decode step off, each of ``--fusions`` alone (one here; by default every name of
    ``FUSION_NAMES``) and all on, on the smoke's interpreter model: each configuration's ids equal the unfused
    step's, every path timed launches fewer kernels than all off, and the tuned entries the section carries make
    the dispatch choose what it recommends (a path not timed: off)."""
    code, doc, printed, logged = one_rank_smoke
    assert code == 0 and not doc["failed"]
    f = doc["fusions"]
    assert f["names"] == list(SMOKE_FUSIONS) and f["mismatches"] == []
    rows = {r["config"]: r for r in f["rows"]}
    assert set(rows) == {"off", *SMOKE_FUSIONS, "all"}
    assert all(rows[n]["launches_saved"] > 0 for n in SMOKE_FUSIONS)
    for name, r in rows.items():
        assert r["batch"] == 1 and r["ids_equal_off"] and r["tok_s"] > 0 and r["speedup"] > 0
        assert r["on"] == ([] if name == "off" else list(FUSION_NAMES) if name == "all" else [name])
        assert r["launches_per_step"] == r["triton_launches"] + r["torch_launches"] > 0
        assert r["launches_per_layer"] == pytest.approx(r["launches_per_step"] / 2, abs=0.01)  # two layers
        assert r["launches_saved"] == rows["off"]["launches_per_step"] - r["launches_per_step"]
        assert len(r["rounds_tok_s"]) == (2 * len(rows) - 2 if name == "off" else 2)  # off C C off per path
    every = rows["all" if len(FUSION_NAMES) > 1 else FUSION_NAMES[0]]
    assert every["launches_per_step"] < rows["off"]["launches_per_step"]
    assert set(f["recommended"]) == {"1"} and set(f["margin"]) == {"1"} and f["margin"]["1"] >= f["min_margin"]
    tuned = f["tuned"]
    (sid, source), = tuned["sources"].items()
    assert source["result"] == "e2e.json" and source["commit"] == doc["commit"] and "--smoke" in source["command"]
    d = Dispatch(Tuned(dict(schema=SCHEMA, gpu=doc["gpu"], sources=tuned["sources"],
                            ops={"decode.fusion": tuned["decode.fusion"]}), "the e2e entries"), GPU_DEFAULTS)
    assert all(d.fused(n, rows) == (n in f["recommended"]["1"]) for n in FUSION_NAMES for rows in (1, 4, 32))
    assert set(f["recommended"]["1"]) <= set(SMOKE_FUSIONS) and "--fusions" in source["command"]
    assert "fusions b=1" in printed and "fusions recommended: b=1" in printed
    line = next(ln for ln in logged.splitlines() if ln.startswith("[bench e2e] fusions_b1 result: "))
    assert json.loads(line.split("result: ", 1)[1]) == f["rows"]


def test_bench_e2e_refuses_draft_counts_the_model_cannot_verify(capsys):
    assert cli.main(["bench", "e2e", "--smoke", "--batches", "1", "--draft-tokens", "1,9", "--contexts", ""]) == 2
    err = capsys.readouterr().err
    assert "--draft-tokens 9" in err and "at most 7" in err and "Traceback" not in err
