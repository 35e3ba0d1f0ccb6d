"""Tensor and expert parallelism (issue 11): sharding plans, rank layouts, TP/EP generation equal to one process,
loaded bytes, collective counts, and the peer-read all-reduce kernel against the rank-ordered sum.

The multi-process tests use gloo on the CPU with 2 ranks (3 for one kernel case); the peer-read kernel runs in
Triton's interpreter with one process per rank sharing memory, exactly as GPUs share symmetric memory.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY, once_per_run
from dsv4lab.core.checkpoint import Checkpoint, expected_tensors
from dsv4lab.engine.collectives import CountingAllReduce, LibraryAllReduce, SizeSwitchAllReduce, make_all_reduce
from dsv4lab.core.config import get_preset
from dsv4lab.engine.sampling import finish_reason
from dsv4lab.engine.parallel import Layout, ParallelError, ParallelPlan, check_split, run_parallel

PROMPT = [5, 6, 7, 8, 9]
NEW_TOKENS = 12


def _tiny_shapes():
    ck = Checkpoint(TINY)
    return ck, {n: tuple(i.shape) for n, i in ck.tensors.items()}


# ============================================================================================ layouts and plans
def test_layout_groups():
    mesh = Layout(world=4, rank=3, tp=2, ep=2)
    assert mesh.tp_groups() == [[0, 1], [2, 3]] and mesh.ep_groups() == [[0, 2], [1, 3]]
    assert (mesh.tp_rank, mesh.ep_rank) == (1, 1)
    same = Layout(world=2, rank=1, tp=2, ep=2)  # DeepSeek's scheme: both over the same ranks
    assert same.tp_groups() == same.ep_groups() == [[0, 1]] and (same.tp_rank, same.ep_rank) == (1, 1)
    wide = Layout(world=4, rank=2, tp=2, ep=4)
    assert wide.ep_groups() == [[0, 1, 2, 3]] and wide.ep_rank == 2 and wide.tp_rank == 0
    with pytest.raises(ParallelError, match="divide the number of ranks"):
        Layout(world=2, rank=0, tp=4)
    with pytest.raises(ParallelError, match="repeat"):
        Layout(world=4, rank=0, tp=2, ep=1)


def test_split_errors_name_the_field():
    tiny = Checkpoint(TINY).args
    with pytest.raises(ParallelError, match="n_heads=8"):
        check_split(tiny, 3, 1)
    with pytest.raises(ParallelError, match="n_routed_experts=16"):
        check_split(tiny, 1, 3)
    # tiny: 768 wq_b rows / 4 = 192 per rank, which cuts a 128-row FP8 scale block
    _, shapes = _tiny_shapes()
    with pytest.raises(ParallelError, match=r"attn\.wq_b\.weight: 768 rows split 4 ways is 192 per rank"):
        ParallelPlan(tiny, Layout(4, 0, 4, 1), shapes)


@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 4), (8, 8), (8, 1), (1, 8)])
def test_real_model_splits_on_block_boundaries(tp, ep):
    args = get_preset("flash")
    shapes = {s.name: tuple(s.shape) for s in expected_tensors(args)}
    world = max(tp, ep)
    plan = ParallelPlan(args, Layout(world, world - 1, tp, ep), shapes)
    if tp > 1:
        assert plan._slices["layers.7.attn.wq_b.weight"] == (0, 32768 - 32768 // tp, 32768)
        assert plan._slices["layers.7.attn.wo_b.scale"] == (1, 64 - 64 // tp, 64)  # 8192 columns in 128-blocks
    assert plan.expert_offset == 256 - 256 // ep


def test_rank_slices_tile_every_split_tensor():
    """Concatenating the ranks' slices gives back the whole tensor, for every tensor TP2 splits."""
    ck, shapes = _tiny_shapes()
    plans = [ParallelPlan(ck.args, Layout(2, r, 2, 1), shapes) for r in range(2)]
    split = sorted(plans[0]._slices)
    kinds = {n.split(".", 2)[-1] for n in split}
    assert {"attn.wq_b.weight", "attn.wq_b.scale", "attn.wo_a.weight", "attn.wo_a.scale", "attn.attn_sink",
            "attn.wo_b.weight", "attn.wo_b.scale", "attn.indexer.wq_b.weight", "attn.indexer.wq_b.scale",
            "attn.indexer.weights_proj.weight"} <= kinds
    assert not any("compressor" in n or "wq_a" in n or "wkv" in n or "shared" in n for n in split)
    for name in split:
        parts = [ck.get_slice(name, *p._slices[name]) for p in plans]
        dim = plans[0]._slices[name][0]
        whole = ck.get(name)
        assert torch.equal(torch.cat(parts, dim).view(torch.uint8), whole.view(torch.uint8)), name


