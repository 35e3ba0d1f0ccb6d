"""The indexer's causal selection (issue 18): ``indexer_select`` equals the reference's scores-then-top-k, at chunk
offsets (``start_pos > 0``) and with many ties, and its scores kernel never computes a key tile that no query of
its block may see. On a GPU, at real widths, the selection is judged by the
reference scores of what it picked (bf16 MMA scores may break near-ties differently from the exact reference).
"""
from __future__ import annotations

import pytest
import torch

from dsv4lab.core.model.indexer import select_topk
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.compare import compare, tolerance

pytest.importorskip("triton")
ap = pytest.importorskip("dsv4lab_kernels.attention_prefill")

REF = ReferenceOps(Numerics())


def _case(b, s, h, d, T, seed, device="cpu", ties=False):
    g = torch.Generator().manual_seed(seed)
    qi = torch.randn(b, s, h, d, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(b, s, h, generator=g) * 0.1).to(device, torch.bfloat16)
    keys = torch.randn(b, T, d, generator=g).to(device, torch.bfloat16)
    if ties:  # repeated keys and zero weights: many exactly equal scores, the lower index must win
        keys[:, 1::2] = keys[:, 0::2][:, : keys[:, 1::2].shape[1]]
        w[..., 0] = 0
    return qi, w, keys


@pytest.mark.parametrize("config", ["q2t64", "q2t64x8", "q4t64x8"])
def test_select_is_the_reference_at_chunk_offsets_and_with_ties(config):
    b, s, h, d, T, ratio, topk = 2, 21, 4, 64, 40, 4, 16
    qi, w, keys = _case(b, s, h, d, T, seed=1, ties=config == "q2t64")
    positions = torch.stack([torch.arange(s) * 2 + 40, torch.arange(s) * 3 + 7])  # chunks at offsets 40 and 7
    want = select_topk(REF.indexer_scores(qi, w, keys), positions, ratio, topk)
    assert torch.equal(ap.indexer_select(qi, w, keys, positions, ratio, topk, config=config), want)


def test_select_never_picks_beyond_the_key_cache_when_positions_see_more_entries_than_it_holds():
    """Queries whose positions would see more entries than ``keys`` holds (``(p+1)//ratio > T``: a cache cut short,
    the H200 real-width test's positions) pick among the ``T`` entries only — an index ≥ T is an out-of-bounds
    read downstream (it was, on the GPU, where the ReLU'd zero scores tie with the unloaded padding)."""
    b, s, h, d, T, ratio, topk = 1, 9, 4, 64, 30, 4, 48
    qi, w, keys = _case(b, s, h, d, T, seed=4)
    positions = (torch.arange(s) * 13 + 100)[None]  # sees 25 … 51 entries of 30
    got = ap.indexer_select(qi, w, keys, positions, ratio, topk)
    assert int(got.max()) < T
    assert torch.equal(got, REF.indexer_select(qi, w, keys, positions, ratio, topk))


