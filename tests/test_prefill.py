"""``ModelRunner.prefill``: the engine's one prefill loop (chunks, ragged prompts, the MTP block along)."""
from __future__ import annotations

import pytest
import torch

from conftest import load_tiny


def _ids(rows: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 4096, (rows, n), generator=torch.Generator().manual_seed(seed))


def test_chunked_ragged_prefill_equals_one_forward_per_row_bit_for_bit():
    """Prompts of 23, 9 and 17 tokens in slots 2, 0, 1, prefilled in chunks of 8 (a row that ends inside a chunk,
    rows that drop out of later chunks): every position's logits, each row's last-token logits, the MTP logits
    and streams equal those of one plain forward per row; the slots hold the prompts' lengths after it."""
    m = load_tiny(max_batch=3)
    ids, lens, slots = _ids(3, 23, seed=1), [23, 9, 17], [2, 0, 1]
    ids[1, 9:] = 7  # padding the loop must never feed
    want = []
    for r, (n, s) in enumerate(zip(lens, slots)):
        m.reset()
        lg, mlg, _, Xm = m.forward(ids[r:r + 1, :n], 0, slots=[s], mtp=True, return_hidden=True)
        want.append((lg[0], mlg[0], Xm[0, -1]))
    every = m.prefill(ids, chunk=8, slots=slots, lengths=lens, logits="all")
    assert m.positions.tolist() == [9, 17, 23]
    last, mtp_last, streams = m.prefill(ids, chunk=8, slots=slots, lengths=lens, mtp=True)
    for r, (lg, mlg, xm) in enumerate(want):
        n = lens[r]
        assert torch.equal(every[r, :n], lg) and torch.isnan(every[r, n:]).all()
        assert torch.equal(last[r], lg[-1]) and torch.equal(mtp_last[r], mlg[-1]) and torch.equal(streams[r], xm)
    assert m.mtp_positions.tolist() == [9, 17, 23]


def test_prefill_feeds_the_given_next_token_to_the_last_mtp_position():
    m = load_tiny(max_batch=1)
    ids = _ids(1, 12, seed=2)
    m.reset()
    _, want = m.forward(ids[:, :11], 0, mtp=True, next_tokens=[int(ids[0, 11])])
    _, got, _ = m.prefill(ids[:, :11], chunk=4, mtp=True, next_tokens=[int(ids[0, 11])], logits="all")
    assert torch.equal(got, want)


def test_prefill_refuses_bad_arguments():
    m = load_tiny(max_batch=2)
    with pytest.raises(ValueError, match="chunk must be"):
        m.prefill([5, 6], chunk=0)
    with pytest.raises(ValueError, match="lengths must be within"):
        m.prefill([[5, 6]], lengths=[0])
    with pytest.raises(ValueError, match="logits must be"):
        m.prefill([5, 6], logits="first")
