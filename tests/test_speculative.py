"""MTP in the runner API and lossless self-speculative decoding with exact cache rollback (issue 23)."""
import json
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import dsv4lab
from conftest import ROOT, load_tiny
from dsv4lab.core.config import get_preset
from dsv4lab.engine.decode_graph import StaticDecodeStep
from dsv4lab.engine.prefill_step import StaticPrefillStep
from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.engine.speculative import SpeculativeDecoder, generate_speculative, max_draft_tokens
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.tools.bench.e2e import cut_layers
from dsv4lab.tools.bench.e2e_multitoken import speculate
from dsv4lab.tools.train.trainer import TrainingOps, lm_losses
from dsv4lab.tools.verify.model import fixed_sequence, fp32_reduction_ops, judge_kl, kl_per_position, kl_rule, \
    rounding_noise_floor, rounding_noise_floors_with_mtp
from dsv4lab.tools.verify.speculative import critical_positions, rollback_vs_recompute

TINY_PY = ROOT / "data" / "tiny-py"
_golden = {ck: json.loads((ROOT / "data" / "golden" / f"{ck}.json").read_text()) for ck in ("tiny", "tiny-py")}
_models: dict = {}


def _model(ck: str, max_batch: int = 3):
    """Session-cached runners of the two shipped checkpoints (bf16, every simulation on: the golden setting)."""
    if ck == "tiny":
        return load_tiny(max_batch=max_batch)
    if max_batch not in _models:
        _models[max_batch] = dsv4lab.load(TINY_PY, max_batch=max_batch)
    _models[max_batch].reset()
    return _models[max_batch]


