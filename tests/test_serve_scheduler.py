"""The server's scheduler on the engine's one-step-behind loop (:mod:`dsv4lab.engine.batch_loop`, issue 32 item 3).

Greedy sequences are fed their previous choice on the device and their ids read a step late; sequences join after
their prefill while others are mid-flight and leave at different steps (their token budget, a stop token read one
step late, after which the loop has already run one step past it). Every sequence's ids must equal the same request
run alone (``m.generate``), on the eager path (steps through ``forward``) and the static path (steps through
``runner.decoder.stepper``, what the CUDA graphs replay), and every slot must come back reset.
"""
from __future__ import annotations

import threading

import pytest
import torch

import dsv4lab
from conftest import ROOT
from dsv4lab.engine.batch_loop import BatchLoop
from dsv4lab.engine.finite import NON_FINITE
from dsv4lab.tools.serve.scheduler import SamplingParams, Scheduler

TINY_PY = ROOT / "data" / "tiny-py"
# (prompt, max_tokens): different lengths, so rows retire at different steps
REQUESTS = [([17, 230, 1999, 45, 8], 5), ([300, 301, 302], 2), ([9, 10, 11, 12, 13, 14, 15], 4), ([2000, 7], 3)]
_models: dict = {}


def _model(path: str):
    """One model per decode path for the module (2 slots, 64 positions), reset."""
    if path not in _models:
        _models[path] = dsv4lab.load(TINY_PY, max_batch=2, max_seq_len=64, decode_path=path)
    m = _models[path]
    m.reset()
    return m


class _Collector:
    def __init__(self, n: int):
        self.events: dict[int, list] = {i: [] for i in range(n)}
        self.done = threading.Event()
        self.first_tokens = threading.Event()

    def deliver(self, key: int):
        def take(event):
            self.events[key].append(event)
            if key == 0 and len(self.events[0]) >= 2:
                self.first_tokens.set()  # the first sequence is decoding: the next ones join mid-flight
            if all(e and e[-1].finish_reason for e in self.events.values()):
                self.done.set()
        return take

    def ids(self, key: int) -> list[int]:
        return [e.token_id for e in self.events[key] if e.token_id is not None]


@pytest.mark.parametrize("path", ["eager", "static"])
def test_rows_join_mid_flight_and_retire_at_different_steps_each_equal_to_its_lone_run(path):
    m = _model(path)
    alone = [m.generate(p, n, stop_at_eos=False) for p, n in REQUESTS]
    # the third request stops at a token it chooses mid-way: read a step late, after one step past it
    stop = alone[2][2]
    want = [alone[0], alone[1], alone[2][:alone[2].index(stop) + 1], alone[3]]
    prefills = []
    real_forward = m.forward

    def counted(tokens, *args, **kwargs):
        prefills.append(torch.as_tensor(tokens).shape[1])
        return real_forward(tokens, *args, **kwargs)
    m.forward = counted
    try:
        _serve(m, want, stop, prefills, path)
    finally:
        del m.forward


def _serve(m, want, stop, prefills, path):
    sched = Scheduler(m, max_running=2)  # 4 requests on 2 slots: freed slots are reused while others decode
    got = _Collector(len(REQUESTS))
    sched.start()
    try:
        params = [SamplingParams(max_tokens=n) for _, n in REQUESTS]
        params[2] = SamplingParams(max_tokens=REQUESTS[2][1], stop_token_ids=frozenset({stop}))
        sched.submit(REQUESTS[0][0], params[0], got.deliver(0))
        assert got.first_tokens.wait(120)
        for i in range(1, len(REQUESTS)):
            sched.submit(REQUESTS[i][0], params[i], got.deliver(i))
        assert got.done.wait(300), {k: len(v) for k, v in got.events.items()}
    finally:
        sched.stop()
    assert [got.ids(i) for i in range(len(REQUESTS))] == want
    assert [got.events[i][-1].finish_reason for i in range(4)] == ["length", "length", "stop", "length"]
    stats = sched.stats()
    assert stats["free_slots"] == 2 and stats["running"] == 0 and stats.get("failed", 0) == 0
    assert m.positions.tolist() == [0, 0]  # every slot reset when its sequence left
    if path == "static":  # decode steps went through the decoder's stepper: forward ran the prefills only
        assert len(prefills) == stats["prefill_forwards"] >= 2


def test_the_loop_reads_ids_a_step_late_and_never_hands_a_left_rows_id_to_its_slots_next_row():
    m = _model("static")
    prompts = [[17, 230, 1999, 45, 8], [300, 301, 302]]
    alone = [m.generate(p, 4, stop_at_eos=False) for p in prompts]
    m.reset()
    loop = BatchLoop(m)
    first = int(m.forward(torch.tensor([prompts[0]]), 0, slots=[0], logits="last")[0, -1].argmax())
    loop.join(0, first, len(prompts[0]), 3)
    assert loop.step().ids == []              # step 1 launched, nothing read yet
    assert loop.step().ids == [(0, alone[0][1])]  # step 1's id, read while step 2 runs
    loop.leave(0)                             # leaves with step 2 in flight
    m.reset([0])
    first = int(m.forward(torch.tensor([prompts[1]]), 0, slots=[0], logits="last")[0, -1].argmax())
    loop.join(0, first, len(prompts[1]), 3)   # a new row in the same slot
    assert loop.step().ids == []              # step 2 belonged to the row that left: not handed to this one
    got = [first]
    while loop.busy:
        got += [t for _, t in loop.step().ids]
    assert got == alone[1]
    with pytest.raises(ValueError, match="max_seq_len=64"):
        loop.join(1, 5, 60, 5)


def test_non_finite_logits_read_as_the_flag_and_fail_only_their_sequence():
    m = _model("static")
    prompts = [[17, 230, 1999, 45, 8], [300, 301, 302]]
    alone = m.generate(prompts[1], 2, stop_at_eos=False)
    poison = m.generate(prompts[0], 1)[0]  # fed at the first decode step of prompt 0
    assert poison not in prompts[1] + alone
    saved = m.model.embed.weight[poison].clone()
    with torch.no_grad():
        m.model.embed.weight[poison] = float("nan")
    try:
        m.reset()
        loop = BatchLoop(m)
        for slot, p in enumerate(prompts):
            first = int(m.forward(torch.tensor([p]), 0, slots=[slot], logits="last")[0, -1].argmax())
            loop.join(slot, first, len(p), 2)
        loop.step()
        assert loop.step().ids == [(0, NON_FINITE), (1, alone[1])]
    finally:
        with torch.no_grad():
            m.model.embed.weight[poison] = saved
