"""The static decode step with T tokens per sequence (issue 32): equal to T one-token steps, ragged lengths, the MTP
block at the same positions, speculative decoding on it (static path on the CPU, graphs on a GPU), and its limits.

Positions are chosen on the tiny model's boundaries (window 32: filled at 31, wrapped at 32; ratio-4 and ratio-16
blocks completed at 31 and 63; the index top-k of 16 entries reached at 64), so a step's later rows complete blocks
and wrap the window while its earlier rows still read what those writes replace in a ring of period W.
"""
from __future__ import annotations

import json

import pytest
import torch

import dsv4lab
from conftest import ROOT, TINY
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.decode_graph import Decoder, StaticDecodeStep, step_tokens
from dsv4lab.engine.speculative import SpeculativeDecoder, generate_speculative, max_draft_tokens

TINY_PY = ROOT / "data" / "tiny-py"
GOLDEN = json.loads((ROOT / "data" / "golden" / "tiny-py.json").read_text())
GPU = torch.cuda.is_available()


_small: dict = {}


def small_model(**kw):
    """A 3-layer random model with the tiny model's widths (SWA, CSA, HCA and an MTP block: every cache kind at
    half the tiny model's cost), cached per load arguments and reset."""
    key = tuple(sorted((k, str(v)) for k, v in kw.items()))
    if key not in _small:
        args = get_preset("tiny").replace(n_layers=3, compress_ratios=(0, 4, 16, 0), max_seq_len=80)
        _small[key] = dsv4lab.load(RandomCheckpoint(args, seed=2), max_batch=3, **kw)
    _small[key].reset()
    return _small[key]


def _ids(rows: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 4096, (rows, n), generator=torch.Generator().manual_seed(seed))


def _caches(model, slots) -> list[torch.Tensor]:
    return [buf[slots].clone() for blk in model.blocks()
            for buf, _ in blk.attn.ring_caches() + blk.attn.entry_caches()]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


# sequences at (start, tokens this step): across the window's fill and wrap and a ratio-4/16 completion at 31;
# two tokens inside a block; three ending on the ratio-4/16 completion at 63 just before the top-k boundary
RAGGED = [(29, 4), (13, 2), (61, 3)]


def _one_token_steps(step, ids, starts, lens, slots):
    """The same tokens as ``T`` successive one-token steps (sequence ``i`` takes part in step ``t < lens[i]``)."""
    out = []
    for t in range(max(lens)):
        rows = [i for i, n in enumerate(lens) if t < n]
        pos = torch.tensor([starts[i] + t for i in rows])
        logits = step(ids[rows, pos], pos, torch.tensor([slots[i] for i in rows]))
        out.append(dict(zip(rows, logits)))
    return out


def test_t_token_step_equals_t_one_token_steps_bit_for_bit_with_ragged_lengths():
    """Reference backend: the logits of every real row and every cache byte of the three slots after the step
    equal those of one-token steps; rows past a sequence's length repeat its last real row."""
    m = small_model(decode_path="static")
    assert step_tokens(m.model) == 8 and m.model.layers[0].attn.win_kv.shape[1] == 32 + 7
    ids = _ids(3, 70, seed=4)
    starts, lens = [s for s, _ in RAGGED], [n for _, n in RAGGED]
    slots = [1, 2, 0]
    step = m.decoder.step
    m.prefill(ids[:, :max(starts)], slots=slots, lengths=starts)
    before = _caches(m.model, slots)
    want = _one_token_steps(step, ids, starts, lens, slots)
    want_caches = _caches(m.model, slots)
    for buf, old in zip([b for blk in m.model.blocks() for b, _ in blk.attn.ring_caches() + blk.attn.entry_caches()],
                        before):
        buf[slots] = old
    T = max(lens)
    tokens = torch.stack([ids[i, s:s + T] for i, s in enumerate(starts)])
    got = step.run(tokens, torch.tensor(starts), torch.tensor(slots), torch.tensor(lens))
    for i, n in enumerate(lens):
        for t in range(T):
            assert torch.equal(got.logits[i, t], want[min(t, n - 1)][i]), (i, t)
    assert all(_same(a, b) for a, b in zip(_caches(m.model, slots), want_caches))