# ------------------------------------------------------------------------------------------ lossless
@pytest.mark.parametrize("ck", ["tiny", "tiny-py"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_equals_plain_greedy(ck, k):
    # the golden oracles are plain greedy decoding's ids (recorded by `verify record`)
    o = _golden[ck]["oracles"][1]
    m = _model(ck)
    ids = m.generate(o["prompt_ids"], len(o["expected_ids"]), speculative="mtp", draft_tokens=k)
    assert ids == o["expected_ids"] and trajectory_hash(ids) == o["hash"]
    st = m.last_speculative_stats
    assert st.drafted > 0 and st.emitted >= len(ids) - 1  # the first token comes from the prefill
    if ck == "tiny-py":  # the trained MTP block: drafts are accepted and rejected, both paths run
        assert 0 < st.accepted < st.drafted


@pytest.mark.parametrize("ck,k,chunk", [("tiny-py", 2, 5), ("tiny", 3, None)])
def test_ragged_batch_equals_plain_greedy_per_row(ck, k, chunk):
    oracles = _golden[ck]["oracles"][:3]
    m = _model(ck)
    prompts = [o["prompt_ids"] for o in oracles]
    assert len({len(p) for p in prompts}) > 1  # ragged
    n = min(len(o["expected_ids"]) for o in oracles)
    outs, st = generate_speculative(m, prompts, n, k, slots=[2, 0, 1], prefill_chunk=chunk)
    for out, o in zip(outs, oracles):
        assert out == o["expected_ids"][:n]
    assert st.verify_forwards < st.cycles  # rows verified together


def test_speculation_prefills_through_plain_greedys_static_steps(monkeypatch):
    """Issue 32's H200 failure: speculation's prefill ran the eager forward, plain greedy's the captured static
    step, and on a GPU the two round differently (bucket-padded GEMM shapes), so the trajectories parted at once.
    On the CPU they are one arithmetic; here the static steps are given fp32 instead of exact reductions (another
    rounding, as on a GPU), so a prefill that left them shows: ``prefill(..., mtp=True)``'s main logits must equal
    plain ``prefill``'s bit for bit (one forward, and chunks ending in a one-token chunk: the decode step's), and
    speculative ``generate`` plain ``generate``'s ids."""
    m = dsv4lab.load(TINY_PY, max_batch=1, prefill_path="static", decode_path="static")
    reordered = fp32_reduction_ops(m.ops.numerics)
    for step in (StaticPrefillStep, StaticDecodeStep):
        monkeypatch.setattr(step, "ops", property(lambda self: reordered))
    o = _golden["tiny-py"]["oracles"][0]
    prompt = o["prompt_ids"]
    plain = m.prefill(prompt)
    m.prefill_path = "eager"
    assert not torch.equal(m.prefill(prompt), plain)  # the two paths are told apart
    m.prefill_path = "static"
    for chunk in (None, len(prompt) - 1):
        main, _, _ = m.prefill(prompt, chunk, mtp=True)
        assert torch.equal(main, m.prefill(prompt, chunk)), chunk
    want = m.generate(prompt, 12)
    for k in (1, 3):
        assert m.generate(prompt, 12, speculative="mtp", draft_tokens=k) == want, k
        assert m.last_speculative_stats.accepted > 0


# ------------------------------------------------------------------------------------------ rollback
def test_rollbacks_across_window_ratio4_ratio16_and_topk_are_bit_exact():
    m = _model("tiny", 1)
    ids = fixed_sequence(m.args, 70)  # past the last boundary (64)
    rb = rollback_vs_recompute(m, ids, draft_tokens=3)
    assert not rb["missed_critical"]
    # window 32 (fills at 31, wraps at 32), ratio 4 and 16 block completions, index top-k (64)
    assert set(critical_positions(m.args)) == {3, 4, 7, 8, 15, 16, 31, 32, 63, 64}
    assert set(critical_positions(m.args)) <= set(rb["rolled_back"])
    for full, cycled in (rb["main"], rb["mtp"]):
        assert not torch.isnan(cycled).any()
        assert torch.equal(full, cycled)


def test_the_mtp_heads_rounding_floor_is_measured_beside_the_main_heads():
    m = _model("tiny-py", 1)
    ids = fixed_sequence(m.args, 40)
    floors = rounding_noise_floors_with_mtp(m, ids)
    assert len(floors["main"]) == len(floors["mtp"]) == len(ids) - 1
    assert floors["main"] == rounding_noise_floor(m, ids[:-1])  # the MTP block does not touch the main logits
    # fp32 reductions do move the MTP logits (a floor of zero would make any difference fail)
    assert 0 < sum(floors["mtp"]) and floors["mtp"] != floors["main"]


def test_verify_tiers_pass_and_catch_a_rollback_that_misses_the_ring_caches(monkeypatch):
    from dsv4lab.engine import speculative
    from dsv4lab.tools.verify.speculative import render_speculative, verify_speculative
    m = _model("tiny", 1)
    g = dict(_golden["tiny"], oracles=_golden["tiny"]["oracles"][:1],
             teacher_forced=dict(_golden["tiny"]["teacher_forced"], ids=_golden["tiny"]["teacher_forced"]["ids"][:70]))
    tiers = verify_speculative(m, g, kl_bound=1e-9, draft_tokens=2, skip_trajectory=True)
    assert set(tiers) == {"speculative_oracles", "rollback_vs_recompute"} and all(t["ok"] for t in tiers.values())
    assert "rollback_vs_recompute" in "\n".join(render_speculative(tiers))
    restore = speculative.CacheSnapshot.restore

    def forgetful(self, keep_main, keep_mtp):  # a rollback that leaves the window / compressor rings as written
        self.rings = []
        restore(self, keep_main, keep_mtp)
    monkeypatch.setattr(speculative.CacheSnapshot, "restore", forgetful)
    bad = verify_speculative(m, g, kl_bound=1e-9, draft_tokens=2, skip_trajectory=True)["rollback_vs_recompute"]
    assert not bad["ok"] and bad["first_divergence"] is not None


def _slot_caches(model, slot):
    out = {}
    for i, blk in enumerate(model.blocks()):
        for j, (buf, _) in enumerate(blk.attn.ring_caches() + blk.attn.entry_caches()):
            out[f"block{i}.cache{j}"] = buf[slot].clone()
    return out


@pytest.mark.parametrize("P,m", [(29, 0), (30, 1), (61, 2), (13, 3)])
def test_rollback_restores_every_cache_byte(P, m):
    # verify positions P..P+3 (crossing the window fill/wrap at 31/32, ratio-4 and ratio-16 completions at 31 or
    # 15, the ratio-16 entry at 63), accept m drafts: the caches must equal a run of the accepted prefix alone
    r = _model("tiny", 2)
    ids = fixed_sequence(r.args, P + 6, seed=7)
    dec = SpeculativeDecoder(r, 3)
    dec.prefill([ids[:P]], [0], next_tokens=[ids[P]])
    k = 3
    wrong = [(ids[P + j] + 1) % r.args.vocab_size for j in range(m + 1, k + 1)]
    res = dec.step([0], tokens=[ids[P]], drafts=[ids[P + 1:P + m + 1] + wrong], teacher=[ids[P + 1:P + k + 2]])[0]
    assert res.accepted == m and res.tokens == ids[P + 1:P + m + 2]
    kept = P + m + 1
    r.forward(torch.tensor([ids[:kept]]), 0, slots=[1], mtp=True, next_tokens=[ids[kept]])
    assert r.positions[0] == r.positions[1] == kept and r.mtp_positions[0] == r.mtp_positions[1] == kept
    a, b = _slot_caches(r.model, 0), _slot_caches(r.model, 1)
    for name in a:
        same = (a[name] == b[name]) | (torch.isnan(a[name]) & torch.isnan(b[name]))
        assert bool(same.all()), name


def test_snapshot_limit_and_api_errors():
    m = _model("tiny", 1)
    assert max_draft_tokens(m.model) == 7  # ratio 4: compressor states of 8 rows
    with pytest.raises(ValueError, match="draft_tokens"):
        SpeculativeDecoder(m, 8)
    with pytest.raises(ValueError, match="temperature"):
        m.generate([5, 6], 4, temperature=0.7, speculative="mtp")
    with pytest.raises(ValueError, match="known methods"):
        m.generate([5, 6], 4, speculative="eagle")
    m.forward(torch.tensor([[5, 6, 7]]), 0)  # without the MTP block: its caches fall behind
    with pytest.raises(ValueError, match="MTP caches"):
        m.forward(torch.tensor([[8]]), 3, mtp=True)
    m.reset()
    with pytest.raises(ValueError, match="next_tokens"):
        m.forward(torch.tensor([[5, 6]]), 0, mtp=True, next_tokens=[10 ** 6])
    args = get_preset("tiny").replace(n_mtp_layers=0, compress_ratios=get_preset("tiny").compress_ratios[:-1],
                                      max_seq_len=64)
    no_mtp = dsv4lab.load(RandomCheckpoint(args, seed=1), max_batch=1)
    with pytest.raises(ValueError, match="no MTP block"):
        no_mtp.forward(torch.tensor([[5, 6]]), 0, mtp=True)


# ------------------------------------------------------------------------------------------ the MTP API
def test_mtp_logits_equal_the_training_path():
    # lm_losses (dsv4lab.tools.train) runs the MTP block on the main model's streams with the next tokens' embeddings;
    # forward(mtp=True) must produce the same logits, so the same cross-entropies, bit for bit
    m = dsv4lab.load(TINY_PY, max_batch=2)
    window = torch.tensor([fixed_sequence(m.args, 42, seed=s) for s in (3, 4)])
    n = window.shape[1] - 2
    with torch.no_grad():
        losses = lm_losses(m.model, TrainingOps(m.ops.numerics), window, mtp_weight=0.3, indexer_weight=0.0)
    m.model.allocate(m.max_batch, m.ops.numerics.act, m.ops.numerics.acc, m.device)
    m.reset()
    logits, mtp_logits = m.forward(window[:, :n], 0, mtp=True, next_tokens=window[:, n])
    vocab = logits.shape[-1]
    assert F.cross_entropy(logits.reshape(-1, vocab), window[:, 1:n + 1].reshape(-1)) == losses["lm"]
    assert F.cross_entropy(mtp_logits.reshape(-1, vocab), window[:, 2:].reshape(-1)) == losses["mtp"]
    # the MTP block's caches advanced with the main ones: a decode step continues both
    step, mtp_step = m.forward(window[:, n:n + 1], n, mtp=True)
    assert step.shape == mtp_step.shape == (2, 1, vocab) and int(m.mtp_positions[0]) == n + 1


def test_mtp_forward_is_chunk_and_batch_invariant():
    m = _model("tiny", 2)
    ids = torch.tensor([fixed_sequence(m.args, 41, seed=5)])
    full, full_mtp = m.forward(ids[:, :40], 0, slots=[0], mtp=True, next_tokens=ids[:, 40])
    parts = [m.forward(ids[:, s:e], s, slots=[1], mtp=True, next_tokens=ids[:, e])
             for s, e in ((0, 17), (17, 18), (18, 40))]
    assert torch.equal(torch.cat([p[0] for p in parts], 1), full)
    assert torch.equal(torch.cat([p[1] for p in parts], 1), full_mtp)


# ------------------------------------------------------------------------------------------ faces
def test_generate_cli_speculative_prints_the_plain_hash(capsys):
    from dsv4lab.faces import cli
    o = _golden["tiny-py"]["oracles"][0]
    cmd = [sys.executable, "-m", "dsv4lab", "generate", "--checkpoint", str(TINY_PY), "--prompt-ids",
           ",".join(map(str, o["prompt_ids"])), "--max-new-tokens", "16", "--speculative", "mtp",
           "--draft-tokens", "2", "--json"]
    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert res["output_ids"] == o["expected_ids"] and res["hash"] == o["hash"]
    assert res["speculative"]["draft_tokens"] == 2 and res["speculative"]["drafted"] > 0
    # the refusal through cli.main in this process (a second Python costs ~1.6 s of start-up; an exception escaping
    # cli.main fails the test as a traceback would)
    assert cli.main(cmd[3:-5] + ["--speculative", "mtp", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "Traceback" not in err


def test_scheduler_speculative_matches_plain_and_samples_the_rest():
    from dsv4lab.tools.serve.scheduler import SamplingParams, Scheduler
    m = _model("tiny-py", 3)
    sched = Scheduler(m, max_running=3, speculative="mtp", draft_tokens=2)
    oracles = _golden["tiny-py"]["oracles"][:2]
    got: dict = {}
    done = threading.Event()

    def deliver(key):
        def f(event):
            got.setdefault(key, []).append(event)
            if event.finish_reason and len([k for k in got if got[k][-1].finish_reason]) == 3:
                done.set()
        return f
    sched.start()
    try:
        for i, o in enumerate(oracles):
            sched.submit(o["prompt_ids"], SamplingParams(max_tokens=16, logprobs=1), deliver(i))
        sched.submit(oracles[0]["prompt_ids"], SamplingParams(max_tokens=6, temperature=0.8, seed=3), deliver("s"))
        assert done.wait(300)
    finally:
        sched.stop()
    for i, o in enumerate(oracles):
        assert [e.token_id for e in got[i]] == o["expected_ids"]
        assert all(e.logprob is not None and e.logprob <= 0 for e in got[i])
    assert len(got["s"]) == 6 and got["s"][-1].finish_reason == "length"
    assert sched.counters["accepted_tokens"] > 0 and sched.counters["decode_steps"] < 15


# ------------------------------------------------------------------------------------------ GPU (run by the lead)
@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_triton_speculative_equals_its_plain_greedy(k):
    # Lossless on a fast backend needs its (k+1)-row verify forward to round each row as its 1-row step does
    # (decode kernels below 64 rows on both sides). Compared with the same backend's plain greedy ids.
    m = dsv4lab.load(TINY_PY, device="cuda", backend="triton", max_batch=1)
    for o in _golden["tiny-py"]["oracles"][:3]:
        plain = m.generate(o["prompt_ids"], 16)
        assert m.generate(o["prompt_ids"], 16, speculative="mtp", draft_tokens=k) == plain, o["name"]
    ids = fixed_sequence(m.args, 70)
    rb = rollback_vs_recompute(m, ids, draft_tokens=3)
    # the one-shot forward of 69 tokens runs the prefill kernels, the cycles the decode kernels: rounding only,
    # judged by verify model's calibrated rule — each head by its own rounding floor of these ids on this GPU
    floors = rounding_noise_floors_with_mtp(dsv4lab.load(TINY_PY, device="cuda", max_batch=1), ids)
    for head in ("main", "mtp"):
        rule = kl_rule(floors[head], None)
        verdict = judge_kl(kl_per_position(*rb[head]), m.args, rule)
        assert verdict["ok"], (head, verdict["mean_kl"], verdict["max_kl"], rule["mean_kl"], rule["max_kl"])


@pytest.mark.gpu
def test_gpu_flash_width_speculation_equals_plain_greedy_on_the_captured_paths():
    """Issue 32's H200 failure, at Flash widths (generated weights, 4 main layers: SWA, SWA, CSA, HCA, and the MTP
    block), the Triton backend with graph prefill and graph decode: speculation's prefill gives plain prefill's
    logits bit for bit, and speculative decoding plain greedy's ids — without injection (random weights: drafts
    rejected) and with injected acceptance α = 0.8 (bench e2e's loop: drafts accepted, and still the same ids)."""
    args = cut_layers(get_preset("flash"), 4)
    m = dsv4lab.load(RandomCheckpoint(args, 0, "cuda", name="flash-4"), device="cuda", backend="triton", max_batch=1,
                     max_seq_len=512, validate=False)
    assert m.prefill_path == "graph" and m.decode_path == "graph"
    prompt = fixed_sequence(m.args, 150, seed=6)
    plain = m.prefill(prompt)
    assert torch.equal(m.prefill(prompt, mtp=True)[0], plain)
    want = m.generate(prompt, 16, stop_at_eos=False)
    for k in (1, 3):
        assert m.generate(prompt, 16, speculative="mtp", draft_tokens=k, stop_at_eos=False) == want, k
        injected = speculate(m, prompt, 15, k, truth=want, alpha=0.8, seed=k)
        assert injected["ids"] == want and injected["stats"].accepted > 0, (k, injected["stats"])
