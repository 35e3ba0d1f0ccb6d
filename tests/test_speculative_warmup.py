"""No compilation on the request path for speculative decoding (issues 32 and 34): ``warmup(draft_tokens=k)`` runs
everything a speculative request runs on the static paths, in the spare slot only.

Two things must be ready before the first request: the kernel specializations (a launch with a key Triton has not
seen compiles) and, on a GPU, the CUDA graphs (a key of :class:`~dsv4lab.engine.decode_graph.DecodeGraphs` or
:class:`~dsv4lab.engine.prefill_step.PrefillGraphs` not captured yet is captured on the request's path). On the
CPU the first is checked with the launch recorder (as ``tests/test_prefill_warmup.py`` does, recording without
running the kernels); the second by recording the static steps' graph keys — the kind and tier each
``Decoder.call`` would capture, the bucket and form each prefill chunk would — during the warm-up and during
speculative generations that reach every one (one-token prompts, ragged batches, chunked and cut prompts, every
draft count from 3 down to 1 at both tiers). The kernel keys cannot tell draft counts apart on this small model
(its rows stay on the decode kernels), the graph keys can: a warm-up that skipped one fails there.
"""
from __future__ import annotations

import json

import pytest
import torch

import dsv4lab
from conftest import ROOT, TINY
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.decode_graph import Decoder, tiers_for
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.engine.prefill_step import Prefiller
from dsv4lab.engine.speculative import SpeculativeDecoder, generate_speculative
from dsv4lab.faces import cli
from test_prefill_step import SMALL, _bytes, cache_state

spec = kernel_module("specialization")
TINY_PY = ROOT / "data" / "tiny-py"
DRAFTS = 3
_runners: dict = {}


def _small_mtp():
    """SMALL with an MTP block on the Triton backend, static paths, 2 slots (tiers 1 and 2), buckets 64/96/128 (so
    that a 150-token prompt is cut); cached and reset."""
    if "small" not in _runners:
        args = SMALL.replace(n_mtp_layers=1, compress_ratios=(0, 4, 16, 0), max_seq_len=200)
        m = dsv4lab.load(RandomCheckpoint(args, 1), backend="triton", max_batch=2, validate=False,
                         prefill_path="static", decode_path="static")
        m._prefillers["static"] = Prefiller(m, graphs=False, buckets=(64, 96, 128))
        _runners["small"] = m
    _runners["small"].reset()
    return _runners["small"]


CASES = [([1], None), ([1, 1], None), ([70], None), ([90, 9], None), ([150], None), ([33, 20], 16), ([17], 8)]
"""Prompt lengths and prefill chunk: one-token prompts (the decode and MTP steps at each tier), a prompt in every
bucket, longer than the widest (cut), ragged batches of 2, chunked ending in a one-token chunk (33 and 20 by 16:
16, 16, 1; 17 by 8: 8, 8, 1)."""


def _sweep(m) -> list[tuple[list[int], int | None, set]]:
    """A speculative generation of 5 tokens per case of :data:`CASES` (budgets that end with fewer drafts: ``K`` =
    3, 2, 1 at each tier; random weights accept no draft, so one token a cycle), each one's launch keys recorded
    without running the kernels."""
    ids = torch.randint(2, m.args.vocab_size, (2, 150), generator=torch.Generator().manual_seed(0))
    out = []
    for lengths, chunk in CASES:
        m.reset()
        prompts = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        with spec.LaunchRecorder(execute=False) as rec:
            generate_speculative(m, prompts, 5, DRAFTS, stop_at_eos=False, prefill_chunk=chunk)
        out.append((lengths, chunk, set(rec.keys)))
    return out


def test_after_a_speculative_warmup_speculation_launches_only_warmed_specializations():
    m = _small_mtp()
    with spec.LaunchRecorder(execute=False) as plain:
        m.warmup(progress=False)
    with spec.LaunchRecorder(execute=False) as rec:
        report = m.warmup(progress=False, draft_tokens=DRAFTS)
    warmed = set(rec.keys)
    assert report.draft_tokens == DRAFTS and report.specializations == len(warmed)
    assert report.prefill_mtp_s.keys() == {64, 96, 128} and report.speculative_s.keys() == {1, 2}
    assert list(report.new_specializations) == ["prefill 128", "prefill mtp 128", "prefill 96", "prefill mtp 96",
                                                "prefill 64", "prefill mtp 64", "decode 1", "speculative 1",
                                                "decode 2", "speculative 2"]
    assert report.new_specializations["speculative 1"] > 0  # the T-token verify and the MTP step: keys of their own
    assert "speculation (3 draft(s))" in report.describe()
    missed_by_plain = set()
    for lengths, chunk, keys in _sweep(m):
        new = keys - warmed
        assert not new, f"prompts of {lengths} tokens (chunk {chunk}) launched {len(new)} key(s) the warm-up did " \
            "not: " + "; ".join(k.describe() for k in list(new)[:3])
        missed_by_plain |= keys - set(plain.keys)
    assert missed_by_plain  # a plain warm-up misses speculation's keys: the check can fail


