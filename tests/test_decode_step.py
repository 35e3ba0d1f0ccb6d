"""The engine's decode path (issue 17): the static decode step at every context, the multiple-of-the-HCA-ratio
crash, the runner's decode paths, and the step's kernel launches.

* **Every context class**, on the tiny model (window 32, CSA ratio 4 with top-16, HCA ratio 16): teacher-forced
  decode steps after prompts inside the window, across it, ending exactly on a ratio-4 boundary, ending exactly on
  a ratio-16 boundary with the caches sized to a ``max_seq_len`` that leaves a partial last HCA block (the crash
  below), and long (75 CSA entries, the top-k choosing). The static step through the reference ops equals the eager
  reference decode **bit for bit**; through the Triton kernels (interpreter) it matches to fp32 summation order.
* **The crash** (H200, 4-layer cut: graph replay after a prompt of 256/384/512/1024 tokens hit ``IndexKernel.cu:
  index out of bounds``): the static step gathered the candidate compressed-cache row ``p // r`` of every token and
  wrote it back through ``torch.where``, even for a block that is not complete; after a prompt whose length is a
  multiple of the ratio the next token starts block ``L/r``, which has no row when ``max_seq_len < (L/r + 1)·r``
  (the benchmark sized the caches to the prompt plus a few tokens). The fused ``compressor_step`` touches the cache
  only when the token completes its block (which implies the row exists) and the reference composition reads a
  clamped row. Reproduced on the CPU (an ``IndexError`` there) with the tiny model's ratio 16.
"""
from __future__ import annotations

import pytest
import torch

import dsv4lab
from conftest import TINY, calibrated_max_kl
from dsv4lab.engine.decode_graph import Decoder, StaticDecodeStep, tiers_for
from dsv4lab.engine.decode_groups import group_of
from dsv4lab.engine.dispatch import INTERPRETER_DEFAULTS, SCHEMA, Dispatch, Tuned
from dsv4lab.engine.kernel_families import FUSION_NAMES
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.verify.model import kl_per_position

GPU = torch.cuda.is_available()


def _ids(n: int, rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 4096, (rows, n), generator=torch.Generator().manual_seed(seed))


def _teacher_forced(m, ids: torch.Tensor, prompt: int, steps: int, slots=(0,)) -> list[torch.Tensor]:
    """Prefill ``ids[:, :prompt]`` (eager), then ``steps`` one-token forwards of the next ids (the runner's path)."""
    m.reset()
    m.forward(ids[:, :prompt], 0, slots=list(slots))
    return [m.forward(ids[:, prompt + i:prompt + i + 1], prompt + i, slots=list(slots)) for i in range(steps)]


# (prompt length, decode steps, max_seq_len): inside the window; across it; ending on a ratio-4 boundary; ending on
# the ratio-16 boundary with a partial last HCA block (the crash); long, the indexer choosing 16 of 75 entries
CONTEXTS = [(20, 6, 64), (40, 6, 64), (44, 6, 64), (64, 8, 72), (300, 6, 312)]


@pytest.mark.parametrize("prompt,steps,max_len", CONTEXTS, ids=[f"prompt{c[0]}" for c in CONTEXTS])
def test_static_step_equals_reference_decode_at_every_context(prompt, steps, max_len):
    ids = _ids(prompt + steps, seed=prompt)
    eager = dsv4lab.load(TINY, max_batch=1, max_seq_len=max_len)
    static = dsv4lab.load(TINY, max_batch=1, max_seq_len=max_len, decode_path="static")
    want = _teacher_forced(eager, ids, prompt, steps)
    got = _teacher_forced(static, ids, prompt, steps)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i} after a {prompt}-token prompt: max |Δ| {(g - w).abs().max():.3g}"


@pytest.mark.parametrize("prompt", [12, 20, 31])
def test_young_window_is_listed_oldest_first_like_the_reference(prompt):
    """A window wider than the attention's online-softmax block (Flash: 128 rows, blocks of 64): before the sequence
    fills it, the reference lists positions ``0 … p`` first and the unfilled slots (−1) after them, and which block a
    row falls in decides its probability's rounding. The static step listed the −1 first (a real difference, seen
    only while ``p < W − 1``); with blocks of 8 over the tiny model's window of 32 the two paths must agree bit for
    bit at every young position."""
    from dsv4lab.core.model.numerics import Numerics
    nm = Numerics(attention_block=8)
    ids = _ids(prompt + 2, seed=prompt)
    outs = []
    for path in ("eager", "static"):
        m = dsv4lab.load(TINY, max_batch=1, max_seq_len=64, backend=lambda _: ReferenceOps(nm), decode_path=path)
        m.forward(ids[:, :prompt], 0)
        outs.append([m.forward(ids[:, p:p + 1], p) for p in (prompt, prompt + 1)])
    for got, want in zip(outs[1], outs[0]):
        assert torch.equal(got, want), f"after {prompt} tokens: max |Δ| {(got - want).abs().max():.3g}"