# ============================================================================================ collectives
def test_strategy_choice_on_cpu():
    assert isinstance(make_all_reduce("auto", None, "cpu"), LibraryAllReduce)
    with pytest.raises(ValueError, match="needs GPUs"):
        make_all_reduce("peer_read", None, "cpu")
    with pytest.raises(ValueError, match="unknown all-reduce strategy"):
        make_all_reduce("ring", None, "cpu")
    # the size switch: small messages to the peer-read path (under "auto" only while capturing a CUDA graph)
    class Small:
        def fits(self, t):
            return t.numel() <= 4

        def __call__(self, t):
            return t + 1
    small, large = torch.zeros(4), torch.zeros(5)
    assert SizeSwitchAllReduce(Small(), lambda t: t - 1)(small).eq(1).all()
    assert SizeSwitchAllReduce(Small(), lambda t: t - 1)(large).eq(-1).all()
    assert SizeSwitchAllReduce(Small(), lambda t: t - 1, graphs_only=True)(small).eq(-1).all()  # not capturing
    counted = CountingAllReduce(lambda t: t * 2)
    assert torch.equal(counted(torch.ones(3, dtype=torch.float64)), torch.full((3,), 2.0, dtype=torch.float64))
    assert (counted.calls, counted.bytes) == (1, 24)


# ============================================================================================ TP/EP generation
LAYOUTS = [(2, 1), (1, 2)]  # TP2, EP2 (both at once, DeepSeek's scheme, is the torchrun CLI test below)


def _generate_ranks(rank, world, checkpoint, layouts, bench_out):
    from dsv4lab.engine.sampling import trajectory_hash
    from dsv4lab.engine.parallel import load_parallel
    from dsv4lab.tools.bench import collectives as bench_collectives
    ck = Checkpoint(checkpoint)
    out = []
    for tp, ep in layouts:
        runner, _ = load_parallel(checkpoint, tp=tp, ep=ep, collective="auto", verbose=False)
        ids = runner.generate(PROMPT, NEW_TOKENS)
        runner.plan.reducer.reset_counts()  # what one more decode step costs
        runner.forward([[ids[-1]]], start_pos=int(runner.positions[0]))
        row = dict(tp=tp, ep=ep, ids=ids, hash=trajectory_hash(ids), report=runner.plan.load_report(ck),
                   loader_bytes=sum(runner.read_bytes.values()), counts=runner.plan.reducer.counts(),
                   predicted=runner.plan.collectives_per_token())
        out.append(row | _static_step_vs_forward(runner, ids[:2]))
    # the collectives benchmark in the same process group (CPU: the library path only)
    bench_collectives._worker(rank, world, dict(sizes=[4096, 8192], iters=5, reps=2, layer=False, out=bench_out,
                                                commit=None, budget_s=120))
    return out


def _static_step_vs_forward(runner, tokens):
    """Two teacher-forced decode steps through the static (graph-capturable) step and through runner.forward,
    on this rank's split: their logits (relative error) and greedy tokens."""
    from dsv4lab.engine.decode_graph import Decoder
    logits = {}
    for path in ("forward", "static"):
        runner.reset()
        runner.forward([PROMPT], 0)
        step = Decoder(runner, graphs=False)
        logits[path] = torch.stack([runner.forward([[t]], len(PROMPT) + i)[0, 0] if path == "forward"
                                    else step.decode([t], [0])[0] for i, t in enumerate(tokens)])
    runner.reset()
    want, got = logits["forward"], logits["static"]
    return dict(static_rel=float((got - want).norm() / want.norm()),
                static_same_argmax=bool(torch.equal(got.argmax(-1), want.argmax(-1))))


