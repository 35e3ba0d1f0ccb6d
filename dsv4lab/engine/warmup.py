"""Warm-up: compile every kernel a prompt can need before the first request, not on its path.

A Triton kernel compiles once per specialization (``kernels/dsv4lab_kernels/specialization.py`` says what that key
holds); the first prompt that needs a key it has not seen waits for the compiler. The engine's paths bound the keys:

* **prefill** (:mod:`dsv4lab.engine.prefill_step`): every chunk runs at one of the runner's buckets with shapes
  that depend on the bucket alone, so one chunk per bucket launches every key any prompt length will;
* **decode** (:mod:`dsv4lab.engine.decode_graph`): one step per batch tier (a batch between tiers is padded to the
  next on the graph path);
* **speculative decoding** (``draft_tokens = k ≥ 1``, :mod:`dsv4lab.engine.speculative`): its prefill runs the same
  buckets with the MTP block inside the step (:class:`~dsv4lab.engine.prefill_step.PrefillGraphs` key ``("mtp",
  bucket)``), a one-token chunk the decode step (``"tokens T1"``) then the MTP step (``"mtp"``), and each cycle is
  one static function of ``K`` drafts (:func:`~dsv4lab.engine.speculative_step.run_cycle`, key ``("speculative
  K{K}", tier)``: the draft chain, the ``(K+1)``-token verify step with the MTP block and the MTP step at the last
  accepted position all inside it), where ``K`` is any of ``1 … k`` — a decoder drafts fewer near the end of a
  budget or of the cache. Those are every key a speculative request creates on the static paths.

:func:`warm_up` runs exactly that — one prefill chunk per bucket (on the graph path: its capture) and one decode step
per tier (its capture), and with ``draft_tokens = k`` also each bucket's chunk with the MTP block and, per tier, the
one-token chunk with the MTP block and one cycle of each ``K ≤ k`` — all in the runner's spare cache slot, which is
reset after each (main and MTP caches; a cycle's rollback snapshot is its own temporary), so no sequence is touched —
with a progress bar, and reports the seconds of each and, with the Triton backend, the distinct kernel
specializations it launched (every binary the compiler had to build, or found in its cache). ``load(...,
warmup=True)``, ``generate --warmup``, ``bench e2e`` (its first-prompt row; plain decoding's parts only) and
``serve`` on a GPU call it; ``generate`` and ``serve`` started with ``--speculative mtp`` pass their
``--draft-tokens``.

Not covered (they compile at first use): the eager per-op paths (``prefill_path="eager"`` — a CPU, tracing,
verification, prompt logprobs (``logits="all"``, speculative requests included) — and ``decode_path="eager"``,
where speculation's cycles run the eager forward too), teacher-forced speculative cycles (verification only), and on
the static decode path a batch size that is not a tier.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from dsv4lab.engine.decode_graph import tiers_for
from dsv4lab.engine.kernel_loader import kernel_module
from dsv4lab.engine.speculative import check_draft_tokens
from dsv4lab.engine.speculative_step import run_cycle

log = logging.getLogger("dsv4lab.warmup")


@dataclass
class WarmupReport:
    """What :func:`warm_up` did.

    Attributes:
        prefill_path, decode_path: the runner's paths.
        prefill_s: seconds per bucket (its first chunk, or capture on the graph path).
        decode_s: seconds per batch tier.
        draft_tokens: the speculative drafts warmed up for (0: none).
        prefill_mtp_s: seconds per bucket of the chunk with the MTP block (speculation's prefill).
        speculative_s: seconds per batch tier of speculation's decode-path work: the one-token chunk with the MTP
            block and one cycle of each draft count ``1 … draft_tokens``.
        seconds: the whole warm-up.
        kernels: distinct Triton kernels launched (0 for the reference backend).
        specializations: distinct launch keys — the binaries compiled (or read from Triton's cache).
        new_specializations: per part (``prefill <bucket>``, ``prefill mtp <bucket>``, ``decode <tier>``,
            ``speculative <tier>``, in the order run), the keys it launched that no part before it had: what each
            bucket or tier adds to the compile cost.
        launches: kernel launches recorded.
        note: why a part was skipped or ran without graphs, if it did.
    """

    prefill_path: str
    decode_path: str
    prefill_s: dict[int, float] = field(default_factory=dict)
    decode_s: dict[int, float] = field(default_factory=dict)
    draft_tokens: int = 0
    prefill_mtp_s: dict[int, float] = field(default_factory=dict)
    speculative_s: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    kernels: int = 0
    specializations: int = 0
    new_specializations: dict[str, int] = field(default_factory=dict)
    launches: int = 0
    note: str = ""

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("prefill_s", "decode_s", "prefill_mtp_s", "speculative_s"):
            d[name] = {str(k): v for k, v in getattr(self, name).items()}
        return d

    def describe(self) -> str:
        parts = [f"warm-up {self.seconds:.1f} s: prefill ({self.prefill_path}) "
                 f"{len(self.prefill_s)} bucket(s) {', '.join(map(str, self.prefill_s)) or '-'}; decode "
                 f"({self.decode_path}) tier(s) {', '.join(map(str, self.decode_s)) or '-'}"]
        if self.draft_tokens:
            parts.append(f"speculation ({self.draft_tokens} draft(s)): prefill with the MTP block "
                         f"{len(self.prefill_mtp_s)} bucket(s) "
                         f"{sum(self.prefill_mtp_s.values()):.1f} s, cycles of 1…{self.draft_tokens} draft(s) at "
                         f"tier(s) {', '.join(map(str, self.speculative_s)) or '-'} "
                         f"{sum(self.speculative_s.values()):.1f} s")
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


def warm_up(runner, progress: bool | None = None, record: bool = True, draft_tokens: int = 0) -> WarmupReport:
    """Run one prefill chunk per bucket of ``runner.prefiller`` and one decode step per batch tier of
    ``runner.decoder``, in the spare slot (reset afterwards); returns a :class:`WarmupReport`.

    ``draft_tokens``: also warm up speculative decoding of up to that many drafts per cycle (0: no speculation;
    ``--speculative mtp --draft-tokens k`` passes ``k``) — each bucket's chunk with the MTP block and, per tier,
    what :class:`~dsv4lab.engine.speculative.SpeculativeDecoder` runs on the static decode path (the module doc).
    A model without an MTP block, or ``draft_tokens`` above what it allows, is a one-line ``ValueError`` before
    anything runs. ``progress``: a progress bar on stderr (default: when stderr is a terminal). ``record``: count
    the kernel specializations launched (with the Triton backend)."""
    if draft_tokens:
        check_draft_tokens(runner, draft_tokens)
    if progress is None:
        progress = sys.stderr.isatty()
    report = WarmupReport(runner.prefill_path, runner.decode_path, draft_tokens=draft_tokens)
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
    work = []  # (part, size, where its seconds go, what it runs): a bucket's MTP form right after its plain one
    for c in buckets:
        work.append(("prefill", c, report.prefill_s, prefiller.warm))
        if draft_tokens:
            work.append(("prefill mtp", c, report.prefill_mtp_s, lambda c: prefiller.warm(c, mtp=True)))
    for b in tiers:
        work.append(("decode", b, report.decode_s, lambda b: _warm_decode(runner, b)))
        if draft_tokens:
            work.append(("speculative", b, report.speculative_s, lambda b: _warm_speculative(runner, b, draft_tokens)))
    bar = _progress(len(work), progress)
    recorder = _recorder(runner) if record else None
    t_start = time.perf_counter()
    try:
        if recorder is not None:
            recorder.__enter__()
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
    graphs = getattr(runner.decoder, "graphs", None)
    if graphs is not None and graphs.uncaptured:  # such a step runs eagerly on every request: compiled, not captured
        notes.append("not captured (run eagerly): " + ", ".join(f"{k} b{t}" for k, t in graphs.uncaptured))
    report.note = "; ".join(notes)
    log.info("%s", report.describe())
    return report


def _spare_rows(runner, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` rows of token 0 at position 0, all in the spare slot: ``(zeros [b], slots [b])`` on the host."""
    return torch.zeros(b, dtype=torch.long), torch.full((b,), runner.spare_slot, dtype=torch.long)


def _reset_spare(runner) -> None:
    runner.model.reset(torch.tensor([runner.spare_slot], device=runner.device), runner.ops)


def _warm_decode(runner, b: int) -> None:
    """One decode step of ``b`` rows in the spare slot (token 0 at position 0), through the decode path's own entry
    (on the graph path: the tier's capture, or the fallback to the static step where capture fails); then the
    spare slot is reset."""
    cpu, slots = _spare_rows(runner, b)
    runner.through_decoder(lambda d: d(cpu, cpu, slots), b)
    _reset_spare(runner)


@torch.inference_mode()
def _warm_speculative(runner, b: int, draft_tokens: int) -> None:
    """Speculation's work at a batch of ``b`` rows on the static decode path, in the spare slot (reset after each
    call): a one-token prefill chunk with the MTP block (``ModelRunner.forward``'s own call: the decode step's
    ``"tokens T1"`` and the MTP step's ``"mtp"``), then one cycle of each draft count ``K = 1 … draft_tokens``
    (``"speculative K{K}"``) with every row verifying all ``K`` drafts — through the same entries as
    :class:`~dsv4lab.engine.speculative.SpeculativeDecoder` (on the graph path: their captures)."""
    zeros, slots = _spare_rows(runner, b)
    runner._mtp_decode(zeros, zeros, slots, None)
    _reset_spare(runner)
    a = runner.args
    # the MTP block's output streams: the dtype speculation's prefill and cycles hand on (a graph's input buffer
    # takes the dtype of the call that captured it)
    streams = torch.zeros(b, a.hc_mult, a.dim, dtype=runner.ops.numerics.act)
    cycles: dict = {}
    for K in range(1, draft_tokens + 1):
        run_cycle(runner.decoder, cycles, zeros, zeros, streams, zeros, torch.full((b,), K), slots,
                  torch.full((b, K), -1))
        _reset_spare(runner)


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


__all__ = ["WarmupReport", "warm_up"]
