"""The static prefill step (issue 34: prefill without host syncs, one shape per chunk bucket) against the eager
forward, chunk by chunk.

Every comparison runs the static step with its padding rows **poisoned** (NaN streams from the embedding on): a
padding row that reached a valid row's output, a cache or a compressor's ring would show as NaN or a changed byte.
After the chunks, decode steps continue each sequence, and every cache — the window rings, the compressed KV, the
indexer keys, the compressors' kv/score rings — is compared byte for byte with the eager run's (NaN included).

* the reference backend on ``data/tiny`` (SWA, CSA ratio 4 with the indexer choosing 16 of up to 35 entries, HCA
  ratio 16) at irregular chunkings, a one-token chunk among them, and one-shot; on a generated 3-layer model with an
  HCA ratio of 128 (Flash's), two of its entries completed inside chunks;
* several rows in one forward (each row's chunk its own static step), a forward longer than the widest bucket (cut
  into chunks of it), the runner's path checks and the bucket ladder;
* speculation's prefill (the MTP block along, issue 32): through the static step, equal to the eager forward's
  main and MTP logits, streams and caches (the MTP block's too), ragged rows in chunks;
* the Triton prefill kernels under the interpreter (``TritonPrefillBackend``, every op on its prefill kernel at any
  row count, so both paths take the same kernels): bit for bit on a small generated model (slow);
* on a GPU (marked ``gpu``): the graph-replayed step against the same step run eagerly, and against the eager
  per-op forward with every kernel choice pinned; after the warm-up, a chunked prompt under torch's sync check
  (``set_sync_debug_mode("error")``): no host sync.
"""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from conftest import TINY
from dsv4lab.core.config import get_preset
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.prefill_step import Prefiller, bucket_ladder, default_buckets
from dsv4lab.engine.triton_prefill import TritonPrefillBackend

GPU = torch.cuda.is_available()
# 3 layers (SWA, CSA 4, HCA 16) at small widths: the Triton interpreter runs a chunk in seconds
SMALL = get_preset("tiny").replace(
    vocab_size=512, dim=128, moe_inter_dim=64, n_layers=3, n_mtp_layers=0, n_hash_layers=1, n_heads=4, o_groups=2,
    o_lora_rank=32, q_lora_rank=64, head_dim=80, rope_head_dim=16, n_routed_experts=4, n_activated_experts=2,
    window_size=16, compress_ratios=(0, 4, 16), index_n_heads=2, index_head_dim=32, index_topk=8, max_seq_len=160)


def _ids(n: int, vocab: int, seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randint(2, vocab, (rows, n), generator=torch.Generator().manual_seed(seed))


def _poisoned(m):
    """The runner with its static step's padding rows poisoned (see the module docstring)."""
    m.prefiller.step.poison_padding = True
    return m


def _run(m, ids: torch.Tensor, chunks, decode_steps: int) -> list[torch.Tensor]:
    """Prefill ``ids`` in ``chunks`` (each forward's ``logits="last"``), then ``decode_steps`` teacher-forced steps."""
    m.reset()
    out, p = [], 0
    for c in chunks:
        out.append(m.forward(ids[:, p:p + c], p, logits="last"))
        p += c
    for _ in range(decode_steps):
        out.append(m.forward(ids[:, p:p + 1], p))
        p += 1
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def cache_state(m) -> dict[str, torch.Tensor]:
    """Every per-slot cache of every block, as raw bytes (so NaN rows compare too)."""
    out = {}
    for i, blk in enumerate(m.model.blocks()):
        a = blk.attn
        tensors = dict(win_kv=a.win_kv, ckv=a.ckv, ikv=a.ikv)
        for name, comp in (("cmp", a.compressor), ("idx_cmp", a.indexer.compressor if a.indexer else None)):
            if comp is not None:
                tensors[f"{name}.kv_ring"], tensors[f"{name}.score_ring"] = comp.kv_ring, comp.score_ring
        out.update({f"{i}.{k}": _bytes(t).clone() for k, t in tensors.items() if t is not None})
    return out


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], got_m, want_m, what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(_bytes(g), _bytes(w)), \
            f"{what}: forward {i}: max |Δ| {(g - w).abs().nan_to_num().max():.3g}"
    a, b = cache_state(got_m), cache_state(want_m)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: caches differ: {differ}"


def _pair(checkpoint, **kw):
    eager = dsv4lab.load(checkpoint, prefill_path="eager", validate=False, **kw)
    static = _poisoned(dsv4lab.load(checkpoint, prefill_path="static", validate=False, **kw))
    return eager, static