class _GraphKeys:
    """Records the graph key of every static call: ``(kind, tier)`` of ``Decoder.call`` — what
    :class:`DecodeGraphs` captures per key on a GPU — and ``("prefill", bucket, mtp)`` of each prefill chunk."""

    def __init__(self, monkeypatch, m):
        self.keys: set = set()
        tiers = tiers_for(m.max_batch)
        call, run = Decoder.call, Prefiller._run

        def spy_call(decoder, kind, fn, inputs, pads):
            self.keys.add((kind, next(t for t in tiers if t >= inputs[0].shape[0])))
            return call(decoder, kind, fn, inputs, pads)

        def spy_run(prefiller, bucket, io, mtp=False):
            self.keys.add(("prefill", bucket, mtp))
            return run(prefiller, bucket, io, mtp)
        monkeypatch.setattr(Decoder, "call", spy_call)
        monkeypatch.setattr(Prefiller, "_run", spy_run)

    def take(self) -> set:
        keys, self.keys = self.keys, set()
        return keys


def test_the_warmup_creates_exactly_the_graph_keys_speculation_uses(monkeypatch):
    """Every (kind, tier) a speculative generation would capture is one the warm-up captured, and the warm-up
    captures nothing speculation does not use: the cycles of 1 … k drafts, the one-token chunk's decode and MTP
    steps at each tier, and each bucket's chunk with the MTP block (the plain chunks are plain decoding's)."""
    m = _small_mtp()
    spy = _GraphKeys(monkeypatch, m)
    with spec.LaunchRecorder(execute=False):
        m.warmup(progress=False)
        # (plain decoding's one-token step is a graph per tier of its own, DecodeGraphs.graphs[tier]: no call kind)
        assert spy.take() == {("prefill", c, False) for c in (64, 96, 128)}
        m.warmup(progress=False, draft_tokens=DRAFTS)
    warmed = spy.take()
    _sweep(m)
    used = spy.take()
    tiers = (1, 2)
    want = {(f"speculative K{k}", t) for k in range(1, DRAFTS + 1) for t in tiers}
    want |= {("tokens T1", t) for t in tiers} | {("mtp", t) for t in tiers}
    want |= {("prefill", c, mtp) for c in (64, 96, 128) for mtp in (False, True)}
    assert warmed == want
    assert used == want - {("prefill", c, False) for c in (64, 96, 128)}, used ^ want


def test_warmup_for_speculation_leaves_live_sequences_and_their_tokens_untouched():
    """The reference backend on data/tiny-py (a trained MTP block: drafts accepted and rejected): a warm-up for
    3 drafts between two cycles of a live batch leaves the sequences' cache bytes (main layers and MTP block) as
    they were and the spare slot as a fresh runner's; the later cycles' tokens, positions and every cache byte are
    those of a run without it, and a speculative generation after it gives plain greedy's ids (the golden ones)."""
    golden = json.loads((ROOT / "data" / "golden" / "tiny-py.json").read_text())["oracles"][:2]
    prompts = [o["prompt_ids"] for o in golden]
    results = []
    for warm in (False, True):
        m = dsv4lab.load(TINY_PY, max_batch=2, max_seq_len=64, prefill_path="static", decode_path="static")
        dec = SpeculativeDecoder(m, DRAFTS)
        width = max(map(len, prompts))
        dec.prefill([p + [p[-1]] * (width - len(p)) for p in prompts], [0, 1], lengths=list(map(len, prompts)),
                    logits="last")
        tokens = [r.tokens for r in dec.step([0, 1])]
        if warm:
            fresh = cache_state(dsv4lab.load(TINY_PY, max_batch=2, max_seq_len=64))
            before = cache_state(m)
            report = m.warmup(progress=False, draft_tokens=DRAFTS)
            assert report.prefill_mtp_s.keys() == {16, 32, 48, 64} and report.speculative_s.keys() == {1, 2}
            after = cache_state(m)
            live = [0, 1]  # every sequence's slot as it was; the spare slot (scratch: the cycles' rollback writes
            # what it keeps there) as a fresh runner's
            assert all(torch.equal(before[k][live], after[k][live]) for k in before)
            assert all(torch.equal(after[k][m.spare_slot], fresh[k][m.spare_slot]) for k in after)
        for _ in range(4):
            tokens += [r.tokens for r in dec.step([0, 1])]
        results.append((tokens, cache_state(m), m.positions.clone(), m.mtp_positions.clone(), dec.stats.accepted))
    (t0, c0, p0, q0, a0), (t1, c1, p1, q1, a1) = results
    assert t0 == t1 and torch.equal(p0, p1) and torch.equal(q0, q1) and a0 == a1 > 0
    assert all(torch.equal(c0[k], c1[k]) for k in c0)
    assert generate_speculative(m, prompts, 12, DRAFTS)[0] == [o["expected_ids"][:12] for o in golden]