@pytest.fixture(scope="module")
def single_process():
    import dsv4lab
    return dsv4lab.load(TINY, max_batch=1).generate_with_stats(PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def two_ranks_run(tmp_path_factory):
    """(each rank's rows, the collectives benchmark's JSON) of one two-process run (~10 s) per pytest run: under
    pytest-xdist the tests reading it land on both workers, which would each run it (conftest's once_per_run)."""
    def run(folder):
        bench = folder / "collectives.json"
        return run_parallel(_generate_ranks, 2, str(TINY), LAYOUTS, str(bench)), bench
    return once_per_run(tmp_path_factory, "parallel_two_ranks", run)


@pytest.fixture(scope="module")
def two_ranks(two_ranks_run):
    return two_ranks_run[0]


@pytest.fixture(scope="module")
def bench_json(two_ranks_run):
    return two_ranks_run[1]


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(LAYOUTS)), ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_parallel_generation_equals_one_process(case, single_process, two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank][case]
        assert got["ids"] == single_process["output_ids"], (rank, got["tp"], got["ep"])
        assert got["hash"] == single_process["hash"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(LAYOUTS)), ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_static_decode_step_issues_the_cross_rank_sums(case, two_ranks):
    # the graph-capturable decode step on a split model equals that split's own decode (without the all-reduces
    # the partial wo_b / expert sums would differ by a factor of ~2)
    for rank in (0, 1):
        got = two_ranks[rank][case]
        assert got["static_rel"] < 1e-5 and got["static_same_argmax"], (rank, got["tp"], got["ep"], got["static_rel"])


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(LAYOUTS)), ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_loaded_bytes_sum_to_the_checkpoint(case, two_ranks):
    reps = [two_ranks[r][case]["report"] for r in (0, 1)]
    total = reps[0]["checkpoint_bytes"]
    assert reps[0]["replicated_bytes"] == reps[1]["replicated_bytes"]
    assert reps[0]["sharded_bytes"] > 0 and reps[0]["loaded_bytes"] < total
    # every split slice is read by exactly one rank; replicated tensors by each rank
    assert sum(r["sharded_bytes"] for r in reps) + reps[0]["replicated_bytes"] == total
    for r in (0, 1):  # the loader's own count agrees with the plan's
        assert two_ranks[r][case]["loader_bytes"] == reps[r]["loaded_bytes"]
    tp, ep = two_ranks[0][case]["tp"], two_ranks[0][case]["ep"]
    if ep > 1:
        assert [rep["experts"] for rep in reps] == [[0, 8], [8, 16]]


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(LAYOUTS)), ids=[f"tp{t}-ep{e}" for t, e in LAYOUTS])
def test_collectives_per_token_match_the_plan(case, two_ranks):
    got = two_ranks[0][case]
    pred, counts = got["predicted"], got["counts"]
    # tiny: 6 layers, CSA (indexer) in layers 1, 3, 5 -> TP: 6 wo_b + 3 indexer sums; EP: 6 expert combines
    assert pred["attention"] == (9 if got["tp"] > 1 else 0) and pred["moe"] == (6 if got["ep"] > 1 else 0)
    assert counts.get("attention", {}).get("calls", 0) == pred["attention"]
    assert counts.get("moe", {}).get("calls", 0) == pred["moe"]
    assert all(c["strategy"] == "library" for c in counts.values())  # CPU: the library path only


