"""Performance model: byte accounting pinned to spec §5.1/§5.3, the catalogue, the roofline, the paper account,
the CLI and the figures."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4lab.faces.cli import main
from dsv4lab.core.config import ConfigError, get_preset
from dsv4lab.tools.perf import costmodel as cm
from dsv4lab.tools.perf import account as acc_mod
from dsv4lab.tools.perf import roofline as rl
from dsv4lab.tools.perf.hardware import HardwareError, list_hardware, load_hardware

REPO = Path(__file__).resolve().parents[1]
FLASH = get_preset("flash")

# spec §5.1, bytes per generated token at batch 1
SPEC_5_1 = {
    "routed_experts": 3_449_290_752, "shared_expert": 1_082_196_480, "attention": 4_599_335_040,
    "compressor": 525_722_624, "indexer": 187_181_568, "indexer_compressor": 88_171_776, "router": 90_218_496,
    "mhc": 135_275_592, "norms": 847_616, "embedding": 8_192, "final": 270_356, "lm_head": 1_059_061_760,
}
SPEC_TOTAL = 11_217_580_252


# ============================================================================================ §5.1 weights
@pytest.mark.parametrize("component", sorted(SPEC_5_1))
def test_weight_bytes_per_component_match_spec_5_1(component):
    assert cm.weight_bytes_per_token(FLASH)[component] == SPEC_5_1[component]


def test_weight_bytes_total_and_per_unit_sizes_match_spec():
    w = cm.weight_bytes_per_token(FLASH)
    assert sum(w.values()) == SPEC_TOTAL
    step = cm.decode_step(FLASH, context=1)
    L = FLASH.n_layers
    # per-unit sizes of §5.1: one routed expert, the shared expert, a layer's attention projections
    routed = step.op("routed.w13").weight_bytes + step.op("routed.w2").weight_bytes
    assert routed == 43 * 6 * 13_369_344
    shared = step.op("shared.w13").weight_bytes + step.op("shared.w2").weight_bytes
    assert shared / L == 25_167_360
    attn = sum(step.op(n).weight_bytes for n in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b"))
    assert attn / L == 106_961_280
    assert step.op("attn.wo_a").weight_format == "fp8"  # §5.1 keeps wo_a FP8 (the reference's BF16 would add 1.44 GB)
    assert step.op("compressor.proj").weight_bytes + step.op("compressor.pool").weight_bytes == \
        21 * 16_794_624 + 20 * 8_651_776


def test_op_table_agrees_with_component_table_and_checkpoint():
    step = cm.decode_step(FLASH, tp=4, context=4096)
    by_comp = step.by_component("weight_bytes")
    for comp, value in SPEC_5_1.items():
        assert by_comp[comp] == pytest.approx(value, abs=1e-3)
    assert step.weight_bytes == pytest.approx(SPEC_TOTAL, abs=1e-3)
    # fully-read components equal the checkpoint table's main-layer + global tensors of that component
    from dsv4lab.core.checkpoint import expected_tensors
    main = {}
    for s in expected_tensors(FLASH):
        if s.block is None or s.block < FLASH.n_layers:
            main[s.component] = main.get(s.component, 0) + s.nbytes
    for comp in ("shared_expert", "attention", "compressor", "indexer", "indexer_compressor", "mhc", "norms",
                 "final", "lm_head"):
        assert main[comp] == SPEC_5_1[comp], comp
    # routed: k of E experts; router: everything but the hash layers' tid2eid tables (read one row per token)
    assert main["routed_experts"] * 6 // 256 == SPEC_5_1["routed_experts"]
    assert main["router"] - 3 * 129_280 * 6 * 8 == SPEC_5_1["router"]


def test_every_checkpoint_tensor_is_read_by_an_op():
    from dsv4lab.core.checkpoint import expected_tensors
    ops = {cm.op_of_tensor(s.name) for s in expected_tensors(get_preset("tiny"))}
    assert None in ops  # MTP
    assert {"routed.w13", "routed.w2", "attn.wo_a", "indexer.compressor.pool", "router.topk", "head"} <= ops
    with pytest.raises(ConfigError, match="no op reads it"):
        cm.op_of_tensor("layers.0.attn.mystery.weight")


def test_batch_shares_dense_weights_and_reads_distinct_experts():
    b1 = cm.weight_bytes_per_token(FLASH, 1)
    b8 = cm.weight_bytes_per_token(FLASH, 8)
    assert b8["attention"] == pytest.approx(b1["attention"] / 8)
    distinct = 256 * (1 - (1 - 6 / 256) ** 8)
    assert b8["routed_experts"] == pytest.approx(43 * distinct * 13_369_344 / 8)
    assert 6 < distinct < 48


def test_decode_matmul_flops_match_active_parameters():
    step = cm.decode_step(FLASH, context=1)
    mm = sum(o.flops for o in step.ops if o.kind == "matmul") / 2
    mhc_fn = 43 * 2 * 24 * 16384  # applied by the mHC kernels, counted among the active parameters
    assert (mm + mhc_fn) == pytest.approx(13.27e9, rel=2e-3)  # spec §2.2: 13.27 B active excluding the embedding


# ============================================================================================ §5.2 / §5.3 KV
def test_kv_row_and_key_bytes_match_spec_5_2():
    assert cm.kv_row_bytes(FLASH, "bf16") == 1024
    assert cm.kv_row_bytes(FLASH, "fp8") == 584
    assert cm.index_key_bytes(FLASH, "fp8") == 68
    assert cm.index_key_bytes(FLASH, "bf16") == 256


def stored_kv_bytes_per_token(args, layer: int, fmt: str) -> float:
    """KV bytes one more token adds to ``layer``'s caches, from the cost model's row and key sizes and the
    model's layer schedule: a compressed row per ``ratio`` tokens, plus an indexer key where there is an indexer
    (the window ring is fixed-size)."""
    ratio = args.compress_ratios[layer]
    if not ratio:
        return 0.0
    keys = cm.index_key_bytes(args, fmt) / ratio if args.has_indexer(layer) else 0.0
    return cm.kv_row_bytes(args, fmt) / ratio + keys


@pytest.mark.parametrize("fmt,csa,hca,whole", [("fp8", 163, 4.5625, 3514), ("bf16", 320, 8, 6880)])
def test_stored_kv_bytes_per_token_match_spec_5_2(fmt, csa, hca, whole):
    layers = range(FLASH.n_layers)
    by_kind = {FLASH.layer_kind(i): stored_kv_bytes_per_token(FLASH, i, fmt) for i in layers}
    assert by_kind == {"swa": 0.0, "csa": csa, "hca": hca}
    assert sum(stored_kv_bytes_per_token(FLASH, i, fmt) for i in layers) == pytest.approx(whole, abs=0.5)
    # kv_read_bytes reads every HCA row and scans every CSA index key: past the window and the top-k, 128 more
    # tokens of context add exactly those rates of the stored bytes to a decode step's reads
    grown = {k: cm.kv_read_bytes(FLASH, 65536 + 128, fmt)[k] - cm.kv_read_bytes(FLASH, 65536, fmt)[k]
             for k in ("rows", "index_keys")}
    n_kind = {k: sum(FLASH.layer_kind(i) == k for i in layers) for k in ("csa", "hca")}
    assert grown["rows"] == 128 * n_kind["hca"] * hca
    assert grown["index_keys"] == 128 * n_kind["csa"] * cm.index_key_bytes(FLASH, fmt) / 4


@pytest.mark.parametrize("context,fmt,table,unit", [
    (4096, "bf16", 22.8, 1e6), (4096, "fp8", 11.3, 1e6), (65536, "bf16", 115.2, 1e6), (65536, "fp8", 38.9, 1e6),
    (1_048_576, "bf16", 1.594, 1e9), (1_048_576, "fp8", 0.480, 1e9)])
def test_kv_read_bytes_match_spec_5_3(context, fmt, table, unit):
    got = cm.kv_read_bytes(FLASH, context, fmt)["total"] / unit
    digits = len(str(table).split(".")[1])
    assert round(got, digits) == table


def test_kv_read_index_scan_at_1m_and_rules():
    kv = cm.kv_read_bytes(FLASH, 1_048_576, "bf16")
    assert kv["index_keys"] == 21 * 262_144 * 256  # §5.3: 1.409 GB of it is the indexer key scan
    # SWA reads only the window; HCA window + every completed block; CSA window + top-k, capped
    assert cm.attention_rows(FLASH, 0, 100) == 100
    assert cm.attention_rows(FLASH, 3, 1000) == 128 + 1000 // 128
    assert cm.attention_rows(FLASH, 2, 100_000) == 128 + 512
    assert cm.index_keys(FLASH, 3, 1000) == 0 and cm.index_keys(FLASH, 2, 1000) == 250


# ============================================================================================ per rank
def test_tp4_bytes_per_rank_and_bound_on_mi250():
    rep = rl.roofline_report(FLASH, load_hardware("mi250-gcd"), tp=4)
    assert rep["bytes_per_token"] == pytest.approx(SPEC_TOTAL, rel=1e-3)
    assert 3.0e9 <= rep["bytes_per_token_per_rank"] <= 3.1e9
    assert 2.95e9 <= rep["weight_bytes_per_token_per_rank"] <= 3.1e9
    assert 510 <= rep["bound_tok_s"] <= 540
    assert 400 <= rep["bandwidth_bound_tok_s_achievable"] <= 420  # paper_facts: ~400-420 at achievable bandwidth


@pytest.mark.parametrize("sharding", cm.SHARDINGS)
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_shares_add_up_to_the_model(sharding, tp):
    step = cm.decode_step(FLASH, tp=tp, sharding=sharding)
    replicated = sum(o.weight_bytes for o in step.compute_ops if o.replicated)
    assert step.weight_bytes_rank * tp == pytest.approx(step.weight_bytes + (tp - 1) * replicated, rel=1e-12)
    # MQA: the KV cache is read in full by every rank
    assert step.op("attn.core").other_bytes_rank > cm.kv_read_bytes(FLASH, 4096)["rows"]


def test_sharding_policies_order_and_collectives():
    per_rank = {s: cm.decode_step(FLASH, tp=4, sharding=s).weight_bytes_rank for s in cm.SHARDINGS}
    assert per_rank["ideal"] < per_rank["sglang"] < per_rank["reference"]
    coll = {s: cm.decode_step(FLASH, tp=4, sharding=s).total("launches", cm.decode_step(FLASH, tp=4, sharding=s)
                                                           .collectives) for s in cm.SHARDINGS}
    assert coll["sglang"] == 2 * 43 + 2  # two all-reduces per layer, embedding all-reduce, logits gather
    assert coll["reference"] == coll["sglang"] + 21  # indexer score sum on every CSA layer
    assert cm.decode_step(FLASH, tp=1).collectives == []


def test_ep_load_imbalance_exact_and_sampled():
    exact = cm.ep_load_imbalance(256, 6, 1, 4)
    rng = random.Random(1)
    maxima = []
    for _ in range(40_000):
        groups = [e // 64 for e in rng.sample(range(256), 6)]
        maxima.append(max(groups.count(g) for g in range(4)))
    assert exact == pytest.approx(sum(maxima) / len(maxima) / 1.5, rel=0.01)
    assert cm.ep_load_imbalance(256, 6, 1, 1) == 1.0
    assert 1.0 < cm.ep_load_imbalance(256, 6, 8, 4) < exact
    step = cm.decode_step(FLASH, tp=4, ep=4)
    assert step.op("routed.w13").weight_bytes_rank == pytest.approx(
        step.op("routed.w13").weight_bytes / 4 * exact)
    with pytest.raises(ConfigError, match="ep=3"):
        cm.decode_step(FLASH, tp=4, ep=3)


def test_tiny_model_and_bad_inputs():
    tiny = get_preset("tiny")
    step = cm.decode_step(tiny, tp=2, batch=3, context=300)
    assert step.weight_bytes == pytest.approx(sum(cm.weight_bytes_per_token(tiny, 3).values()) * 3)
    assert all(o.flops_rank >= 0 and o.bytes_rank >= 0 for o in step.ops)
    with pytest.raises(ConfigError, match="tp=3 must divide n_heads"):
        cm.decode_step(tiny, tp=3)
    with pytest.raises(ConfigError, match="kv_format"):
        cm.decode_step(tiny, kv_format="int4")
    with pytest.raises(ConfigError, match="sharding"):
        cm.decode_step(tiny, sharding="magic")


def test_prefill_flops_chunks_and_launches():
    one = cm.prefill(FLASH, tokens=4604, tp=4)
    three = cm.prefill(FLASH, tokens=4604, tp=4, chunk=2048)
    assert 25e9 < one.total("flops") / 4604 < 32e9  # the paper's derived analysis: ~30 GFLOP per prompt token
    assert three.chunks == 3
    assert three.op("attn.wq_b").weight_bytes == 3 * one.op("attn.wq_b").weight_bytes
    assert three.op("head").weight_bytes == one.op("head").weight_bytes  # logits of the last position only
    assert three.op("attn.wq_b").launches == 3 * 43
    assert three.total("flops") == pytest.approx(one.total("flops"), rel=1e-9)


# ============================================================================================ catalogue
def test_catalogue_loads_with_sources():
    names = list_hardware()
    assert {"mi250-gcd", "mi250x-gcd", "mi300x", "h100-sxm", "h200-sxm", "b200", "host-cpu"} <= set(names)
    for name in names:
        hw = load_hardware(name)
        assert hw.quantities, name
        for key, q in hw.quantities.items():
            assert q.source in hw.sources and q.source_text, (name, key)
    mi = load_hardware("mi250-gcd")
    assert mi.matrix_tflops("fp8") is None and mi.matrix_tflops("fp4") is None
    assert mi.bandwidth_gbps("peak") == 1600 and mi.min_tile_m == 16
    assert load_hardware("b200").matrix_tflops("fp4") == 9000


def test_h200_numbers_come_from_the_engineering_notes():
    h = load_hardware("h200-sxm")
    for key, value in [("memory.bw_achievable_gbps", 4255), ("matrix_tflops_measured.fp8", 1250),
                       ("collectives.allreduce_small_us.library", 18.1),
                       ("collectives.allreduce_small_us.library_eager", 37.7)]:
        assert h.get(key) == value
        assert "project's H200 machine" in h.quantity(key).source_text
    assert h.quantity("matrix_tflops_measured.bf16").range == (676, 685)


def test_host_cpu_entry_matches_its_measurement_file():
    hw = load_hardware("host-cpu")
    measured = json.loads((REPO / "data/results/host/host_cpu.json").read_text())
    assert hw.get("memory.bw_achievable_gbps") == pytest.approx(measured["copy_bw_gbps"], abs=0.005)
    assert hw.get("matrix_tflops.fp32") * 1e3 == pytest.approx(measured["fp32_matmul_gflops"], abs=0.01)
    assert "data/results/host/host_cpu.json" in hw.quantity("memory.bw_achievable_gbps").source_text
    for field in ("cpu", "torch", "commit", "copy", "matmul_fp32"):
        assert field in measured


def test_mi250_kernel_overhead_follows_from_the_reported_wo_a_gemv():
    hw = load_hardware("mi250-gcd")
    wo_a_rank_bytes = FLASH.o_lora_rank * FLASH.wo_a_in_per_group + 1024 // 128 * 4096 // 128  # one group + scales
    micro = acc_mod.load_paper("microbenchmarks")["entries"]["wo_a_gemv_decode"]
    derived = micro["us_after"] - wo_a_rank_bytes / (hw.bandwidth_gbps("achievable") * 1e3)
    assert hw.kernel_overhead_us == pytest.approx(derived, abs=0.05)


@pytest.mark.parametrize("body,message", [
    ("memory:\n  bw_peak_gbps: 100\n", "bare number"),
    ("memory:\n  bw_peak_gbps: {value: 100}\n", "needs a 'source'"),
    ("memory:\n  bw_peak_gbps: {value: 100, source: nowhere}\n", "not in the file's sources"),
    ("memory:\n  bw_peak_gbps: {value: 100, range: [1, 2], source: s}\n", "outside its range"),
    ("memory:\n  bw_peak_gbps: {value: fast, source: s}\n", "not a number"),
])
def test_malformed_catalogue_files_name_file_and_key(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ntitle: t\nkind: gpu\nsources: {s: somewhere}\n" + body)
    with pytest.raises(HardwareError, match=message) as err:
        load_hardware(path)
    assert "bad.yaml" in str(err.value) and "bw_peak_gbps" in str(err.value)


def test_unknown_hardware_lists_the_catalogue():
    with pytest.raises(HardwareError, match="mi250-gcd"):
        load_hardware("mi999")


# ============================================================================================ roofline terms
def test_op_terms_add_up_and_name_the_limits():
    mi = load_hardware("mi250-gcd")
    op = cm.Op(name="probe", component="routed_experts", kind="matmul", launches=2, weight_bytes_rank=8e6,
               other_bytes_rank=0.0, flops_rank=4e9, weight_format="fp4", m=1, weight_values_rank=16e6)
    t = rl.time_op(op, mi)
    assert t.total_us == pytest.approx(sum(getattr(t, k) for k in rl.TERMS))
    assert t.memory == pytest.approx(8e6 / 1.25e6)                      # bytes at the achievable 1.25 TB/s
    assert t.overhead == pytest.approx(2 * mi.kernel_overhead_us)
    assert t.route.startswith("int8")                                   # no FP4/FP8 on CDNA2: the paper's route
    full = 4e9 / 181e12 * 1e6
    assert t.compute == pytest.approx(full - t.memory)
    assert t.low_m == pytest.approx(4e9 / 90.5e12 * 1e6 - full)          # v_dot4 beats 1/16 of the MFMA rate
    assert t.format == pytest.approx(16e6 * 0.5 / 11.3e12 * 1e6)         # 0.5 lane op per FP4 value
    h200 = load_hardware("h200-sxm")
    assert rl.time_op(op, h200).route.startswith("fp8")                  # Hopper: FP4 unpacked to FP8
    assert rl.time_op(op, load_hardware("b200")).format == 0.0           # Blackwell multiplies FP4 natively
    lat = cm.Op(name="attn.core", component="attention", kind="attention", launches=43, other_bytes_rank=1e5,
                flops_rank=1e6, m=16, latency_bound=True)
    tl = rl.time_op(lat, mi)
    assert tl.total_us == pytest.approx(43 * mi.get("launch.latency_kernel_us"))


def test_bound_is_below_the_penalised_model():
    for name in ("mi250-gcd", "h200-sxm", "host-cpu"):
        rep = rl.roofline_report(get_preset("tiny"), load_hardware(name))
        assert rep["predicted"]["tok_s"] <= rep["bound_tok_s"] * (1 + 1e-9)
        assert sum(rep["predicted"]["components_us"].values()) == pytest.approx(rep["predicted"]["step_us"])


# ============================================================================================ the paper account
@pytest.fixture(scope="module")
def account():
    return acc_mod.paper_account()


def test_account_predicts_the_final_step_within_15_percent(account):
    assert abs(account["predicted_tok_s"] / 74.5 - 1) < 0.15
    assert sum(account["components_us"].values()) == pytest.approx(account["step_us"], rel=1e-12)
    assert account["predicted_tok_s"] == pytest.approx(1e6 / account["step_us"])
    assert account["range_tok_s"]["slow"] < account["predicted_tok_s"] < account["range_tok_s"]["fast"]
    what_if = account["structural_what_if_tok_s"]
    assert what_if["only the attention kernel latency-bound"] > account["predicted_tok_s"]
    assert what_if["no per-kernel overhead"] > account["predicted_tok_s"]
    assert what_if["library (RCCL) latency instead of peer-read"] < account["predicted_tok_s"]
    # the reported components enter as reported
    assert account["components_us"]["routed_moe"] == pytest.approx(43 * 52.69)
    assert account["components_us"]["attention"] == pytest.approx(43 * 18.0)
    # the routed stage is a small share; fixed per-layer costs dominate (the paper's conclusion)
    assert 0.12 < account["components_share"]["routed_moe"] < 0.22
    fixed = sum(account["components_share"][k] for k in ("attention", "latency_bound_kernels", "kernel_overhead",
                                                          "collectives"))
    assert fixed > 0.5


def test_account_states_bandwidth_utilization(account):
    bw = account["bandwidth"]
    assert 510 <= bw["bound_tok_s"] <= 540
    assert 13.0 < bw["utilization_pct"] < 15.0
    assert "14.0%" in bw["statement"]


def test_account_responds_to_its_inputs():
    hw = load_hardware("mi250-gcd")
    base = acc_mod.paper_account()
    slower = acc_mod.paper_account(hardware=rl.with_values(hw, {"launch.kernel_overhead_us": hw.kernel_overhead_us + 1}))
    step = cm.decode_step(FLASH, tp=4, context=140, sharding="sglang")
    streaming_launches = sum(o.launches for o in step.compute_ops
                             if not o.latency_bound and not o.name.startswith("routed."))
    delta = slower["components_us"]["kernel_overhead"] - base["components_us"]["kernel_overhead"]
    assert delta == pytest.approx(streaming_launches)
    assert slower["predicted_tok_s"] < base["predicted_tok_s"]


def test_account_reproduces_milestone_directions(account):
    rows = {m["id"]: m for m in account["milestones"]}
    order = ["ep4_alltoall", "ep1_no_alltoall", "int8_dot_moe", "peer_read_allreduce", "router_launch_geometry",
             "final"]
    predicted = [rows[i]["predicted_tok_s"] for i in order]
    assert predicted == sorted(predicted)
    for m in account["milestones"]:
        assert sum(m["components_us"].values()) == pytest.approx(m["step_us"])
    jump_reported = rows["peer_read_allreduce"]["reported_tok_s"] / rows["int8_dot_moe"]["reported_tok_s"]
    jump_model = rows["peer_read_allreduce"]["predicted_tok_s"] / rows["int8_dot_moe"]["predicted_tok_s"]
    assert 0.7 < jump_model / jump_reported < 1.4
    assert rows["int8_dot_moe"]["implied"]["isolated_latency_explains_pct"] < 20
    assert abs(rows["ep4_alltoall"]["predicted_tok_s"] / 14.6 - 1) < 0.25


def test_prefill_and_h200_accounts():
    pre = acc_mod.paper_account()["prefill"]
    assert 7 < pre["mfma_utilization_pct"] < 11  # the paper's derived analysis: ~9% of MFMA peak
    h = acc_mod.predict_account("h200-sxm")
    assert sum(h["components_us"].values()) == pytest.approx(h["step_us"])
    assert h["predicted_tok_s"] < h["bound_tok_s"]
    assert h["what_if"]["no overhead on streaming kernels"] > h["predicted_tok_s"]


def test_paper_data_files_carry_sources_and_agree():
    for name in ("headline", "decode_milestones", "prefill_milestones", "microbenchmarks", "rejected_directions"):
        assert "reported by the paper" in acc_mod.load_paper(name)["source"]
    decode = [m["tok_s"] for m in acc_mod.load_paper("decode_milestones")["milestones"]]
    assert decode == sorted(decode) and decode[-1] == 74.5
    for m in acc_mod.load_paper("prefill_milestones")["milestones"]:
        assert 4604 / m["ttft_s"] == pytest.approx(m["input_tok_s"], rel=0.01)
    with pytest.raises(rl.PerfError, match="no such paper data file"):
        acc_mod.load_paper("nonexistent")


# ============================================================================================ kernel results
def _synthetic_results(path: Path) -> Path:
    """TEST DATA, not a measurement: a small file in the decode_kernels.json schema."""
    rows = [dict(kernel="moe_decode", variant="test-data-a", batch=1, time_us=40.0, bytes=80_461_824, gbps=2011.5,
                 pct_copy_bw=47.3),
            dict(kernel="fp8_gemv_wq_b", variant="test-data-a", batch=1, time_us=12.0, bytes=33_556_480,
                 gbps=2796.4, pct_copy_bw=65.7),
            dict(kernel="decode_layer", variant="test-data-a", batch=4, time_us=300.0, bytes=3e8, gbps=1000.0,
                 pct_copy_bw=23.5),
            dict(kernel="not_a_kernel", variant="test-data-a", batch=1, time_us=1.0, bytes=1, gbps=1.0,
                 pct_copy_bw=0.0)]
    data = dict(note="SYNTHETIC TEST DATA - not a measurement", gpu="test-gpu", torch="0.0", triton="0.0",
                commit="0000000", copy_bw_gbps=4255.0, rows=rows)
    path.write_text(json.dumps(data))
    return path


def test_compare_kernel_results_on_synthetic_file(tmp_path):
    res = rl.compare_kernel_results(_synthetic_results(tmp_path / "decode_kernels.json"))
    rows = {r["kernel"]: r for r in res["rows"]}
    moe = rows["moe_decode"]
    assert moe["predicted_bytes"] == pytest.approx(80_461_824, rel=0.01)  # 6 experts' bytes + activations
    assert moe["measured_over_predicted"] == pytest.approx(40.0 / moe["predicted_us"])
    assert moe["floor_us_at_copy_bw"] == pytest.approx(80_461_824 / 4255e3)
    assert rows["fp8_gemv_wq_b"]["predicted_us"] > rows["fp8_gemv_wq_b"]["floor_us_at_copy_bw"]
    assert rows["decode_layer"]["predicted_us"] > moe["predicted_us"]
    assert rows["not_a_kernel"]["predicted_us"] is None and "no model" in rows["not_a_kernel"]["note"]


def test_compare_kernel_results_names_missing_fields(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps(dict(gpu="x", torch="x", triton="x", commit="x", rows=[])))
    with pytest.raises(rl.PerfError, match="copy_bw_gbps"):
        rl.compare_kernel_results(bad)
    bad.write_text(json.dumps(dict(gpu="x", torch="x", triton="x", commit="x", copy_bw_gbps=1.0,
                                   rows=[dict(kernel="moe_decode")])))
    with pytest.raises(rl.PerfError, match=r"rows\[0\] lacks"):
        rl.compare_kernel_results(bad)


# ============================================================================================ CLI
def test_cli_roofline_json(capsys):
    assert main(["roofline", "--preset", "flash", "--hardware", "mi250-gcd", "--tp", "4", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["bytes_per_token"] == pytest.approx(SPEC_TOTAL, rel=1e-3)
    assert 3.0e9 <= rep["bytes_per_token_per_rank"] <= 3.1e9 and 510 <= rep["bound_tok_s"] <= 540
    assert {o["name"] for o in rep["ops"]} >= {"routed.w13", "attn.core", "head"}


def test_cli_account_json_and_text(capsys):
    assert main(["roofline", "account", "--json"]) == 0
    acc = json.loads(capsys.readouterr().out)
    assert abs(acc["predicted_tok_s"] / 74.5 - 1) < 0.15
    assert sum(acc["components_us"].values()) == pytest.approx(acc["step_us"])
    assert acc["h200"]["predicted_tok_s"] > 0
    assert main(["roofline", "account", "--hardware", "h200-sxm", "--tp", "2", "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)
    assert pred["hardware"] == "h200-sxm" and sum(pred["components_us"].values()) == pytest.approx(pred["step_us"])
    assert main(["roofline", "account"]) == 0
    assert "14.0%" in capsys.readouterr().out


def test_cli_errors_and_other_actions(capsys, tmp_path):
    assert main(["roofline", "--hardware", "mi999"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mi999'" in err and "mi250-gcd" in err and len(err.strip().splitlines()) == 1
    assert main(["roofline"]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert main(["roofline", "hardware", "--hardware", "mi250-gcd"]) == 0
    assert "memory.bw_peak_gbps" in capsys.readouterr().out
    assert main(["roofline", "compare", str(_synthetic_results(tmp_path / "k.json"))]) == 0
    assert "moe_decode" in capsys.readouterr().out
    assert main(["roofline", "--preset", "tiny", "--hardware", "host-cpu", "--phase", "prefill", "--context", "300",
                 "--chunk", "128", "--top", "5"]) == 0


# ============================================================================================ figures, imports
def test_figures_are_built_and_byte_stable(tmp_path):
    from dsv4lab.faces import plots
    rep = rl.roofline_report(FLASH, load_hardware("mi250-gcd"), tp=4)
    acc = acc_mod.paper_account()

    def build():
        points = [dict(label=o["name"], intensity=o["flops_rank"] / o["bytes_rank"], source="modelled", group="ops",
                       tflops=o["flops_rank"] / o["total_us"] / 1e6) for o in rep["ops"] if o["flops_rank"] > 0]
        return {
            "roofline": plots.plot_roofline([dict(hardware="mi250-gcd", points=points), dict(hardware="h200-sxm")]),
            "waterfall": plots.plot_step_waterfall([dict(label=m["label"], components_us=m["components_us"],
                                                         reported_step_us=m["reported_step_us"])
                                                    for m in acc["milestones"]]),
            "bytes": plots.plot_bytes_composition({"whole model": cm.weight_bytes_per_token(FLASH)}),
        }

    figs, again = build(), build()  # a rerun on the same data must give the same bytes, at the same size
    for name, fig in figs.items():
        assert tuple(fig.get_size_inches()) == tuple(again[name].get_size_inches())
        first = plots.save_figure(fig, tmp_path / "a" / name)[0].read_bytes()
        second = plots.save_figure(again[name], tmp_path / "b" / name)[0].read_bytes()
        assert first == second and first[:4] == b"\x89PNG"
    assert len(figs["waterfall"].axes[0].patches) >= 6


def test_perf_and_plots_import_light():
    code = ("import sys, dsv4lab.tools.perf, dsv4lab.faces.plots, dsv4lab.tools.perf.costmodel, dsv4lab.tools.perf.roofline, "
            "dsv4lab.tools.perf.hardware; heavy = [m for m in ('torch', 'matplotlib', 'yaml', 'numpy') if m in sys.modules];"
            " print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