def test_causal_scores_skip_the_keys_no_query_of_a_block_sees():
    b, s, h, d, T, ratio = 1, 12, 4, 64, 80, 4
    qi, w, keys = _case(b, s, h, d, T, seed=2)
    positions = (torch.arange(s) * 6 + 5)[None]  # block of 8 queries sees < 12 entries, the next < 18
    out = torch.full((b, s, T), float("nan"), dtype=torch.bfloat16)
    ap._indexer_launch(qi, w, keys, positions, ratio, True, 8, 16, 1, 4, out=out)
    ref = REF.indexer_scores(qi, w, keys)
    for q0 in (0, 8):
        rows = slice(q0, q0 + 8)
        seen = int(((positions[0, rows] + 1) // ratio).max())
        assert torch.equal(out[0, rows, :seen], ref[0, rows, :seen])
        assert out[0, rows, seen:].isnan().all(), "a key no query of the block may see was scored"


def test_select_through_the_op_and_the_backend_counts_it():
    from dsv4lab.engine.triton_prefill import TritonPrefillBackend
    qi, w, keys = _case(1, 9, 4, 64, 30, seed=3)
    positions = (torch.arange(9) * 13 + 2)[None]  # from nothing visible to every entry
    ops = TritonPrefillBackend(Numerics(), min_tokens=1)
    got = ops.indexer_select(qi, w, keys, positions, 4, 16)
    assert ops.kernel_runs["indexer_select"] == 1 and ops.fallbacks["indexer_select"] == 0
    assert torch.equal(got, REF.indexer_select(qi, w, keys, positions, 4, 16))
    assert (got[0, 0] == -1).all()  # position 2: no completed entry yet


@pytest.mark.gpu
def test_gpu_select_at_real_widths_picks_the_reference_scores():
    dev = "cuda"
    qi, w, keys = _case(1, 257, 64, 128, 1151, seed=5, device=dev)
    positions = (torch.arange(257, device=dev) * 17 + 300)[None]
    scores = REF.indexer_scores(qi, w, keys)
    want = REF.indexer_topk(scores, positions, 4, 512)
    for config in ap.INDEXER_CONFIGS:
        got = ap.indexer_select(qi, w, keys, positions, 4, 512, config=config)
        picked = [torch.where(sel >= 0, torch.gather(scores.float(), -1, sel.clamp_min(0)), float("-inf"))
                  .sort(-1, descending=True).values for sel in (got, want)]
        c = compare(f"select {config}", picked[0], picked[1], tolerance(torch.bfloat16, "attention"))
        assert c.ok, c.line()
        assert (got >= 0).sum() == (want >= 0).sum()


# ------------------------------------------------------------------------------------------ top-k in tiles
def _topk_case(b, s, T, seed, device="cpu"):
    """Scores with many exact ties and signed zeros; NaN past each row's visible entries (never read); positions
    from nothing visible to past the end of the row."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randint(-40, 41, (b, s, T), generator=g).float() * 0.25).to(torch.bfloat16)
    scores[:, :, ::5] = -0.0
    positions = torch.linspace(2, 4 * T + 40, s).round().long().expand(b, -1).contiguous()
    visible = ((positions + 1) // 4).clamp(max=T)
    t = torch.arange(T)
    scores = torch.where(t[None, None, :] < visible[..., None], scores, torch.full_like(scores, float("nan")))
    return scores.to(device), positions.to(device)


@pytest.mark.parametrize("T,topk", [(300, 16), (200, 64)])
def test_topk_in_tiles_is_one_sort_of_the_row(T, topk):
    """The running top-KP over tiles of the row gives the reference's selection: rows of many tiles, a width that
    is not a multiple of the tile, every visible count from none to all. (The interpreter sorts int64 keys slowly:
    long rows and Flash's top-512 are the GPU test's.)"""
    scores, positions = _topk_case(1, 3, T, seed=T + topk)
    got = ap.indexer_topk(scores, positions, 4, topk, rows_per_program=4)  # one program, one row of padding
    assert torch.equal(got, select_topk(scores, positions, 4, topk))
    assert (got[0, 0] == -1).all() and (got[0, -1] >= 0).all()  # nothing visible; everything visible


@pytest.mark.gpu
def test_gpu_topk_is_one_kernel_for_every_context():
    """At Flash's top-512, rows of 700 to 16,384 entries: the reference's selection each time, and one compiled
    kernel for all of them (the one-sort kernel compiled per power of two of the row: 20–75 s at long contexts)."""
    ap._topk_kernel.device_caches.clear()
    for T in (700, 1151, 2048, 4096, 9000, 16384):
        scores, positions = _topk_case(1, 37, T, seed=T, device="cuda")
        got = ap.indexer_topk(scores, positions, 4, 512)
        assert torch.equal(got, select_topk(scores, positions, 4, 512)), T
    kernel_cache = ap._topk_kernel.device_caches[torch.cuda.current_device()][0]
    assert len(kernel_cache) == 1, f"{len(kernel_cache)} variants of the top-k kernel compiled"