@pytest.mark.distributed
def test_torchrun_generate_prints_the_single_process_json(single_process):
    """``torchrun ... generate --tp 2 --ep 2`` prints, from rank 0 only, what ``dsv4lab generate`` prints."""
    import dsv4lab
    cmd = ["--checkpoint", str(TINY), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
           str(NEW_TOKENS), "--json"]
    tp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "dsv4lab",
                         "generate", *cmd, "--tp", "2", "--ep", "2"], capture_output=True, text=True,
                        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=180)
    assert tp.returncode == 0, tp.stderr[-3000:]
    lines = [ln for ln in tp.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, tp.stdout  # rank 0 only
    got = json.loads(lines[0])
    got.pop("seconds")
    assert got.pop("threads") == 1  # OMP_NUM_THREADS=1 above: each rank runs one CPU thread
    ids = single_process["output_ids"]
    m = dsv4lab.load(TINY, max_batch=1)
    text = m.tokenizer.decode(ids)
    reason = finish_reason(ids, len(PROMPT), NEW_TOKENS, m.args.max_seq_len, m.args.eos_token_id)
    assert got == dict(prompt_ids=PROMPT, output_ids=ids, hash=single_process["hash"], text=text,
                       backend="reference", dtype="bf16", finish_reason=reason, decode=dict(path="eager"),
                       prefill_path="eager")
    assert "loaded" in tp.stderr and "all-reduces per decode token: 15" in tp.stderr


# ============================================================================================ peer-read kernel
def _peer_read_rank(rank, world, buffers, epochs, cases, block, results):
    os.environ["TRITON_INTERPRET"] = "1"
    from dsv4lab_kernels import allreduce as kernel
    flag_bytes = kernel.buffer_bytes(0, epochs[rank].numel(), world)[0]
    flags = tuple(b[:flag_bytes].view(torch.int64) for b in buffers)
    got = []
    for dtype, n, seed in cases:
        data = tuple(b[flag_bytes:].view(dtype) for b in buffers)
        parts = _case_parts(dtype, n, seed, world)
        out = torch.full_like(parts[rank], float("nan"))  # poisoned: every element must be written
        kernel.one_shot_all_reduce(parts[rank], out, data, flags, epochs[rank], rank, block=block)
        got.append(out.view(torch.uint8).numpy().tobytes())
    results[rank] = got


def _case_parts(dtype, n, seed, world):
    g = torch.Generator().manual_seed(seed)
    parts = [(torch.randn(n, generator=g) * (r + 1)).to(dtype) for r in range(world)]
    for p in parts:
        p[0] = -0.0  # -0 + -0 must stay -0
    return parts


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_peer_read_kernel_equals_rank_ordered_sum(world):
    """Back-to-back calls of irregular sizes and all four dtypes, each rank in its own process sharing the
    buffers: every rank's result equals the rank-ordered fp32 (fp64) sum rounded once, bit for bit."""
    import torch.multiprocessing as mp
    from dsv4lab_kernels.allreduce import buffer_bytes, reference_all_reduce
    programs, block, capacity = 3, 16, 1024  # 3 programs × 16 elements: some calls leave programs idle
    flag_bytes, total = buffer_bytes(capacity, programs, world)
    buffers = [torch.full((total,), 0x7F, dtype=torch.uint8).share_memory_() for _ in range(world)]
    for b in buffers:
        b[:flag_bytes] = 0  # flags start at zero; the data areas hold garbage
    epochs = [torch.zeros(programs, dtype=torch.int64).share_memory_() for _ in range(world)]
    dtypes = [torch.bfloat16, torch.float64, torch.float16, torch.float32] if world == 2 else \
        [torch.bfloat16, torch.float64]
    sizes = (1, 47, 100) if world == 2 else (47, 100)
    cases = [(dt, n, 10 * i + j) for i, dt in enumerate(dtypes) for j, n in enumerate(sizes)]
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    ctx = mp.start_processes(_peer_read_rank, args=(world, buffers, epochs, cases, block, results), nprocs=world,
                             join=False, start_method="spawn")
    try:
        deadline = 240
        while not ctx.join(timeout=5):
            deadline -= 5
            assert deadline > 0, "peer-read ranks did not finish (deadlock?)"
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    results = dict(results)
    manager.shutdown()
    for c, (dtype, n, seed) in enumerate(cases):
        want = reference_all_reduce(_case_parts(dtype, n, seed, world)).view(torch.uint8).numpy().tobytes()
        for rank in range(world):
            assert results[rank][c] == want, (rank, dtype, n)
    assert all(e.tolist() == [len(cases)] * programs for e in epochs)  # every program took part in every call


# ============================================================================================ GPUs
def _gpu_peer_read_vs_nccl(rank, world):
    import torch.distributed as dist

    from dsv4lab.engine.collectives import PeerReadAllReduce
    from dsv4lab.engine.parallel import init_distributed
    _, _, device = init_distributed()
    peer = PeerReadAllReduce(None, device, capacity_bytes=1 << 16)
    bad = []
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n in (1, 1000, 4097, (1 << 16) // torch.empty((), dtype=dtype).element_size()):
            x = (torch.randn(n, generator=g) * (rank + 1)).to(dtype).to(device)
            want = x.clone()
            dist.all_reduce(want)
            if not torch.equal(peer(x).view(torch.uint8), want.view(torch.uint8)):
                bad.append((str(dtype), n))
    return bad


@pytest.mark.gpu
@pytest.mark.distributed
def test_peer_read_matches_nccl_bit_for_bit_on_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    assert run_parallel(_gpu_peer_read_vs_nccl, 2) == [[], []]


@pytest.mark.distributed
def test_bench_collectives_on_cpu(two_ranks, bench_json):
    """The benchmark's worker ran in the ranks above (CPU: library all-reduce only, eager)."""
    from dsv4lab.tools.bench.collectives import format_table
    doc = json.loads(bench_json.read_text())
    assert {(row["variant"], row["mode"], row["message_bytes"]) for row in doc["rows"]} == {
        ("library", "eager", 4096), ("library", "eager", 8192)}
    assert all(row["us_median"] > 0 and len(row["us_samples"]) == 2 for row in doc["rows"])
    assert doc["world"] == 2 and doc["torch"] and "aborted" not in doc
    assert "library" in format_table(doc)