@pytest.fixture(scope="module")
def tiny_pair():
    return _pair(TINY, max_batch=2, max_seq_len=160)


# irregular chunks crossing the window (32), CSA blocks (4) and HCA blocks (16), a one-token chunk (the decode
# path) among them, the indexer choosing 16 of up to 26 entries; and the whole prompt at once
CHUNKINGS = [(21, 38, 1, 44), (104,)]


@pytest.mark.parametrize("chunks", CHUNKINGS, ids=["-".join(map(str, c)) for c in CHUNKINGS])
def test_static_prefill_equals_the_eager_forward_with_the_reference(tiny_pair, chunks):
    eager, static = tiny_pair
    ids = _ids(sum(chunks) + 3, 4096, seed=len(chunks))
    want = _run(eager, ids, chunks, decode_steps=3)
    got = _run(static, ids, chunks, decode_steps=3)
    assert_same(got, want, static, eager, f"chunks {chunks}")
    assert static.prefiller.graphs is None and set(static._prefillers) == {"static"}


def test_an_hca_ratio_of_128_fills_its_entries_inside_chunks():
    """Flash's HCA ratio: entries 0 and 1 (positions 127 and 255) complete inside chunks that start and end
    elsewhere, and the last chunk leaves a partial block."""
    args = get_preset("tiny").replace(n_layers=3, n_mtp_layers=0, n_hash_layers=1, compress_ratios=(0, 4, 128),
                                      max_seq_len=320)
    eager, static = _pair(RandomCheckpoint(args, 5), max_batch=1)
    ids = _ids(293, args.vocab_size, seed=9)
    chunks = (100, 157, 33)
    assert_same(_run(static, ids, chunks, 3), _run(eager, ids, chunks, 3), static, eager, "ratio 128")
    assert not torch.isnan(static.model.layers[2].attn.ckv[0, :2].float()).any()  # both entries written


def test_rows_of_one_forward_run_as_their_own_static_chunks(tiny_pair):
    """The server prefills admitted prompts together (right-padded, ``lengths``): each row's chunk runs the static
    step at its own bucket; a row of length 0 gets NaN and keeps its caches."""
    eager, static = tiny_pair
    ids = _ids(60, 4096, seed=3, rows=2)
    outs = []
    for m in (eager, static):
        m.reset()
        first = m.forward(ids[:, :30], 0, lengths=[30, 19], logits="last")
        m.reset([1])
        second = m.forward(ids[:, 30:55], [30, 0], lengths=[25, 0], logits="last")
        outs.append([first, second, m.forward(ids[:, 55:56], [55, 0])])
    assert torch.isnan(outs[1][1][1]).all() and not torch.isnan(outs[1][1][0]).any()
    assert_same(outs[1], outs[0], static, eager, "two rows")


def test_a_forward_longer_than_the_widest_bucket_is_cut_into_chunks_of_it(tiny_pair):
    eager, static = tiny_pair
    narrow = Prefiller(static, graphs=False, buckets=(16, 32))
    narrow.step.poison_padding = True
    static._prefillers["static"], wide = narrow, static._prefillers["static"]
    try:
        ids = _ids(75, 4096, seed=7)
        assert_same(_run(static, ids, (70,), 2), _run(eager, ids, (70,), 2), static, eager, "70 in chunks of 32")
    finally:
        static._prefillers["static"] = wide


def test_the_static_step_with_the_mtp_block_equals_the_eager_forward(tiny_pair, monkeypatch):
    """Speculation's prefill (``prefill(..., mtp=True)``) runs every chunk through the static step with the MTP block
    (counted), padding rows poisoned: the main and MTP logits, the MTP streams and every cache — the MTP block's
    window included — equal the eager forward's byte for byte; ragged rows in chunks of 23 (the 37-token row ends
    inside one), one row given its next token, the other fed the greedy choice; an MTP decode step continues both."""
    eager, static = tiny_pair
    step, chunks = static.prefiller.step, []
    monkeypatch.setattr(static.prefiller, "step", lambda tokens, meta, mtp=False: chunks.append(
        (tokens.shape[0], mtp, meta.tolist())) or step(tokens, meta, mtp))
    ids = _ids(61, 4096, seed=4, rows=2)
    outs = []
    for m in (eager, static):
        got = list(m.prefill(ids[:, :60], chunk=23, slots=[1, 0], lengths=[60, 37], mtp=True,
                             next_tokens=[int(ids[0, 60]), -1]))
        got += m.forward(torch.stack((ids[0, 60:61], ids[1, 37:38])), [60, 37], slots=[1, 0], mtp=True)
        outs.append(got)
    assert_same(outs[1], outs[0], static, eager, "the MTP block's prefill")
    # three chunks of row 0 (the first two fed the next chunk's first token), two of row 1 (its last: 14 tokens)
    assert [(c, mtp) for c, mtp, _ in chunks] == [(32, True)] * 3 + [(16, True)] * 2
    assert [meta for _, _, meta in chunks] == [[0, 23, 1, int(ids[0, 23])], [0, 23, 0, int(ids[1, 23])],
                                               [23, 23, 1, int(ids[0, 46])], [23, 14, 0, -1],
                                               [46, 14, 1, int(ids[0, 60])]]