def test_mtp_verify_step_equals_the_eager_forward_with_mtp():
    """``run(..., mtp=True)``: main and MTP logits and streams equal ``runner.forward(..., mtp=True)`` of the same
    ragged tokens (each row's MTP input is the next token, the last real row's the greedy choice); the one-token
    :meth:`StaticDecodeStep.mtp` equals ``runner.forward_mtp``."""
    ids = _ids(2, 40, seed=6)
    starts, lens = torch.tensor([29, 13]), torch.tensor([4, 2])
    outs = []
    for path in ("eager", "static"):
        m = small_model(decode_path=path)
        m.prefill(ids, slots=[0, 1], lengths=starts, mtp=True)
        tokens = torch.stack([ids[0, 29:33], ids[1, 13:17]])
        if path == "eager":
            lg, mlg, X, Xm = m.forward(tokens, starts, slots=[0, 1], lengths=lens, mtp=True, return_hidden=True)
            nxt = mlg.argmax(-1)[:, :1]
            one = m.forward_mtp(Xm[:, :1], nxt, starts + lens, slots=[0, 1])
        else:
            o = m.decoder.run(tokens, starts, torch.tensor([0, 1]), lens, mtp=True)
            lg, mlg, X, Xm = o.logits, o.mtp_logits, o.hidden, o.mtp_hidden
            nxt = mlg.argmax(-1)[:, :1]
            one = m.decoder.mtp(Xm[:, 0], nxt[:, 0], starts + lens, torch.tensor([0, 1]))
            one = (one[0][:, None], one[1][:, None])
        outs.append((lg, mlg, X, Xm, one[0], one[1]))
    for i, n in enumerate(lens.tolist()):
        for a, b in zip(*outs):
            assert torch.equal(a[i, :n], b[i, :n])


def test_speculative_on_the_static_step_equals_plain_greedy():
    """``generate(..., speculative="mtp")`` on the static path (one static cycle per verify: chain, rollback,
    verify with the MTP block, acceptance, rollback) emits plain greedy decoding's golden ids on data/tiny-py,
    with drafts accepted and rejected; a ragged batch with per-row draft counts cut by the budget too."""
    m = dsv4lab.load(TINY_PY, max_batch=3, decode_path="static")
    o = GOLDEN["oracles"][1]
    ids = m.generate(o["prompt_ids"], len(o["expected_ids"]), speculative="mtp", draft_tokens=3)
    st = m.last_speculative_stats
    assert ids == o["expected_ids"] and 0 < st.accepted < st.drafted and st.verify_forwards == st.cycles
    oracles = GOLDEN["oracles"][:3]
    n = min(len(x["expected_ids"]) for x in oracles)
    outs, st = generate_speculative(m, [x["prompt_ids"] for x in oracles], n, 2, slots=[2, 0, 1],
                                    prefill_chunk=5)
    assert outs == [x["expected_ids"][:n] for x in oracles] and st.verify_forwards < st.cycles


@pytest.mark.parametrize("P,accepted", [(29, (0, 2)), (37, (1,))])
def test_static_rollback_restores_every_cache_byte(P, accepted):
    """Forced drafts on the static cycle (the first ``m`` true, the rest wrong) at the window fill/wrap and a
    ratio-4/16 completion (29..32), and across the ring's own wrap (39 rows: 37..40, a ratio-4 completion at 39):
    the caches of the slot equal those of a run of the accepted prefix alone."""
    r = small_model(decode_path="static")
    k = 3
    prompt = _ids(1, P, seed=8)[0].tolist()
    truth = r.generate(prompt, k + 2, stop_at_eos=False)  # plain greedy: the tokens at P, P+1, ...
    for m_true in accepted:
        dec = SpeculativeDecoder(r, k)
        dec.prefill([prompt], [0])
        wrong = [(t + 1) % r.args.vocab_size for t in truth[1 + m_true:k + 1]]
        res = dec.step([0], drafts=[truth[1:1 + m_true] + wrong])[0]
        assert res.accepted == m_true and res.tokens == truth[1:m_true + 2]
        kept = P + m_true + 1
        r.prefill([prompt + truth[:m_true + 1]], slots=[1], mtp=True, next_tokens=[truth[m_true + 1]])
        assert r.positions[0] == r.positions[1] == kept and r.mtp_positions[0] == r.mtp_positions[1] == kept
        assert all(_same(a, b) for a, b in zip(_caches(r.model, 0), _caches(r.model, 1)))


