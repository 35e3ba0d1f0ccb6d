"""No compilation on the request path (issue 34): after ``warmup()``, a prompt of any length launches only kernel
specializations the warm-up launched.

Triton compiles one binary per kernel *specialization* (``kernels/dsv4lab_kernels/specialization.py``); a launch
with a key it has not seen compiles on the spot. On the CPU nothing compiles, so the proof records every launch's
key (the recorder mirrors Triton's rule, checked here against Triton's own ``native_specialize_impl``) and compares
sets: the warm-up's against those of prompts of many lengths — single chunks at every bucket's edges, chunked
prompts, a prompt longer than the widest bucket, two prompts in one forward — each followed by decode steps. The
static paths' launches cannot depend on values, so the sweep records without running the kernels
(``LaunchRecorder(execute=False)``); the same paths ran for real in ``tests/test_prefill_step.py``. The eager
per-op forward launches keys the warm-up did not: the check can fail.

Also: the warm-up leaves live sequences untouched, ``load(warmup=True)`` and the commands' ``--warmup``.
"""
from __future__ import annotations

import json

import pytest
import torch

import dsv4lab
from conftest import TINY, load_tiny
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.engine.prefill_step import Prefiller
from dsv4lab.faces import cli
from test_prefill_step import SMALL, _bytes, cache_state

spec = kernel_module("specialization")


def test_the_recorded_key_is_tritons_specialization_rule():
    native = pytest.importorskip("triton._C.libtriton").native_specialize_impl
    from triton.backends.compiler import BaseBackend
    buf = torch.zeros(64, dtype=torch.uint8)
    values = [0, 1, 2, 15, 16, 17, 48, -16, -17, 2 ** 31 - 1, 2 ** 31, 2 ** 40 + 16, 2 ** 63, -2 ** 31 - 1, True,
              False, 0.5, None, buf, buf[1:], buf[16:], buf.view(torch.bfloat16), buf[2:].view(torch.bfloat16),
              torch.zeros(3, dtype=torch.float8_e4m3fn), torch.zeros(3, dtype=torch.bool),
              torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.float32)]
    for v in values:
        for specialize in (True, False):
            for align in (True, False):
                want = tuple(native(BaseBackend, v, False, specialize, align))
                assert spec.arg_key(v, specialize, align) == want, (v, specialize, align)


def test_the_recorder_keys_launches_by_their_constexprs_and_puts_run_back():
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    ap = kernel_module("attention_prefill")
    before = (JITFunction.run, InterpretedFunction.run)
    kv = torch.randn(5, 8, 40)
    with spec.LaunchRecorder() as rec:
        ap.compressor_pool(kv, torch.randn(5, 8, 40))
        ap.compressor_pool(kv[:3], torch.randn(3, 8, 40))  # another row count: NB=3 against 5, both ''
        ap.indexer_topk(torch.randn(1, 17, 32), torch.arange(40, 57)[None], 4, 8)
    assert (JITFunction.run, InterpretedFunction.run) == before
    pool = [k for k in rec.keys if k.kernel == "_pool_kernel"]
    assert len(pool) == 1 and rec.keys[pool[0]] == 2 and dict(pool[0].args)["BLOCK_R"] == "8"
    topk = dict(next(k for k in rec.keys if k.kernel == "_topk_kernel").args)
    assert topk["ROWS"] == ("i32", None) and topk["ratio"] == ("i32", "")  # do_not_specialize, and not
    with spec.LaunchRecorder() as rec:
        ap.compressor_pool(kv[:1], torch.randn(1, 8, 40))  # NB = 1: a compile-time constant, a new key
    assert dict(next(iter(rec.keys)).args)["NB"] == ("constexpr", 1) and not set(rec.keys) & set(pool)


def _sweep(m) -> list[str]:
    """Prompts of many lengths, each continued by a decode step; returns what each launched."""
    ids = torch.randint(2, SMALL.vocab_size, (2, m.args.max_seq_len), generator=torch.Generator().manual_seed(0))
    cases = [((n,), 1) for n in (2, 15, 16, 17, 63, 64, 65, 97, 150)]  # one forward each
    cases += [((64, 64, 22), 1), ((199,), 1)]  # chunked; longer than the widest bucket (128 + 71)
    cases += [((30,), 2)]  # two prompts (30 and 19 tokens) in one forward, decoded together
    keys = []
    for chunks, rows in cases:
        with spec.LaunchRecorder(execute=False) as rec:
            m.reset()
            p = 0
            for c in chunks:
                lengths = [c, c - 11][:rows]
                m.forward(ids[:rows, p:p + c], p, lengths=lengths, logits="last")
                p += c
            # a fresh tensor: on a GPU the step's inputs are copied to the device (or into the graph's own); on the
            # CPU a view of the caller's ids goes to the kernel as it is, its address's alignment the caller's
            m.forward(ids[:rows, p:p + 1].clone(), [p, p - 11][:rows])
        keys.append((chunks, rows, set(rec.keys)))
    return keys


