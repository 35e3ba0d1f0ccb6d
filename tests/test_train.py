"""Training with the reference modules, native export, the quantization ablation and data/tiny-py (issue 13)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dsv4lab.core import quant
from dsv4lab.core.checkpoint import expected_tensors
from dsv4lab.core.config import get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.tools.train.quant_ablation import (NATIVE_DENSE, NATIVE_EXPERTS, DenseFormat, ExpertFormat, fp4_group_qdq,
                                    fp8_dense_qdq, requantize)
from dsv4lab.tools.train.trainer import (TrainConfig, TrainingOps, build_trainable, indexer_kl, lm_losses, load_weights_f32,
                           native_state_dict, save_weights, train, trainable_from_state, update_router_biases)

ROOT = Path(__file__).resolve().parents[1]
TINY_PY = ROOT / "data" / "tiny-py"
ARGS = get_preset("tiny")


def _window(b, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(6, ARGS.vocab_size, (b, n + 2), generator=g)


def _perturbed(state, seed):
    """The init state plus noise on every float tensor (no zero-initialised sinks, biases or ape left)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in state.items()}


def test_every_parameter_gets_a_gradient_and_router_state_stays_buffers():
    model = build_trainable(ARGS, seed=1)
    names = dict(model.named_parameters())
    assert "layers.0.ffn.gate.tid2eid" not in names and "layers.3.ffn.gate.bias" not in names
    assert model.layers[0].ffn.gate.tid2eid.dtype == torch.int64
    tid = model.layers[0].ffn.gate.tid2eid
    assert all(len(set(r)) == ARGS.n_activated_experts for r in tid[:50].tolist())  # distinct experts per id
    ops = TrainingOps(Numerics(torch.float32, False, False, False, exact_reductions=False))
    losses = lm_losses(model, ops, _window(2, 48, 0), mtp_weight=0.3, indexer_weight=1.0)
    assert set(losses) == {"lm", "mtp", "indexer", "total"}
    losses["total"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert missing == []
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_indexer_loss_reaches_only_the_indexer():
    model = build_trainable(ARGS, seed=2)
    ops = TrainingOps(Numerics(torch.float32, False, False, False, exact_reductions=False))
    losses = lm_losses(model, ops, _window(1, 40, 1), mtp_weight=0.0, indexer_weight=1.0)
    losses["indexer"].backward()
    touched = {n for n, p in model.named_parameters() if p.grad is not None and bool(p.grad.abs().sum() > 0)}
    assert touched and all(".attn.indexer." in n for n in touched)


def _directional_check(model, ops, w, mtp_weight, indexer_weight, key, params, seed):
    """Autograd's directional derivative of losses[key] along a random direction in ``params`` vs a central
    difference (float64)."""
    for p in model.parameters():
        p.grad = None
    lm_losses(model, ops, w, mtp_weight, indexer_weight)[key].backward()
    g = torch.Generator().manual_seed(seed)
    direction = [torch.randn(p.shape, generator=g, dtype=p.dtype) for p in params]
    norm = sum(float(d.square().sum()) for d in direction) ** 0.5
    direction = [d / norm for d in direction]  # a unit step: tiny per weight, so no router/indexer choice flips
    analytic = sum(float((p.grad * d).sum()) for p, d in zip(params, direction))
    eps = 1e-4

    def loss_at(sign):
        with torch.no_grad():
            for p, d in zip(params, direction):
                p.add_(sign * eps * d)
            out = float(lm_losses(model, ops, w, mtp_weight, indexer_weight)[key])
            for p, d in zip(params, direction):
                p.sub_(sign * eps * d)
        return out

    numeric = (loss_at(1) - loss_at(-1)) / (2 * eps)
    return analytic, numeric


def test_gradient_equals_finite_difference_through_the_caches():
    # float64 end to end: the directional derivative from autograd (through in-place cache writes, compressor
    # rings, sparse attention, mHC and the MoE loops) equals a central difference of the loss
    model = build_trainable(ARGS, seed=3).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ops = TrainingOps(Numerics(torch.float64, False, False, False, exact_reductions=False))
    w = _window(2, 40, 2)
    analytic, numeric = _directional_check(model, ops, w, 0.3, 0.0, "total", list(model.parameters()), 4)
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic)
    # the indexer's KL treats the attention target as a constant: exact for the indexer's own parameters
    indexer = [p for n, p in model.named_parameters() if ".attn.indexer." in n]
    analytic, numeric = _directional_check(model, ops, w, 0.0, 1.0, "indexer", indexer, 5)
    assert abs(numeric - analytic) <= 1e-6 * abs(analytic)