def test_the_multiple_of_ratio_crash_is_fixed_and_pinned():
    """The reproduction: 64 = 4 × 16 prompt tokens, caches for 72 positions (4 HCA rows), then decode."""
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=72, decode_path="static")
    assert m.model.layers[2].attn.ckv.shape[1] == 4 and m.model.layers[2].attn.ratio == 16
    ids = _ids(72, seed=3)
    m.forward(ids[:, :64], 0)
    before = m.model.layers[2].attn.ckv.float().nan_to_num(7.0)
    # the candidate block 64 // 16 = 4 has no cache row: before the fix this raised IndexError (a device assert)
    step = StaticDecodeStep(m)
    for p in range(64, 72):  # up to the last position max_seq_len holds
        assert torch.isfinite(step(ids[0, p:p + 1], torch.tensor([p]), torch.tensor([0]))).all()
    # no entry is written for the partial block, and the complete ones are left as they were
    assert torch.equal(m.model.layers[2].attn.ckv.float().nan_to_num(7.0), before)


def test_ragged_rows_and_reused_slots_on_the_static_path():
    """Two rows at different positions in non-adjacent slots, then one row reset and restarted: the runner's static
    path equals the eager one bit for bit (its bookkeeping of positions included)."""
    ids = _ids(40, rows=2, seed=5)
    runs = {}
    for path in ("eager", "static"):
        m = dsv4lab.load(TINY, max_batch=3, max_seq_len=64, decode_path=path)
        m.forward(ids[:, :30], 0, slots=[2, 0], lengths=[30, 17])
        out = [m.forward(ids[:, 30:31], torch.tensor([30, 17]), slots=[2, 0])]
        m.reset([0])
        m.forward(ids[1:, :5], 0, slots=[0])
        out.append(m.forward(torch.stack((ids[0, 31:32], ids[1, 5:6])), torch.tensor([31, 5]), slots=[2, 0]))
        runs[path] = (out, m.positions.tolist())
    assert runs["eager"][1] == runs["static"][1] == [6, 0, 32]
    assert all(torch.equal(a, b) for a, b in zip(runs["eager"][0], runs["static"][0]))


def test_generate_through_the_static_path_reproduces_the_eager_trajectory():
    eager = dsv4lab.load(TINY, max_batch=1)
    static = dsv4lab.load(TINY, max_batch=1, decode_path="static")
    prompt = _ids(23, seed=9)[0].tolist()
    assert static.generate(prompt, 12, stop_at_eos=False) == eager.generate(prompt, 12, stop_at_eos=False)
    assert static.decode_info()["path"] == "static" and eager.decode_info()["path"] == "eager"


def test_decode_path_choices_and_errors():
    m = dsv4lab.load(TINY, max_batch=2)
    assert m.decode_path == ("graph" if GPU and m.backend == "triton" else "eager")
    with pytest.raises(ValueError, match="decode_path 'fast'"):
        m.decode_path = "fast"
    if not GPU:
        with pytest.raises(ValueError, match="needs the model on a GPU"):
            m.decode_path = "graph"
    assert m.spare_slot == 2 and m.model.layers[0].attn.win_kv.shape[0] == 3  # one spare slot beside the two
    assert tiers_for(2) == (1, 2) and tiers_for(3) == (1, 2, 4) and tiers_for(20) == (1, 2, 4, 8, 16, 32)
    step = Decoder(m, graphs=False)
    with pytest.raises(ValueError, match="distinct"):
        step.decode([1, 2], [0, 0])