def test_step_limits_are_one_line_errors():
    m = small_model(decode_path="static")
    with pytest.raises(ValueError, match="sized for at most 8"):
        m.decoder.step.run(torch.zeros(1, 9, dtype=torch.long), torch.tensor([0]), torch.tensor([0]))
    small = small_model(decode_path="static", max_step_tokens=3)
    assert max_draft_tokens(small.model) == 2 and small.model.layers[0].attn.win_kv.shape[1] == 34
    with pytest.raises(ValueError, match=r"draft_tokens must be an integer in \[1, 2\]"):
        small.generate([5, 6], 4, speculative="mtp", draft_tokens=3)
    with pytest.raises(ValueError, match="max_step_tokens"):
        dsv4lab.load(TINY, max_batch=1, max_step_tokens=0, validate=False)
    args = get_preset("tiny").replace(n_layers=3, n_mtp_layers=0, compress_ratios=(0, 4, 16), max_seq_len=64)
    no_mtp = dsv4lab.load(RandomCheckpoint(args, seed=1), max_batch=1, decode_path="static")
    with pytest.raises(ValueError, match="no MTP block"):
        no_mtp.decoder.run(torch.tensor([[5, 6]]), torch.tensor([0]), torch.tensor([0]), mtp=True)


@pytest.mark.slow
def test_t_token_step_on_the_triton_kernels_equals_t_one_token_steps():
    """The Triton backend under the interpreter, on a 3-layer random model (SWA, CSA, HCA + MTP): a step of 3
    tokens for two sequences (6 rows, on the decode kernels) equals 3 one-token steps bit for bit — every kernel
    rounds a row the same whatever the number of rows, and the compressor kernel runs each sequence's tokens in
    order — and every op ran on a kernel."""
    m = small_model(backend="triton", decode_path="static")
    ids = _ids(2, 40, seed=3)
    starts, lens, slots = [29, 14], [3, 2], [1, 0]
    kernels, m.ops = m.ops, ReferenceOps(m.ops.numerics)
    m.prefill(ids, slots=slots, lengths=starts)  # the prompt on the reference (the state is the model's)
    m.ops = kernels
    step = StaticDecodeStep(m)
    bufs = [b for blk in m.model.blocks() for b, _ in blk.attn.ring_caches() + blk.attn.entry_caches()]
    before = [b[slots].clone() for b in bufs]
    want = _one_token_steps(step, ids, starts, lens, slots)
    want_caches = _caches(m.model, slots)
    for b, old in zip(bufs, before):
        b[slots] = old
    tokens = torch.stack([ids[i, s:s + 3] for i, s in enumerate(starts)])
    got = step.run(tokens, torch.tensor(starts), torch.tensor(slots), torch.tensor(lens))
    for i, n in enumerate(lens):
        for t in range(3):
            assert torch.equal(got.logits[i, t], want[min(t, n - 1)][i]), (i, t)
    assert all(_same(a, b) for a, b in zip(_caches(m.model, slots), want_caches))
    assert not m.ops.calls.reference, m.ops.report()


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [2, 4])
def test_gpu_graph_t_token_step_equals_the_eager_static_step(T):
    """Graph replay of the T-token step with the MTP block (batch 3 padded to tier 4, ragged lengths) against the
    same step run eagerly on the same kernels: bit for bit; and the speculative cycle's graph likewise."""
    ids = _ids(3, 80, seed=T)
    starts, lens = torch.tensor([29, 13, 61]), torch.tensor([T, 1, T - 1])
    res = []
    for graphs in (True, False):
        m = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=3, max_seq_len=96)
        dec = Decoder(m, graphs=graphs)
        m.prefill(ids, slots=[0, 1, 2], lengths=starts, mtp=True)
        tokens = torch.stack([ids[i, s:s + T] for i, s in enumerate(starts.tolist())])
        o = dec.run(tokens, starts, torch.tensor([0, 1, 2]), lens, mtp=True)
        res.append([t.clone() for t in (o.logits, o.mtp_logits, o.hidden, o.mtp_hidden)])
        if graphs:
            assert any(isinstance(k, tuple) for k in dec.graphs.capture_s), dec.graphs.capture_s
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 3])
def test_gpu_speculative_through_graphs_equals_plain_greedy(k):
    """On the GPU's graph path (one captured cycle per (tier, K)) speculative decoding emits the same backend's
    plain greedy ids, single and ragged-batched."""
    m = dsv4lab.load(TINY_PY, device="cuda", backend="triton", max_batch=3)
    assert m.decode_path == "graph"
    oracles = GOLDEN["oracles"][:3]
    plain = [m.generate(o["prompt_ids"], 16) for o in oracles]
    for o, want in zip(oracles, plain):
        assert m.generate(o["prompt_ids"], 16, speculative="mtp", draft_tokens=k) == want, o["name"]
    outs, _ = generate_speculative(m, [o["prompt_ids"] for o in oracles], 16, k, slots=[2, 0, 1])
    assert outs == plain
    assert any("speculative" in str(key) for key in m.decode_info()["captured"]), m.decode_info()
