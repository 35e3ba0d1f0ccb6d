"""``ModelRunner.decode_greedy``: the engine's decode loop, the host reading each step's ids one step behind the GPU.

* It chooses what a step-by-step ``forward`` + argmax loop chooses, on every decode path, rows in any slots, and
  leaves the slots' positions where that loop does.
* **Running one step past a stop.** The step after the one that chose the stop token is launched before the host
  reads the stop; it writes that token's cache rows at the slot's next position. The claim that makes this safe —
  the next token fed at that position rewrites every row that write touched, and no later position reads what it
  replaced — is checked directly: a stray token written at position ``p`` (window ring wrapped, a CSA ratio-4 entry
  completed, an HCA ratio-16 entry completed), then the real tokens from ``p`` on, gives the same logits, bit for
  bit, as never writing it — by the static step, and by the eager forward (the loop is the same on every path:
  :class:`~dsv4lab.engine.batch_loop.BatchLoop`, whose ``finish`` puts the slot's position back).
"""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from conftest import TINY


def _ids(n: int, rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 4096, (rows, n), generator=torch.Generator().manual_seed(seed))


def _forward_loop(m, first: torch.Tensor, steps: int, slots: list[int], start: list[int]) -> list[list[int]]:
    """The loop ``decode_greedy`` replaces: one forward and one host read per step."""
    out = [[] for _ in slots]
    nxt = first
    for i in range(steps):
        nxt = m.forward(nxt[:, None], torch.tensor(start) + i, slots=slots)[:, -1].argmax(-1).cpu()
        for r, t in enumerate(nxt.tolist()):
            out[r].append(t)
    return out


@pytest.mark.parametrize("path", ["eager", "static"])
def test_decode_greedy_chooses_what_the_forward_loop_chooses(path):
    ids = _ids(30, rows=2, seed=3)
    runs = {}
    for way in ("loop", "greedy"):
        m = dsv4lab.load(TINY, max_batch=3, max_seq_len=96, decode_path=path)
        logits = m.forward(ids, 0, slots=[2, 0], lengths=[30, 19], logits="last")
        first = logits[:, -1].argmax(-1)
        heard: list[list[int]] = []
        if way == "loop":
            out = _forward_loop(m, first, 40, [2, 0], [30, 19])
        else:
            out = m.decode_greedy(first, 40, slots=[2, 0], on_tokens=heard.append)
            assert [list(s) for s in zip(*out)] == heard  # on_tokens hears every step's row ids, in order
        runs[way] = (out, m.positions.tolist())
    assert runs["greedy"] == runs["loop"]
    assert runs["greedy"][1] == [59, 0, 70]  # each slot advanced by the 40 tokens fed


def _stray_write_then_continue(ids: torch.Tensor, prompt: int, stray_at: int, end: int,
                               path: str = "static") -> list[torch.Tensor]:
    """Prefill ``ids[:prompt]``, decode the real ids one by one to ``end``; when ``stray_at`` is set, first write a
    stray token at that position without advancing the slot (what a step run past a stop leaves): through the
    static step, or on the eager path a forward whose advance is taken back (what ``BatchLoop.finish`` does), so
    the real token fed there next overwrites it."""
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=end + 8, decode_path=path)
    m.forward(ids[:, :prompt], 0)
    logits = []
    for p in range(prompt, end):
        if p == stray_at and path == "static":
            m.decoder.step(torch.tensor([7]), torch.tensor([p]), torch.tensor([0]))  # positions untouched
        elif p == stray_at:
            m.forward(torch.tensor([[7]]), p)
            m.positions[0] = p
        logits.append(m.forward(ids[:, p:p + 1], p))
    return logits


# the stray write's position: wrapping the ring (window 32); completing a ratio-4 entry (the CSA compressor and the
# indexer's keys); completing a ratio-16 entry (HCA; also a ratio-4 one, and the ring wrapped); later, the top-k
# choosing 16 of 20 entries
@pytest.mark.parametrize("stray_at, path", [(37, "static"), (43, "static"), (47, "static"), (79, "static"),
                                            (47, "eager")])
def test_a_step_past_the_stop_is_overwritten_exactly(stray_at, path):
    ids = _ids(stray_at + 24, seed=stray_at)
    # on to the next ratio-16 completion: every later position that could read what the stray write replaced
    prompt, end = stray_at - 3, stray_at + 20
    clean = _stray_write_then_continue(ids, prompt, None, end, path)
    stray = _stray_write_then_continue(ids, prompt, stray_at, end, path)
    for i, (s, c) in enumerate(zip(stray, clean)):
        assert torch.equal(s, c), f"position {prompt + i}: max |Δ| {(s - c).abs().max():.3g}"


@pytest.mark.parametrize("path", ["eager", "static"])
def test_decode_greedy_stops_at_the_stop_token_and_counts_what_it_fed(path):
    ids = _ids(26, seed=11)
    ref = dsv4lab.load(TINY, max_batch=1, max_seq_len=96, decode_path=path)
    first = ref.forward(ids, 0, logits="last")[:, -1].argmax(-1)
    free = ref.decode_greedy(first, 30)[0]
    j = next(i for i in range(6, 30) if free[i] not in free[:i])  # a stop token first chosen at step j
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=96, decode_path=path)
    m.forward(ids, 0, logits="last")
    got = m.decode_greedy(first, 30, stop_token=free[j])[0]
    assert got == free[:j + 1]
    assert int(m.positions[0]) == 26 + j + 1  # the first token and the j chosen before the stop
    # continuing the stopped sequence (one step was run past its stop) equals continuing the free run's
    assert torch.equal(m.forward(torch.tensor([[5]]), 26 + j + 1), _continue(ids, first, j, 5, path))


def _continue(ids, first, j, token, path):
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=96, decode_path=path)
    m.forward(ids, 0, logits="last")
    m.decode_greedy(first, j + 1)
    return m.forward(torch.tensor([[token]]), 26 + j + 1)


def test_decode_greedy_rejects_bad_arguments():
    m = dsv4lab.load(TINY, max_batch=2, max_seq_len=40, decode_path="static")
    with pytest.raises(ValueError, match="token ids must be in"):
        m.decode_greedy([4096], 3)
    with pytest.raises(ValueError, match="distinct"):
        m.decode_greedy([3, 4], 3, slots=[1, 1])
    with pytest.raises(ValueError, match="max_seq_len=40"):
        m.decode_greedy([3], 41)
    with pytest.raises(ValueError, match="steps must be"):
        m.decode_greedy([3], 0)


@pytest.mark.gpu
def test_gpu_decode_greedy_through_the_graphs_equals_the_forward_loop():
    """The graph path: inputs copied on the device, the host a step behind — the same ids as replaying with a host
    read per step, and the slots' positions where that loop leaves them."""
    ids = _ids(40, rows=3, seed=4)
    runs = {}
    for way in ("loop", "greedy"):
        m = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=4, max_seq_len=128)
        assert m.decode_path == "graph"
        first = m.forward(ids, 0, slots=[3, 0, 1], lengths=[40, 33, 9], logits="last")[:, -1].argmax(-1).cpu()
        out = (_forward_loop(m, first, 50, [3, 0, 1], [40, 33, 9]) if way == "loop"
               else m.decode_greedy(first, 50, slots=[3, 0, 1]))
        runs[way] = (out, m.positions.tolist())
    assert runs["greedy"] == runs["loop"]