@pytest.mark.slow
def test_fused_static_step_on_the_triton_kernels(capsys, layer_cut):
    """The static step on the Triton backend (interpreter) after ragged prompts ending on the ratio-16 boundary
    (partial last HCA block) and inside a CSA block: every op runs a kernel (none falls back to the reference),
    the logits match the reference decode to fp32 summation order with the same greedy tokens; the
    kernel launches of the step are counted (printed: what a GPU graph of the model holds, split-K sums aside —
    counted on a second call at the same position, as a graph is captured after an eager step: the first call
    also fills the backend's one-time caches, the grouped projections' weights and the expert banks' views).
    On the first three layers of the tiny model (SWA, CSA, HCA, same widths; ``layer_cut``): the interpreter's
    cost is per layer."""
    from dsv4lab.tools.bench.e2e import count_launches
    ids = _ids(70, rows=2, seed=11)
    lens = [64, 47]
    cut = layer_cut("tiny")
    ref = dsv4lab.load(cut, max_batch=2, max_seq_len=72)
    tri = dsv4lab.load(cut, max_batch=2, max_seq_len=72, backend="triton", decode_path="static")
    kernels, tri.ops = tri.ops, ReferenceOps(tri.ops.numerics)  # prefill on the reference (state is the model's)
    for m in (ref, tri):
        m.forward(ids[:, :64], 0, slots=[0, 1], lengths=lens)
    tri.ops = kernels
    pos = torch.tensor(lens)
    tok = ids[torch.arange(2), pos]
    want = ref.forward(tok[:, None], pos, slots=[0, 1])[:, 0]
    step = StaticDecodeStep(tri)
    first, _ = count_launches(lambda: step(tok, pos, torch.tensor([0, 1])))
    counts, got = count_launches(lambda: step(tok, pos, torch.tensor([0, 1])))  # rewrites the same state
    assert counts["triton"] == first["triton"] and counts["torch"] < first["torch"]  # the caches are one-time
    # counted without computing (scripts/count_decode_launches.py at Flash widths): the same launches, and no state
    # written (every write of the step is a kernel's, skipped)
    dry, _ = count_launches(lambda: step(tok, pos, torch.tensor([0, 1])), execute=False)
    assert (dry["triton_kernels"], dry["torch_ops"]) == (counts["triton_kernels"], counts["torch_ops"])
    rel = float((got - want).norm() / want.norm())
    assert rel < 1e-5, rel
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not tri.ops.calls.reference, tri.ops.report()  # every op of the step ran on a kernel
    layers = tri.args.n_layers
    # the interpreter's default runs every fused path (kernel_families.FUSIONS); turned off, the same bits from
    # the unfused launches: moe_site's two per layer but the last, attention_norms' and shared_swiglu's one per
    # layer, query_heads' and compressor_pair's one each per layer with an indexer, x_projections' below (greedy
    # is not part of the step's logits)
    tri.ops.config = Dispatch(Tuned(dict(schema=SCHEMA, gpu="interpreter", sources={"t": {}}, ops={"decode.fusion": [
        dict(rows=64, source="t", choice={n: False for n in FUSION_NAMES})]}), "off.json"), INTERPRETER_DEFAULTS)
    unfused_counts, unfused = count_launches(lambda: step(tok, pos, torch.tensor([0, 1])))
    assert torch.equal(got, unfused), f"max |Δ| {(got - unfused).abs().max():.3g}"
    with_indexer = sum(blk.attn.indexer is not None for blk in tri.model.layers)
    # x_projections: one launch for the attention input's projections (q/KV — two where tiny's widths leave them
    # unstacked —, the compressors' group, the indexer's head weights)
    jobs = [(1 if group_of((b.attn.wq_a, b.attn.wkv)) else 2) + (b.attn.compressor is not None)
            + (b.attn.indexer is not None) for b in tri.model.layers]
    # ... and the MoE input's (the router logits, the shared expert's w1/w3)
    jobs += [1 + (1 if group_of((b.ffn.shared_experts.w1, b.ffn.shared_experts.w3)) else 2) for b in tri.model.layers]
    saved = 2 * (layers - 1) + 2 * layers + 2 * with_indexer + sum(j - 1 for j in jobs)
    assert unfused_counts["triton"] - counts["triton"] == saved, (unfused_counts, counts)
    with capsys.disabled():
        print(f"\n[decode step, tiny's first 3 layers, b=2] first call: {first['triton']} Triton launches + "
              f"{first['torch']} torch ops; second: {counts['triton']} Triton launches + {counts['torch']} torch ops "
              f"= {(counts['triton'] + counts['torch']) / layers:.1f} per layer ({layers} layers: SWA, CSA, HCA, "
              f"+ embedding and head); "
              f"Triton: {dict(counts['triton_kernels'].most_common())}; torch: {dict(counts['torch_ops'])}")
    assert counts["triton"] > 0


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("prompt,steps,max_len", CONTEXTS, ids=[f"prompt{c[0]}" for c in CONTEXTS])
def test_gpu_graph_replay_equals_eager_step_and_reference(prompt, steps, max_len):
    """On the GPU: the runner's graph path (tiers, batch 3 padded to 4) against the eager static step on the same
    kernels (bit for bit: the property graphs must have), and against the reference decode as a gross-error guard
    at every context class: each row's KL within the per-position bound of ``verify model``'s calibrated rule for
    ``data/tiny`` (4× its rounding floor's max; on this random checkpoint a rounding-only change of the reference
    moves single positions by KL 0.3, so relative logit distances say nothing here). The precision of each kernel
    against the reference is the stage tier's subject (``dsv4lab verify model --backend triton``)."""
    ids = _ids(prompt + steps, rows=3, seed=prompt)
    graph = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=3, max_seq_len=max_len)
    static = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=3, max_seq_len=max_len,
                          decode_path="static")
    ref = dsv4lab.load(TINY, device="cuda", max_batch=3, max_seq_len=max_len)
    assert graph.decode_path == "graph"
    slots = (0, 1, 2)
    g = _teacher_forced(graph, ids, prompt, steps, slots)
    s = _teacher_forced(static, ids, prompt, steps, slots)
    r = _teacher_forced(ref, ids, prompt, steps, slots)
    assert graph.decode_info()["captured"], graph.decode_info()
    bound = calibrated_max_kl("tiny")
    for i in range(steps):
        assert torch.equal(g[i], s[i]), f"step {i}: graph replay differs from the eager step"
        kl = kl_per_position(r[i].reshape(-1, r[i].shape[-1]).float(), g[i].reshape(-1, g[i].shape[-1]).float())
        assert max(kl) <= bound, f"step {i}: KL per row {[round(k, 4) for k in kl]} from the reference (≤ {bound:.3g})"
