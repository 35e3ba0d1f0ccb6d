"""Warm-up: compile every kernel a prompt can need before the first request, not on its path.

A Triton kernel compiles once per specialization (``kernels/dsv4lab_kernels/specialization.py`` says what that key
holds); the first prompt that needs a key it has not seen waits for the compiler. The engine's paths bound the keys:

* **prefill** (:mod:`dsv4lab.engine.prefill_step`): every chunk runs at one of the runner's buckets with shapes
  that depend on the bucket alone, so one chunk per bucket launches every key any prompt length will;
* **decode** (:mod:`dsv4lab.engine.decode_graph`): one step per batch tier (a batch between tiers is padded to the
  next on the graph path).

:func:`warm_up` runs exactly that — one prefill chunk per bucket (on the graph path: its capture) and one decode step
per tier (its capture), all in the runner's spare cache slot, which is reset afterwards, so no sequence is touched —
with a progress bar, and reports the seconds of each and, with the Triton backend, the distinct kernel
specializations it launched (every binary the compiler had to build, or found in its cache). ``load(...,
warmup=True)``, ``generate --warmup``, ``bench e2e`` (its first-prompt row) and ``serve`` on a GPU call it.

Not covered (they compile at first use): the eager per-op paths (``prefill_path="eager"`` — a CPU, tracing,
verification, prompt logprobs (``logits="all"``) — and ``decode_path="eager"``), the MTP block's forwards
(speculative decoding), and on the static decode path a batch size that is not a tier.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from dsv4lab.engine.decode_graph import tiers_for
from dsv4lab.engine.kernel_loader import kernel_module

log = logging.getLogger("dsv4lab.warmup")


@dataclass
class WarmupReport:
    """What :func:`warm_up` did.

    Attributes:
        prefill_path, decode_path: the runner's paths.
        prefill_s: seconds per bucket (its first chunk, or capture on the graph path).
        decode_s: seconds per batch tier.
        seconds: the whole warm-up.
        kernels: distinct Triton kernels launched (0 for the reference backend).
        specializations: distinct launch keys — the binaries compiled (or read from Triton's cache).
        new_specializations: per part (``prefill <bucket>``, ``decode <tier>``, in the order run), the keys it
            launched that no part before it had: what each bucket or tier adds to the compile cost.
        launches: kernel launches recorded.
        note: why a part was skipped or ran without graphs, if it did.
    """

    prefill_path: str
    decode_path: str
    prefill_s: dict[int, float] = field(default_factory=dict)
    decode_s: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    kernels: int = 0
    specializations: int = 0
    new_specializations: dict[str, int] = field(default_factory=dict)
    launches: int = 0
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prefill_s"] = {str(k): v for k, v in self.prefill_s.items()}
        d["decode_s"] = {str(k): v for k, v in self.decode_s.items()}
        return d

    def describe(self) -> str:
        parts = [f"warm-up {self.seconds:.1f} s: prefill ({self.prefill_path}) "
                 f"{len(self.prefill_s)} bucket(s) {', '.join(map(str, self.prefill_s)) or '-'}; decode "
                 f"({self.decode_path}) tier(s) {', '.join(map(str, self.decode_s)) or '-'}"]
        if self.launches:
            parts.append(f"{self.specializations} kernel specializations of {self.kernels} kernels "
                         f"({self.launches} launches)")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a dependency, but progress must never be the reason a warm-up fails
        return None
    return tqdm(total=total, desc="warming up", unit="shape", leave=False, file=sys.stderr)


def _recorder(runner, execute: bool = True):
    """A launch recorder where the backend runs Triton kernels (None for one that cannot)."""
    if not hasattr(runner.ops, "kernel_dispatch"):
        return None
    return kernel_module("specialization").LaunchRecorder(execute=execute)


def warm_up(runner, progress: bool | None = None, record: bool = True) -> WarmupReport:
    """Run one prefill chunk per bucket of ``runner.prefiller`` and one decode step per batch tier of
    ``runner.decoder``, in the spare slot (reset afterwards); returns a :class:`WarmupReport`.

    ``progress``: a progress bar on stderr (default: when stderr is a terminal). ``record``: count the kernel
    specializations launched (with the Triton backend)."""
    if progress is None:
        progress = sys.stderr.isatty()
    report = WarmupReport(runner.prefill_path, runner.decode_path)
    if getattr(runner, "spare_slot", None) is None:
        report.note = "no spare cache slot (the model was not loaded with dsv4lab.load): nothing warmed up"
        return report
    prefiller, decoder = runner.prefiller, runner.decoder
    buckets = sorted(prefiller.buckets, reverse=True) if prefiller is not None else []  # the widest first: it
    # sizes the graphs' shared memory pool
    tiers = () if decoder is None else (getattr(decoder.graphs, "tiers", None) or tiers_for(runner.max_batch))
    notes = []
    if prefiller is None:
        notes.append("eager prefill path: prompt lengths are not bucketed, each new one may compile")
    if decoder is None:
        notes.append("eager decode path: not warmed up")
    bar = _progress(len(buckets) + len(tiers), progress)
    recorder = _recorder(runner) if record else None
    t_start = time.perf_counter()
    try:
        if recorder is not None:
            recorder.__enter__()
        work = [("prefill", c, report.prefill_s, prefiller.warm) for c in buckets]
        work += [("decode", b, report.decode_s, lambda b: _warm_decode(runner, b)) for b in tiers]
        for kind, size, seconds, run in work:
            if bar is not None:
                bar.set_postfix_str(f"{kind} {size}")
            keys, t0 = len(recorder.keys) if recorder is not None else 0, time.perf_counter()
            run(size)
            _sync(runner)
            seconds[size] = round(time.perf_counter() - t0, 3)
            if recorder is not None:
                report.new_specializations[f"{kind} {size}"] = len(recorder.keys) - keys
            if bar is not None:
                bar.update()
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)
        if bar is not None:
            bar.close()
    report.seconds = round(time.perf_counter() - t_start, 3)
    if recorder is not None:
        report.kernels, report.specializations = len(recorder.kernels), len(recorder.keys)
        report.launches = sum(recorder.keys.values())
    if prefiller is not None and prefiller.note:
        notes.append(f"prefill: {prefiller.note}")
    if runner.decode_note:
        notes.append(f"decode: {runner.decode_note}")
    report.note = "; ".join(notes)
    log.info("%s", report.describe())
    return report


def _warm_decode(runner, b: int) -> None:
    """One decode step of ``b`` rows in the spare slot (token 0 at position 0), through the decode path's own entry
    (on the graph path: the tier's capture, or the fallback to the static step where capture fails); then the
    spare slot is reset."""
    cpu = torch.zeros(b, dtype=torch.long)
    slots = torch.full((b,), runner.spare_slot, dtype=torch.long)
    runner.through_decoder(lambda d: d(cpu, cpu, slots), b)
    runner.model.reset(torch.tensor([runner.spare_slot], device=runner.device), runner.ops)


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


__all__ = ["WarmupReport", "warm_up"]