def test_after_warmup_prompts_of_any_length_launch_only_warmed_specializations():
    m = dsv4lab.load(RandomCheckpoint(SMALL.replace(max_seq_len=200), 1), backend="triton", max_batch=2,
                     validate=False, prefill_path="static", decode_path="static")
    # the Triton backend's prefill kernels start at 64 rows; the ladder ends at the first bucket holding the cache
    assert m.prefiller.buckets == (64, 96, 128, 192, 256)
    m._prefillers["static"] = Prefiller(m, graphs=False, buckets=(64, 96, 128))  # so that 150 and 199 are cut
    with spec.LaunchRecorder(execute=False) as rec:
        report = m.warmup(progress=False)
    warmed = set(rec.keys)
    assert report.prefill_s.keys() == {64, 96, 128} and report.decode_s.keys() == {1, 2}
    assert report.specializations == len(warmed) and report.kernels == len(rec.kernels) > 20
    # what each part added (the widest bucket first: the others add only the keys of their own sizes)
    assert list(report.new_specializations) == ["prefill 128", "prefill 96", "prefill 64", "decode 1", "decode 2"]
    assert sum(report.new_specializations.values()) == len(warmed)
    for chunks, rows, keys in _sweep(m):
        new = keys - warmed
        assert not new, f"{rows} row(s) in chunks {chunks} launched {len(new)} key(s) the warm-up did not: " + \
            "; ".join(k.describe() for k in list(new)[:3])
    m.prefill_path = "eager"  # the per-op forward at the prompt's own length: new shapes, new keys
    with spec.LaunchRecorder(execute=False) as rec:
        m.reset()
        m.forward(torch.randint(2, 500, (1, 37)), 0, logits="last")
    assert set(rec.keys) - warmed


def test_warmup_leaves_live_sequences_untouched():
    """A warm-up in the middle of a sequence (the spare slot only): the sequence continues exactly as without it."""
    kw = dict(max_batch=1, max_seq_len=32, prefill_path="static", decode_path="static")
    ids = torch.randint(2, 4096, (1, 23), generator=torch.Generator().manual_seed(4))
    outs, states = [], []
    for warm in (False, True):
        m = load_tiny(**kw)  # (the same runner both times, reset: its dequantized weights are cached)
        m.forward(ids[:, :20], 0, logits="last")
        if warm:
            report = m.warmup(progress=False)
            assert report.prefill_s.keys() == {16, 32} and report.decode_s.keys() == {1}
            assert report.launches == 0 and m.warmup_report is report  # the reference launches no kernel
            assert int(m.positions[0]) == 20
        outs.append(torch.cat([m.forward(ids[:, 20:22], 20, logits="last")[:, 0], m.forward(ids[:, 22:], 22)[:, 0]]))
        states.append(cache_state(m))
    assert torch.equal(_bytes(outs[0]), _bytes(outs[1]))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # the spare slot was reset too


def test_load_with_warmup_and_the_commands_flags(capsys, tmp_path):
    m = dsv4lab.load(TINY, max_batch=1, max_seq_len=32, prefill_path="static", decode_path="static", warmup=True)
    assert m.warmup_report is not None and m.warmup_report.prefill_s.keys() == {16, 32}
    assert "prefill (static) 2 bucket(s) 32, 16; decode (static) tier(s) 1" in m.warmup_report.describe()
    # generate --warmup: on the eager paths there is nothing to warm, and the report says so
    assert cli.main(["generate", "--checkpoint", str(TINY), "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                     "--warmup", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["prefill_path"] == "eager" and "eager prefill path" in res["warmup"]["note"]
    assert cli.main(["generate", "--checkpoint", str(TINY), "--prompt-ids", "5,6", "--prefill-path", "graph"]) == 2
    assert "--prefill-path graph" in capsys.readouterr().err


def test_serve_warms_up_when_asked_and_by_default_only_on_a_gpu():
    pytest.importorskip("fastapi")
    from dsv4lab.tools.serve.server import ServerOptions, build_app
    for asked, warmed in ((None, torch.cuda.is_available()), (True, True), (False, False)):
        m = dsv4lab.load(TINY, max_batch=1, max_seq_len=32)
        _, scheduler = build_app(ServerOptions(checkpoint=str(TINY), max_concurrency=1, warmup=asked), model=m)
        scheduler.stop()
        assert (m.warmup_report is not None) == warmed, asked