def test_speculative_warmup_refuses_what_speculation_refuses():
    no_mtp = dsv4lab.load(RandomCheckpoint(SMALL.replace(max_seq_len=64), 1), max_batch=1, validate=False,
                          prefill_path="static", decode_path="static")
    with pytest.raises(ValueError, match="has no MTP block: speculative decoding needs one"):
        no_mtp.warmup(progress=False, draft_tokens=1)
    assert no_mtp.warmup_report is None
    m = _small_mtp()
    with pytest.raises(ValueError, match=r"draft_tokens must be an integer in \[1, 7\]"):
        m.warmup(progress=False, draft_tokens=8)
    with spec.LaunchRecorder(execute=False):
        report = m.warmup(progress=False, draft_tokens=0)  # 0: no speculation
    assert report.draft_tokens == 0 and not report.prefill_mtp_s and not report.speculative_s
    assert "speculation" not in report.describe()


def test_generate_and_serve_warm_up_for_their_draft_count(capsys):
    assert cli.main(["generate", "--checkpoint", str(TINY), "--prompt-ids", "5,6,7", "--max-new-tokens", "3",
                     "--warmup", "--speculative", "mtp", "--draft-tokens", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["warmup"]["draft_tokens"] == 2 and "eager decode path" in res["warmup"]["note"]
    assert cli.main(["generate", "--checkpoint", str(TINY), "--prompt-ids", "5,6", "--warmup", "--speculative",
                     "mtp", "--draft-tokens", "99"]) == 2
    assert "--draft-tokens must be in [1, " in capsys.readouterr().err  # refused before the warm-up
    pytest.importorskip("fastapi")
    from dsv4lab.tools.serve.server import ServerOptions, build_app
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=32, prefill_path="static", decode_path="static")
    _, scheduler = build_app(ServerOptions(checkpoint=str(TINY), max_concurrency=1, warmup=True, speculative="mtp",
                                           draft_tokens=2), model=m)
    scheduler.stop()
    report = m.warmup_report
    assert report.draft_tokens == 2 and report.speculative_s.keys() == {1} and report.prefill_mtp_s.keys() == {16, 32}
    m.warmup_report = None
    with pytest.raises(ValueError, match=r"draft_tokens must be an integer in \[1, "):  # (serve: --draft-tokens)
        build_app(ServerOptions(checkpoint=str(TINY), max_concurrency=1, warmup=True, speculative="mtp",
                                draft_tokens=99), model=m)
    assert m.warmup_report is None  # refused before the warm-up ran


# ------------------------------------------------------------------------------------------ GPU (run by the lead)
@pytest.mark.gpu
def test_gpu_after_a_speculative_warmup_speculation_captures_nothing():
    """On the graph paths (Triton backend, data/tiny-py, tiers 1 and 2): after ``warmup(draft_tokens=3)`` the
    decode and prefill graphs hold every key speculation uses, and speculative generations — single, ragged
    batches, one-token prompts, budgets that end with fewer drafts — capture no graph more and emit the same
    backend's plain greedy ids."""
    m = dsv4lab.load(TINY_PY, device="cuda", backend="triton", max_batch=2, max_seq_len=256)
    assert m.decode_path == "graph" and m.prefill_path == "graph"
    report = m.warmup(progress=False, draft_tokens=DRAFTS)
    decode, prefill = m.decoder.graphs, m.prefiller.graphs
    tiers = decode.tiers
    want = {(f"speculative K{k}", t) for k in range(1, DRAFTS + 1) for t in tiers}
    want |= {("tokens T1", t) for t in tiers} | {("mtp", t) for t in tiers}
    assert want <= set(decode.capture_s) and not decode.uncaptured, (decode.capture_s, decode.uncaptured)
    assert {("mtp", c) for c in m.prefiller.buckets} <= set(prefill.capture_s), prefill.capture_s
    assert report.speculative_s.keys() == set(tiers) and report.prefill_mtp_s.keys() == set(m.prefiller.buckets)
    captured = (set(decode.capture_s), set(prefill.capture_s))
    golden = json.loads((ROOT / "data" / "golden" / "tiny-py.json").read_text())["oracles"][:2]
    prompts = [o["prompt_ids"] for o in golden] + [[5], [6]]
    plain = [m.generate(p, 12) for p in prompts]
    for p, want_ids in zip(prompts, plain):
        assert m.generate(p, 12, speculative="mtp", draft_tokens=DRAFTS) == want_ids
    for rows in ((0, 1), (2, 3)):
        outs, _ = generate_speculative(m, [prompts[i] for i in rows], 12, DRAFTS)
        assert outs == [plain[i] for i in rows]
    assert (set(decode.capture_s), set(prefill.capture_s)) == captured, m.decode_info()