def test_indexer_kl_is_zero_at_the_target_and_finite_without_visible_entries():
    g = torch.Generator().manual_seed(5)
    b, s, h, d, T = 2, 9, 3, 8, 2
    q = torch.randn(b, s, h, d, generator=g)
    ent = torch.randn(b, T, d, generator=g)
    positions = torch.arange(s)[None].expand(b, -1)  # positions 0..2 see no entry (ratio 4)
    logits = torch.einsum("bshd,btd->bsht", q, ent) * 0.3
    visible = torch.arange(T)[None, None] < ((positions + 1) // 4)[..., None]
    target = logits.masked_fill(~visible[:, :, None], float("-inf")).softmax(-1).mean(2)
    at_target = torch.where(visible, target.clamp_min(1e-30).log(), torch.nan).requires_grad_(True)
    kl0 = indexer_kl(q, ent, at_target, positions, 4, 0.3)
    assert abs(float(kl0.detach())) < 1e-6
    other = torch.randn(b, s, T, generator=g, requires_grad=True)
    kl = indexer_kl(q, ent, other, positions, 4, 0.3)
    assert float(kl.detach()) > 1e-4
    kl.backward()
    assert torch.isfinite(other.grad).all() and float(other.grad[:, :3].abs().sum()) == 0.0


def test_router_bias_update_moves_load_towards_balance():
    model = build_trainable(ARGS, seed=6)
    ops = TrainingOps(Numerics(torch.float32, False, False, False, exact_reductions=False))
    blk = model.layers[3]
    load = torch.arange(ARGS.n_routed_experts, dtype=torch.float32)
    ops.expert_load[id(blk.ffn.experts)] = load
    ops.expert_load[id(model.layers[0].ffn.experts)] = load  # a hash layer: no bias to move
    before = blk.ffn.gate.bias.clone()
    ratio = update_router_biases(model, ops, 0.01)
    step = blk.ffn.gate.bias - before
    assert torch.equal(step, 0.01 * torch.sign(load.mean() - load))
    assert set(ratio) == {"block0.hash", "block3.bias"}


def test_native_export_loads_as_the_same_model(tmp_path):
    # trained-form state -> native tensors -> checkpoint -> dsv4lab.load equals the trainable model holding the
    # dequantized values (the ablation's "native" point): same modules, same numbers, both directions of the export
    import dsv4lab
    from dsv4lab.core.checkpoint import Checkpoint, write_state_dict
    from dsv4lab.tools.train.trainer import DEFAULT_TOKENIZER

    state = _perturbed(build_trainable(ARGS, seed=7).state_dict(), 8)
    native = native_state_dict(ARGS, state)
    assert native["layers.2.ffn.experts.5.w1.weight"].dtype == torch.int8
    assert native["layers.2.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert native["layers.2.attn.compressor.ape"].dtype == torch.float32
    write_state_dict(tmp_path / "ck", ARGS, native, n_shards=2, extra_files={"tokenizer.json": DEFAULT_TOKENIZER})
    assert Checkpoint(tmp_path / "ck").validate().ok
    runner = dsv4lab.load(tmp_path / "ck", dtype=torch.float64, act_quant=False, kv_fp8_sim=False,
                          indexer_fp4_sim=False, max_batch=1)
    ids = _window(1, 70, 9)[:, :70]
    ref = runner.forward(ids, 0).double()
    assert not torch.isnan(ref).any()
    q_state, stats = requantize(ARGS, state, NATIVE_EXPERTS, NATIVE_DENSE)
    assert 0.01 < stats["experts"]["rel_error"] < 0.3 and stats["experts"]["bytes_per_param"] == 0.5 + 1 / 32
    model = trainable_from_state(ARGS, q_state).double()
    ops = ReferenceOps(Numerics.exact(torch.float64))
    model.allocate(1, torch.float64, torch.float64, "cpu")
    with torch.no_grad():
        got = model(ids, torch.zeros(1, dtype=torch.long), torch.tensor([70]), torch.tensor([0]), ops)
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6  # the runner returns float32 logits


def test_fp4_group_formats_are_on_the_grid_and_finer_groups_err_less():
    g = torch.Generator().manual_seed(10)
    w = torch.randn(96, 256, generator=g) * torch.exp(torch.randn(96, 256, generator=g))  # heavy-tailed
    errs = {}
    for scale in ("e8m0", "e4m3"):
        for group in (16, 32, 64, 128):
            deq, nbytes = fp4_group_qdq(w, ExpertFormat(group, scale))
            errs[scale, group] = float((deq - w).norm() / w.norm())
            assert nbytes == 96 * 256 // 2 + 96 * 256 // group + (4 if scale == "e4m3" else 0)
            groups = deq.view(96, -1, group)
            if scale == "e8m0":  # value / power-of-two group scale is an E2M1 value
                s = (groups.abs().amax(-1, keepdim=True) / 6).clamp_min(1e-30)
                s = torch.ldexp(torch.ones_like(s), quant.ceil_pow2_exponent(s).float())
                ratio = groups / s
                grid = torch.tensor(quant.E2M1_VALUES)
                assert bool((ratio[..., None] == grid).any(-1).all())
        assert errs[scale, 16] < errs[scale, 32] < errs[scale, 64] < errs[scale, 128]
    packed, sc = quant.fp4_quantize(w)
    assert torch.equal(fp4_group_qdq(w, NATIVE_EXPERTS)[0], quant.fp4_dequant(packed, sc))


def test_fp8_dense_formats():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(200, 300, generator=g) * torch.logspace(-5, 0, 200)[:, None]  # rows 5 decades apart
    blk, nb = fp8_dense_qdq(w, DenseFormat("block128", "e8m0"))
    ch, nc = fp8_dense_qdq(w, DenseFormat("channel", "e8m0"))
    chf, ncf = fp8_dense_qdq(w, DenseFormat("channel", "f32"))
    assert nb == 200 * 300 + 2 * 3 and nc == 200 * 300 + 200 and ncf == 200 * 300 + 4 * 200
    rel = [float((x - w).norm() / w.norm()) for x in (blk, ch, chf)]
    assert all(r < 0.05 for r in rel)
    small = slice(0, 20)  # E4M3 is floating point: only rows pushed into its subnormals by a shared scale lose
    assert float((ch - w)[small].norm()) < float((blk - w)[small].norm())


@pytest.mark.slow
def test_train_steps_save_and_reload(tmp_path):
    streams = {"train": np.random.default_rng(0).integers(6, 4096, 5000).astype(np.uint16),
               "heldout": np.random.default_rng(1).integers(6, 4096, 1100).astype(np.uint16)}
    cfg = TrainConfig(seq_len=48, batch_size=2, steps=3, warmup_steps=2, eval_every=0)
    model, report = train(cfg, streams, "cpu", log=lambda m: None)
    assert report["steps"] == 3 and len(report["history"]) == 3 and report["skipped_steps"] == 0
    assert report["evals"][-1]["tokens"] == ARGS.max_seq_len  # one window of the preset's max_seq_len
    save_weights(model, tmp_path, max_shard_bytes=4 << 20)
    assert all(f.stat().st_size <= 16 << 20 for f in tmp_path.iterdir())
    back = load_weights_f32(tmp_path)
    assert back.keys() == model.state_dict().keys()
    bf16 = {s.name for s in expected_tensors(ARGS) if s.dtype == "BF16"}
    assert {"embed.weight", "head.weight", "layers.4.ffn.gate.weight", "mtp.0.enorm.weight"} <= bf16
    for k, v in model.state_dict().items():  # BF16-in-file tensors come back bf16-rounded, the rest exactly
        assert torch.equal(back[k], v.to(torch.bfloat16).float() if k in bf16 else v), k
    assert back["layers.3.ffn.experts.w2"].dtype == torch.float32


# ------------------------------------------------------------------------------------------- data/tiny-py
needs_tiny_py = pytest.mark.skipif(not (TINY_PY / "config.json").exists(), reason="data/tiny-py not built")


@needs_tiny_py
def test_tiny_py_is_valid_small_and_meets_acceptance():
    from dsv4lab.core.checkpoint import Checkpoint

    rep = Checkpoint(TINY_PY).validate()
    assert rep.ok, rep.problems
    assert sum(p.stat().st_size for p in TINY_PY.iterdir()) <= 25 * 10 ** 6
    # the architecture of the tiny preset exactly: the same config.json as the random-weight data/tiny
    assert (TINY_PY / "config.json").read_text() == (ROOT / "data" / "tiny" / "config.json").read_text()
    assert Checkpoint(TINY_PY).args.replace(max_seq_len=ARGS.max_seq_len) == ARGS
    report = json.loads((TINY_PY / "train_report.json").read_text())
    assert report["heldout_ppl_quantized"] < report["unigram_ppl"] / 2
    for key in ("heldout_ppl_bf16", "training", "corpus"):
        assert key in report


@needs_tiny_py
def test_tiny_py_greedy_oracles_reproduce():
    import dsv4lab

    doc = json.loads((TINY_PY / "oracles.json").read_text())
    runner = dsv4lab.load(TINY_PY, dtype=torch.bfloat16, max_batch=1)
    for row in doc["oracles"][:2]:
        assert runner.tokenizer.encode(row["prompt"], add_bos=True) == row["prompt_ids"]
        out = runner.generate(row["prompt_ids"], len(row["output_ids"]), stop_at_eos=False)
        assert out == row["output_ids"], (row["prompt"], runner.tokenizer.decode(out), row["completion"])


@needs_tiny_py
def test_tiny_py_beats_half_the_unigram_baseline_on_a_heldout_file():
    # measured live on this interpreter's corpus: the held-out file with the most tokens, first 384 tokens
    import dsv4lab
    from dsv4lab.tools.train.corpus import read_corpus

    report = json.loads((TINY_PY / "train_report.json").read_text())
    runner = dsv4lab.load(TINY_PY, dtype=torch.bfloat16, max_batch=1)
    texts = [t for _, t in read_corpus()["heldout"]]
    ids = max((runner.tokenizer.encode(t, add_bos=True) for t in texts), key=len)[:385]
    logits = runner.forward(torch.tensor([ids[:-1]]), 0)
    nll = float(-logits.log_softmax(-1)[0].gather(-1, torch.tensor(ids[1:])[:, None]).mean())
    assert np.exp(nll) < report["unigram_ppl"] / 2
