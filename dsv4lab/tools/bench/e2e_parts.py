"""The parts of ``bench e2e`` (:mod:`dsv4lab.tools.bench.e2e`): run in order, timed, skipped past the budget, a
failing part recorded while the others still run, and on one rank a part stopped when it overruns the budget — so a
GPU visit's run always ends with its JSON written."""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

from dsv4lab.core.provenance import jsonable


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(f"[bench e2e] {msg}", file=sys.stderr, flush=True)


class PartTimedOut(Exception):
    """A part still running past the budget plus ``--overrun-s`` (one rank only)."""


@contextmanager
def _deadline(at: float | None, name: str):
    """Raise :class:`PartTimedOut` in the main thread at ``time.perf_counter() == at`` (None, or not the main
    thread: no deadline). SIGALRM interrupts Python between bytecodes: a part waiting in a CUDA call stops when
    that call returns."""
    if at is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise PartTimedOut(f"{name} timed out: still running at the budget plus the overrun allowance")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, max(at - time.perf_counter(), 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Parts:
    """Runs the benchmark's parts in order, timing each and skipping those that would start past the budget.

    On one rank a part that raises is recorded (``failed``: name → the error's line, the traceback on stderr) and
    the run goes on after ``recover()`` — one broken part does not lose the others' numbers. Across ranks the
    parts are collective, so an error there still ends the run."""

    def __init__(self, rank: int, t_start: float, budget_s: float, world: int, recover=None,
                 overrun_s: float | None = None):
        self.rank, self.t_start, self.budget_s, self.world = rank, t_start, budget_s, world
        self.overrun_s = overrun_s
        self.recover = recover
        self.timing: dict[str, float] = {}
        self.skipped: list[str] = []
        self.failed: dict[str, str] = {}

    def _stop_at(self) -> float | None:
        """When a part on one rank is stopped: the budget plus the overrun allowance (None: never)."""
        if self.overrun_s is None or self.world > 1:
            return None
        return self.t_start + self.budget_s + self.overrun_s

    def run(self, name: str, fn):
        over = time.perf_counter() - self.t_start > self.budget_s
        if self.world > 1:  # every rank must take the same decision (the parts are collective)
            flag = torch.tensor([int(over)])
            dist.broadcast(flag, 0)
            over = bool(flag.item())
        if over:
            self.skipped.append(name)
            log(self.rank, f"{name}: skipped (past the {self.budget_s:.0f} s budget)")
            return None
        t0 = time.perf_counter()
        if self.world > 1:
            out = fn()
        else:
            try:
                with _deadline(self._stop_at(), name):
                    out = fn()
            except Exception as err:  # noqa: BLE001 — recorded, reported, and the exit status says so
                traceback.print_exc()
                self.failed[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
                log(self.rank, f"{name}: FAILED ({self.failed[name]})")
                if self.recover is not None:
                    self.recover()
                return None
        self.timing[name] = round(time.perf_counter() - t0, 2)
        log(self.rank, f"{name}: {self.timing[name]:.1f} s")
        if out is not None:  # the part's numbers in the log at once: a run killed later keeps them
            log(self.rank, f"{name} result: {json.dumps(jsonable(out), separators=(',', ':'))[:20000]}")
        return out


__all__ = ["Parts", "PartTimedOut", "log"]