def test_the_prefill_path_is_checked_and_auto_is_eager_on_a_cpu(tiny_pair):
    eager, static = tiny_pair
    assert dsv4lab.load(TINY, max_batch=1, max_seq_len=64).prefill_path == "eager"  # auto on a CPU
    with pytest.raises(ValueError, match="needs the model on a GPU"):
        static.prefill_path = "graph"
    with pytest.raises(ValueError, match="expected one of auto, graph, static, eager"):
        static.prefill_path = "fast"
    assert static.prefill_path == "static"


def test_the_bucket_ladder_is_multiples_of_16_at_most_one_and_a_half_apart_past_32(tiny_pair):
    ladder = bucket_ladder(16, 4096)
    assert ladder[:8] == (16, 32, 48, 64, 96, 128, 192, 256) and ladder[-2:] == (3072, 4096)
    assert all(c % 16 == 0 for c in ladder) and all(b / a <= 1.5 for a, b in zip(ladder[2:], ladder[3:]))
    assert bucket_ladder(64, 4604)[:2] == (64, 96) and bucket_ladder(64, 4604)[-1] == 6144
    assert bucket_ladder(50, 100) == (64, 96, 128)
    eager, static = tiny_pair
    assert default_buckets(static) == (16, 32, 48, 64, 96, 128, 192)  # the reference: to the cache length (160)
    pf = static.prefiller
    assert pf.bucket(1) == 16 and pf.bucket(49) == 64 and pf.bucket(999) == 192


@pytest.mark.slow
def test_static_prefill_equals_the_eager_forward_on_the_triton_prefill_kernels():
    """The same prefill kernels (``TritonPrefillBackend`` with ``min_tokens=1``: GEMMs, grouped MoE, sparse
    attention, indexer, pooling at every row count) in the same order: bit for bit under the interpreter."""
    ck = RandomCheckpoint(SMALL, 1)
    kw = dict(backend=lambda nm: TritonPrefillBackend(nm, min_tokens=1), max_batch=1)
    eager, static = _pair(ck, **kw)
    ids = _ids(40, SMALL.vocab_size, seed=2)
    chunks = (20, 13)
    got, want = _run(static, ids, chunks, 1), _run(eager, ids, chunks, 1)
    assert_same(got, want, static, eager, "triton prefill kernels")
    ran = static.ops.kernel_runs
    assert {"routed_experts", "sparse_attention", "indexer_select", "compressor_pool", "linear"} <= set(ran)


# ============================================================================================ GPU
def _pinned(nm):
    """The Triton backend with every kernel choice that could depend on the row count pinned (the prefill kernels
    at any row count, the Triton GEMMs rather than cuBLAS — whose algorithm may change with the row count —, fixed
    MoE settings, the mHC rows kernel at its default geometry rather than the tuned one-launch site)."""
    from dsv4lab.engine.triton_backend import TritonOps
    ops = TritonOps(nm)
    ops.prefill_min_tokens = 1
    ops.prefill_gemm_backend = ops.prefill_weight_gemm_backend = "triton"
    ops.prefill_moe_route, ops.prefill_moe_rows, ops.prefill_moe_tag = "bf16", 64, ""
    ops.prefill_moe_decode, ops.prefill_moe_persistent, ops.prefill_moe_scale_per_byte = "auto", False, False
    ops.prefill_mhc_rows, ops.prefill_mhc_rows_geometry = True, ""  # the rows kernel at its default geometry
    return ops


@pytest.mark.gpu
def test_graph_replayed_prefill_equals_the_static_step_run_eagerly_on_a_gpu():
    kw = dict(device="cuda", backend="triton", max_batch=2, max_seq_len=512, validate=False)
    graph = dsv4lab.load(TINY, prefill_path="graph", **kw)
    static = dsv4lab.load(TINY, prefill_path="static", **kw)
    assert graph.prefiller.graphs is not None
    ids = _ids(460, 4096, seed=11).cuda()
    chunks = (300, 37, 100, 1, 17)
    want = _run(static, ids, chunks, 3)
    got = _run(graph, ids, chunks, 3)
    assert_same(got, want, graph, static, "graph vs static")
    assert set(graph.prefiller.graphs.graphs) == {graph.prefiller.bucket(c) for c in chunks if c > 1}


@pytest.mark.gpu
def test_graph_replayed_prefill_equals_the_eager_forward_at_pinned_kernel_choices_on_a_gpu():
    kw = dict(device="cuda", backend=_pinned, max_batch=1, max_seq_len=512, validate=False)
    eager = dsv4lab.load(TINY, prefill_path="eager", **kw)
    graph = dsv4lab.load(TINY, prefill_path="graph", **kw)
    ids = _ids(420, 4096, seed=12).cuda()
    chunks = (70, 200, 33, 110)
    assert_same(_run(graph, ids, chunks, 2), _run(eager, ids, chunks, 2), graph, eager, "graph vs eager")


@pytest.mark.gpu
def test_a_warmed_up_graph_prefill_never_waits_for_the_gpu():
    """Two chunks of a prompt after the warm-up under torch's sync check set to raise: no host read-back, no
    synchronising copy (the chunk's inputs go in from pinned memory), and the second chunk's replay is issued
    while the first may still run; the logits equal those of the same chunks without the check."""
    m = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=1, max_seq_len=512, validate=False,
                     prefill_path="graph", warmup=True)
    ids = _ids(333, 4096, seed=13)  # host ids, as the server passes them
    chunks = (200, 133)
    want = _run(m, ids, chunks, 0)
    m.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [m.forward(ids[:, :200], 0, logits="last"), m.forward(ids[:, 200:], 200, logits="last")]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert m.prefiller.graphs is not None and not m.prefiller.note, m.prefiller.note
    assert all(torch.equal(_bytes(g), _bytes(w)) for g, w in zip(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["1", "0"])
@pytest.mark.parametrize("grown", [False, True])
def test_gpu_a_prefill_graph_replayed_after_the_decode_graphs_were_captured_gives_its_first_bits(pdl, grown,
                                                                                               monkeypatch):
    """The pattern behind four GPU failures at 3dac085 (``data/results/h200/logs/visit_3dac085_tests.log``): a
    prefill graph replayed after the decode step's graphs were captured — tiny-py's plain ``generate`` non-finite
    at its second prompt, the graph-vs-static chunk right after a decode step, the Flash-width speculation's first
    token. The same prompt prefilled before any decode and again after a ``generate`` (which captures the decode
    tiers): equal bit for bit, and equal to the static step run eagerly on a runner of its own. Both ways of PDL,
    and with the ticket workspace grown up front (no growth inside the test) or not. The cause, found with
    ``scripts/diag_prefill_after_decode.py`` (``data/results/h100/diag_prefill_after_decode_f3de19f.json``): the
    decode step stacked its projections when it was first built, freeing the weights that a prefill graph
    captured before had recorded; the runner now stacks them when it is built. Passed on an H100 at 9e7fb0b
    (``data/results/h100/logs/visit_9e7fb0b_tests.log``)."""
    from dsv4lab_kernels import tickets

    monkeypatch.setenv("DSV4LAB_PDL", pdl)
    if grown:
        tickets.counters(torch.device("cuda", torch.cuda.current_device()), 1 << 20)
    kw = dict(device="cuda", backend="triton", max_batch=2, max_seq_len=256, validate=False)
    graph = dsv4lab.load(TINY, prefill_path="graph", **kw)
    static = dsv4lab.load(TINY, prefill_path="static", **kw)
    a, b = _ids(7, 4096, seed=21)[0], _ids(6, 4096, seed=22)[0]
    first = graph.prefill(b)
    want = static.prefill(b)
    graph.generate(a.tolist(), 4, stop_at_eos=False)  # captures the decode tiers, replays the prefill graph
    static.generate(a.tolist(), 4, stop_at_eos=False)
    again = graph.prefill(b)
    assert torch.isfinite(again).all(), "the replay after the decode graphs is not finite"
    assert torch.equal(_bytes(again), _bytes(first)), f"replay after the decode graphs: max |Δ| " \
        f"{(again - first).abs().nan_to_num().max():.3g}"
    assert torch.equal(_bytes(first), _bytes(static.prefill(b))), "graph vs static step after the decode graphs"
    assert torch.equal(_bytes(first), _bytes(want)), "graph vs static step before the decode graphs"
