"""The harness the kernel benchmark suites (:mod:`~dsv4lab.tools.bench.decode`, :mod:`~dsv4lab.tools.bench.prefill`) share.

* :class:`BenchRun` — the clock and the ``--budget-s`` watchdog, the rows / checks / errors / skipped lists of one
  run, its log, :meth:`~BenchRun.guard` (one failed piece is recorded, not fatal), :meth:`~BenchRun.check`
  against a reference with the tolerance policy of :mod:`dsv4lab.tools.verify.compare`, and the two timers;
  each suite subclasses it with its own row (``add``) and check-record schema.
* :func:`measure_ceilings` — device-to-device copy bandwidth, bf16 and FP8 8192³ matmul peaks, measured in the
  same run as the rows they divide.
* Random inputs at plausible magnitudes: :func:`random_bank`, :func:`random_routing`,
  :func:`random_fp8_linear`, :func:`materialize_random`.
* The driver's plumbing: :func:`select_device`, :func:`run_header`, :func:`output_path`, and
  :func:`~dsv4lab.core.provenance.write_json` (re-exported: the suites write their results through it).

Like the suites, it imports triton only inside the functions that need it (on a CPU, ``TRITON_INTERPRET`` must be
set before the first kernel module is imported).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dsv4lab.core.errors import UserError
from dsv4lab.core.model.linear import ExpertBank, Linear
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.engine.kernel_loader import PDL_ENV
from dsv4lab.core.provenance import short_commit, write_json  # noqa: F401 — write_json: the suites' result writer
from dsv4lab.tools.verify.compare import compare, tolerance

FLUSH_BYTES = 256 << 20  # written before a repetition to evict the previous one's operands (H200 L2: 60 MiB)
CEILING_COPY_BYTES = 1 << 30
CEILING_MATMUL_N = 8192
CEILING_TIMINGS = ("graph", "events")


class BenchRun:
    """Clock, watchdog, rows, checks, errors and timers of one benchmark run.

    A suite subclasses it with its name (``suite``), ``add`` (one timed row, in the suite's JSON row schema),
    :meth:`check_record` (one check, in the suite's check schema) and ``record_ceilings``.
    """

    suite = ""  # "decode", "prefill": the log prefix and the result file's ``suite``

    def __init__(self, device, budget_s: float, smoke: bool):
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.smoke = smoke
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.errors: list[str] = []
        self.skipped: list[str] = []
        self.peaks: dict = {}
        self.compile_s: dict[str, float] = {}  # first call (compile + run) of each name given to time_events_us
        self._flush = None

    # ---------------------------------------------------------------------------------------- clock and log
    def log(self, msg: str) -> None:
        print(f"[bench {self.suite}] {msg}", file=sys.stderr, flush=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self, what: str) -> bool:
        """True (and ``what`` recorded as skipped) once the run has used its ``--budget-s``."""
        if self.elapsed() > self.budget_s:
            self.skipped.append(what)
            self.log(f"budget reached: skipping {what}")
            return True
        return False

    def guard(self, what: str, fn):
        """Run one piece; an exception (e.g. a variant that does not compile here) is recorded, not fatal."""
        try:
            return fn()
        except Exception as err:  # noqa: BLE001 — one failed variant must not end the run
            msg = f"{what}: {type(err).__name__}: {' | '.join(str(err).splitlines())[:1500]}"
            self.errors.append(msg)
            self.log("ERROR " + msg)
            return None

    def run_sections(self, sections, after=None) -> None:
        """Run ``(name, fn)`` pieces in order under :meth:`guard`; the watchdog skips those past the budget, so
        the most important come first. ``after()`` runs after each piece that ran."""
        for name, fn in sections:
            if self.over_budget(name):
                continue
            self.log(f"{name} ({self.elapsed():.0f} s)")
            self.guard(name, fn)
            if after is not None:
                after()

    # ---------------------------------------------------------------------------------------- checks
    def check(self, name: str, out, ref, kind: str = "reduction", gating: bool = True) -> bool:
        """Compare ``out`` with ``ref`` under the bf16 tolerance of ``kind`` and record it; ``gating=False``
        records the result as information only."""
        c = compare(name, out, ref, tolerance(self.torch.bfloat16, kind))
        self.checks.append(self.check_record(c, gating))
        self.log(c.line() + ("" if gating else " (information)"))
        return c.ok

    def check_record(self, c, gating: bool) -> dict:
        """The JSON record of the comparison ``c`` (a :class:`~dsv4lab.tools.verify.compare.Comparison`)."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------- timers
    # Two timers, one per suite, because each suite's committed numbers were measured with its own: decode steps
    # run graph-replayed in production, so a decode kernel is timed without its Python launch cost (microseconds,
    # comparable to the kernel); a prefill kernel runs for milliseconds, launched eagerly, and is timed as such,
    # with its compile time recorded and optionally a cold L2.
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def time_graph_us(self, calls, replays: int = 7) -> float:
        """Median time per call (µs) of the callables ``calls`` run back to back, captured in one CUDA graph
        (without a GPU, or in a smoke run: one plain pass after a warm-up)."""
        torch = self.torch
        for c in calls:  # compile and warm up (also what graph capture needs: no first-time allocations)
            c()
        if not self.cuda or self.smoke:
            t = time.perf_counter()
            for c in calls:
                c()
            if self.cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t) / len(calls) * 1e6
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for c in calls:
                c()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / len(calls))
        del graph
        return statistics.median(times)

    def time_events_us(self, fn, name: str = "", reps: int | None = None, flush_l2: bool = False) -> float:
        """Median time of ``fn()`` in µs between CUDA events, launched eagerly; the first call compiles and is
        not timed (its duration goes to ``compile_s[name]``); ``flush_l2`` evicts L2 before every repetition.
        Without a GPU, or in a smoke run: the first call's own time (such a run checks the script, its times mean
        nothing — one call, not two, halves the interpreter's cost)."""
        torch = self.torch
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t
        if name and name not in self.compile_s:
            self.compile_s[name] = round(first, 3)
        if self.smoke or not self.cuda:
            return first * 1e6
        t = time.perf_counter()
        fn()
        self.sync()
        est = max(time.perf_counter() - t, 1e-6)
        reps = reps or int(min(30, max(3, 0.25 / est)))
        flush = self.l2_flush_buffer() if flush_l2 else None
        pairs = []
        for _ in range(reps):
            if flush is not None:
                flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
        self.sync()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3

    def l2_flush_buffer(self):
        """A device buffer larger than L2: ``zero_()`` on it evicts whatever a previous call left there."""
        if self._flush is None:
            self._flush = self.torch.empty(FLUSH_BYTES, dtype=self.torch.uint8, device=self.device)
        return self._flush


def pick_sections(spec: str | None, known: tuple[str, ...], default: tuple[str, ...]) -> tuple[str, ...]:
    """The sections a ``bench kernels`` run times, in ``known`` order: ``spec`` (comma-separated names), else
    ``default``; an unknown name is refused before any work, naming the known ones."""
    if not spec:
        return default
    names = {n.strip() for n in spec.split(",") if n.strip()}
    unknown = names - set(known)
    if unknown or not names:
        raise UserError(f"--sections {spec!r}: unknown {', '.join(sorted(unknown)) or 'empty list'}; "
                        f"known: {', '.join(known)}")
    return tuple(n for n in known if n in names)


# ============================================================================================ ceilings
def measure_ceilings(b: BenchRun, timing: str) -> dict:
    """``copy_gbps`` (device-to-device copy of 1 GiB, bytes read + written), ``bf16_tflops`` and ``fp8_tflops``
    (8192³ ``torch.mm`` and ``torch._scaled_mm`` with per-tensor scales) measured on this GPU; each ``None``
    without one.

    ``timing`` is the suite's: ``"graph"`` (decode) warms the clocks with 20 copies, takes the lower of the
    median of 10 event-timed copies and a graph-replayed batch of 4, and graph-replays the matmuls;
    ``"events"`` (prefill) takes :meth:`BenchRun.time_events_us` of each (10 repetitions after a compile call).
    Both are kept because every committed row's percentage is relative to the ceiling its suite measured this
    way; a suite that switched would shift its percentages without any kernel changing.
    """
    if timing not in CEILING_TIMINGS:
        raise ValueError(f"ceiling timing {timing!r}: expected one of {', '.join(CEILING_TIMINGS)}")
    out = dict(copy_gbps=None, bf16_tflops=None, fp8_tflops=None)
    if not b.cuda:
        return out
    torch = b.torch

    def time_us(fn, graph_calls: int = 3, graph_replays: int = 3) -> float:
        """The suite's timer: ``graph_calls`` back-to-back calls replayed ``graph_replays`` times, or events."""
        if timing == "graph":
            return b.time_graph_us([fn] * graph_calls, replays=graph_replays)
        return b.time_events_us(fn, reps=10)

    src = torch.empty(CEILING_COPY_BYTES, dtype=torch.uint8, device=b.device)  # a same-dtype copy is a memcpy
    dst = torch.empty_like(src)
    if timing == "graph":
        t = min(median_copy_us(src, dst), time_us(lambda: dst.copy_(src), 4, 5))
    else:
        t = time_us(lambda: dst.copy_(src))
    out["copy_gbps"] = round(2 * CEILING_COPY_BYTES / (t * 1e-6) / 1e9, 1)
    del src, dst
    n = CEILING_MATMUL_N
    x = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=b.device, dtype=torch.bfloat16)
    mm_out = torch.empty(n, n, device=b.device, dtype=torch.bfloat16)
    t = time_us(lambda: torch.mm(x, y, out=mm_out))
    out["bf16_tflops"] = round(2 * n ** 3 / (t * 1e-6) / 1e12, 1)
    x8, y8 = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn)
    one = torch.ones((), device=b.device)
    t = time_us(lambda: torch._scaled_mm(x8, y8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    out["fp8_tflops"] = round(2 * n ** 3 / (t * 1e-6) / 1e12, 1)
    b.log(f"ceilings: copy {out['copy_gbps']} GB/s, bf16 {out['bf16_tflops']} TFLOP/s, "
          f"fp8 {out['fp8_tflops']} TFLOP/s")
    return out


def median_copy_us(src, dst) -> float:
    """Median of 10 event-timed copies ``dst ← src`` on the GPU after 20 that bring the clocks up."""
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def clock_us(step, device, reps: int) -> float:
    """CUDA-event µs of one call of ``step`` (the mean of ``reps`` back to back)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize(device)
    return round(start.elapsed_time(end) * 1e3 / reps, 1)


# ============================================================================================ inputs
def random_bank(n_experts: int, dim: int, inter: int, device, gen):
    """A routed-expert bank with uniformly random E2M1 codes and 1×32 E8M0 scales 2^-10 … 2^-6 (within the fp8
    route's exact upcast window)."""
    bank = ExpertBank(n_experts, dim, inter, "fp4")
    for name, (n, k) in (("w1", (inter, dim)), ("w3", (inter, dim)), ("w2", (dim, inter))):
        bank._buffers[name] = torch.randint(-128, 128, (n_experts, n, k // 2), dtype=torch.int8, device=device,
                                            generator=gen)
        bank._buffers[name + "_scale"] = torch.randint(117, 122, (n_experts, n, k // 32), dtype=torch.uint8,
                                                       device=device, generator=gen).view(torch.float8_e8m0fnu)
    return bank


def random_routing(T: int, n_experts: int, k: int, device, gen):
    """Uniformly random distinct top-k experts per token and renormalised weights (fp32)."""
    idx = torch.rand(T, n_experts, device=device, generator=gen).topk(k, dim=-1).indices
    w = torch.rand(T, k, device=device, generator=gen) + 0.1
    return idx, (w / w.sum(-1, keepdim=True) * 1.5).float()


def random_fp8_linear(n: int, k: int, device, gen, act_quant: bool = True):
    """An FP8 ``Linear`` (``k`` → ``n``) with random E4M3 weights and 128×128 E8M0 block scales 2^-15 … 2^-12."""
    lin = Linear(k, n, "fp8", act_quant=act_quant)
    w = torch.randn(n, k, device=device, generator=gen) * 64
    lin._buffers["weight"] = w.clamp(-448, 448).to(torch.float8_e4m3fn)
    lin._buffers["scale"] = torch.randint(112, 116, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, device=device,
                                          generator=gen).view(torch.float8_e8m0fnu)
    return lin


def materialize_random(module, device, gen) -> None:
    """Fill every meta buffer of ``module`` with random values of its dtype at plausible magnitudes."""
    for mod_name, mod in module.named_modules():
        for name, buf in list(mod._buffers.items()):
            if buf is None or buf.device.type != "meta":
                continue
            full = f"{mod_name}.{name}"
            shape, dt = tuple(buf.shape), buf.dtype
            if dt == torch.int8:  # packed E2M1
                t = torch.randint(-128, 128, shape, dtype=torch.int8, device=device, generator=gen)
            elif dt == torch.float8_e8m0fnu:  # FP4 expert scales per 32, FP8 weight scales per 128×128 block
                lo = 117 if isinstance(mod, ExpertBank) else 112
                t = torch.randint(lo, lo + 4, shape, dtype=torch.uint8, device=device, generator=gen)
                t = t.view(torch.float8_e8m0fnu)
            elif dt == torch.float8_e4m3fn:
                t = (torch.randn(shape, device=device, generator=gen) * 64).clamp(-448, 448).to(dt)
            elif dt == torch.int64:  # tid2eid
                t = torch.randint(0, 1, shape, dtype=dt, device=device)
            elif "norm" in full:
                t = torch.ones(shape, dtype=dt, device=device)
            elif name.startswith("hc_") and name.endswith("_scale"):
                t = torch.rand(shape, device=device, generator=gen).to(dt) + 0.5
            elif name.startswith("hc_") and name.endswith("_base"):
                t = (torch.randn(shape, device=device, generator=gen) * 0.5).to(dt)
            else:  # projections (bf16 / f32), hc fn, sink, ape, router bias
                fan_in = shape[-1] if len(shape) > 1 else 1
                t = (torch.randn(shape, device=device, generator=gen) * fan_in ** -0.5).to(dt)
            mod._buffers[name] = t


# ============================================================================================ driver
def select_device(suite: str, smoke: bool):
    """The GPU, or the CPU for a ``--smoke`` run (a clear error otherwise)."""
    if not torch.cuda.is_available() and not smoke:
        raise UserError(f"bench kernels --suite {suite} needs a GPU (use --smoke to check the script on a CPU)")
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_header(b: BenchRun, args, smoke: bool) -> dict:
    """The fields every result file starts with: suite, GPU, versions, commit, model, smoke."""
    import triton
    return dict(suite=b.suite, gpu=torch.cuda.get_device_name() if b.cuda else "CPU (Triton interpreter)",
                torch=torch.__version__, triton=triton.__version__,
                commit=getattr(args, "commit", None) or short_commit(),
                model="tiny" if smoke else "flash", smoke=smoke)


def output_path(args, suite: str) -> Path:
    """``--out``, or ``runs/bench/<suite>_kernels.json``; its folder is created."""
    out = Path(args.out) if getattr(args, "out", None) else Path(f"runs/bench/{suite}_kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


# The backend ops a forward calls (``ReferenceOps``' public methods, less the helpers that are not kernels).
OP_NAMES = tuple(n for n, v in vars(ReferenceOps).items() if callable(v) and not n.startswith("_")
                 and n not in ("elementwise", "compressed_rope_position", "reset_compressor_state"))


class OpTimer:
    """Times every call of the named ops of an ops object: CUDA events on a GPU (read after a synchronize), the
    host clock on a CPU. Only outermost calls are timed — an op called inside another (a composite's parts) counts
    in its caller's time — so the ops' sum and the forward's time differ by the torch glue between them.

        with OpTimer(runner.ops, OP_NAMES, cuda=True) as timer:
            runner.forward(...)
        torch.cuda.synchronize(); timer.totals_us()
    """

    def __init__(self, ops, names=OP_NAMES, cuda: bool = True):
        self.ops, self.names, self.cuda = ops, tuple(n for n in names if hasattr(ops, n)), cuda
        self.events: dict[str, list] = {}
        self.depth = 0
        self._saved: dict[str, object] = {}

    def install(self) -> "OpTimer":
        for name in self.names:
            self._saved[name] = self.ops.__dict__.get(name, _UNSET)  # an instance attribute to put back, or none
            setattr(self.ops, name, self._wrap(name, getattr(self.ops, name)))
        return self

    def remove(self) -> None:
        for name, saved in self._saved.items():
            if saved is _UNSET:
                delattr(self.ops, name)
            else:
                setattr(self.ops, name, saved)
        self._saved.clear()

    def __enter__(self) -> "OpTimer":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def clear(self) -> None:
        self.events.clear()

    def totals_us(self) -> dict[str, float]:
        """µs per op name, summed over its calls (call after the device is synchronised)."""
        if self.cuda:
            return {k: sum(s.elapsed_time(e) for s, e in v) * 1e3 for k, v in self.events.items()}
        return {k: sum(v) * 1e6 for k, v in self.events.items()}

    def _wrap(self, name, fn):
        def run(*xs, **kw):
            outer = self.depth == 0
            self.depth += 1
            try:
                if not outer:
                    return fn(*xs, **kw)
                if self.cuda:
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    r = fn(*xs, **kw)
                    e.record()
                    self.events.setdefault(name, []).append((s, e))
                    return r
                t = time.perf_counter()
                r = fn(*xs, **kw)
                self.events.setdefault(name, []).append(time.perf_counter() - t)
                return r
            finally:
                self.depth -= 1
        return run


_UNSET = object()


# Substrings of GPU kernel names → the op family a profile is summarised by (first match wins).
KERNEL_FAMILIES = (("_gate_up_kernel", "moe_gate_up"), ("_down_kernel", "moe_down"), ("_fp8_gemv", "gemv"),
                   ("_moe_up_kernel", "moe_gate_up"), ("_moe_down", "moe_down"), ("_moe_combine", "moe_down"),
                   ("_moe_output", "moe_down"),  # routed + shared experts, rounded to act (the step's MoE output)
                   ("_act_quant_kernel", "gemv"),
                   ("_sum_partials", "split_sums"), ("_attn", "attention"), ("sort", "sort/topk"),
                   ("nccl", "collectives"), ("all_reduce", "collectives"), ("gemm", "cublas"),
                   ("nvjet", "cublas"),  # cuBLASLt's Hopper kernels (nvjet_*): the LM head, cuBLAS-dispatched GEMVs
                   ("reduce", "torch_reduce"), ("elementwise", "torch_elementwise"))


# the glue kernels' families (kernels/*.py), ahead of the generic ones above
GLUE_FAMILIES = (("_mhc", "mhc"), ("_rms_norm", "norm_rope"), ("_head_rms_rope", "norm_rope"),
                 ("_kv_norm_rope", "norm_rope"), ("_indexer_query", "indexer"), ("_indexer_select", "indexer"),
                 ("_compressor_step", "compressor"), ("_router", "router"))


def _device_kernels(prof):
    """``(name, family, GPU µs in all, launches)`` of every event of a ``torch.profiler`` run that took GPU time,
    by the glue's families, then :data:`~dsv4lab.tools.bench.common.KERNEL_FAMILIES`."""
    for ev in prof.key_averages():
        t = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if t:
            yield ev.key, next((f for key, f in GLUE_FAMILIES + KERNEL_FAMILIES if key in ev.key), "other"), t, ev.count


def kernel_profile(prof, calls: int) -> tuple[dict[str, float], dict[str, float]]:
    """GPU µs and kernel launches per call of a ``torch.profiler`` run of ``calls`` calls, by kernel family."""
    us: dict[str, float] = {}
    launches: dict[str, float] = {}
    for _, fam, t, count in _device_kernels(prof):
        us[fam] = us.get(fam, 0.0) + t / calls
        launches[fam] = launches.get(fam, 0.0) + count / calls
    order = sorted(us, key=lambda k: -us[k])
    return {k: round(us[k], 1) for k in order}, {k: round(launches[k], 1) for k in order}


@contextlib.contextmanager
def pdl_off():
    """Kernels launched — and graphs captured — without programmatic dependent launch inside the block. Under PDL a
    kernel starts while its predecessor runs and waits inside (griddepcontrol.wait), so profiled kernel durations
    overlap and sum past the step: a per-kernel profile is taken from a step captured without it."""
    before = os.environ.get(PDL_ENV)
    os.environ[PDL_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[PDL_ENV]
        else:
            os.environ[PDL_ENV] = before


def profiled(fn, device, reps: int = 3):
    """``fn`` (warmed by the caller) run ``reps`` times under ``torch.profiler``: the profile and its call count
    (for :func:`kernel_profile` and :func:`top_kernels`)."""
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(device)
    return prof, reps


def top_kernels(prof, calls: int, n: int = 40) -> list[dict]:
    """The ``n`` kernels with the most GPU time per call of a ``torch.profiler`` run: name (first 100 characters),
    family, µs and launches per call, µs per launch — what a family total (and ``other``) is made of."""
    rows = [dict(name=name[:100], family=fam, us=round(t / calls, 1), launches=round(count / calls, 1),
                 us_per_launch=round(t / max(count, 1), 2)) for name, fam, t, count in _device_kernels(prof)]
    return sorted(rows, key=lambda r: -r["us"])[:n]


def kernel_families(prof, calls: int) -> dict[str, float]:
    """GPU time per call (µs) of a ``torch.profiler`` run of ``calls`` calls, by family (:func:`kernel_profile`)."""
    return kernel_profile(prof, calls)[0]


# dispatched torch ops that launch no kernel (allocation, aliasing, host reads)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_local_scalar_dense", "set_", "resize_"}


# dispatched torch ops a dry count (count_launches(..., execute=False)) evaluates on the meta device: the products
# (cuBLAS on a GPU; a CPU has no block-scaled FP8 GEMM), whose values nothing of a dry run reads
_PRODUCTS = {"_scaled_mm", "mm", "addmm", "bmm", "matmul", "einsum"}


def _on_meta(func, args, kwargs):
    """``func``'s result computed on the meta device, as empty tensors of the same shapes on the inputs' device."""
    def meta(v):
        return v.to("meta") if isinstance(v, torch.Tensor) else v
    device = next(v.device for v in args if isinstance(v, torch.Tensor))
    out = func(*[meta(v) for v in args], **{k: meta(v) for k, v in (kwargs or {}).items()})
    return torch.empty(out.shape, dtype=out.dtype, device=device)


def count_launches(fn, execute: bool = True):
    """Run ``fn()`` counting Triton kernel launches and dispatched torch ops that launch a kernel (views,
    allocations and host reads excluded) — on a GPU, the kernels of what ``fn`` runs. Works on a CPU (the
    interpreter's launches are counted the same way). Returns ``(counts, fn's result)`` with ``counts`` =
    ``{triton, torch, triton_kernels: Counter, torch_ops: Counter}``.

    ``execute=False`` counts without computing: the Triton launches are counted and skipped (their outputs stay
    as allocated) and the products (:data:`_PRODUCTS`) are shaped on the meta device — for code whose launches
    depend on shapes and dispatch choices, never on values (the decode step: no host syncs, no data-dependent
    shapes), at widths a CPU cannot compute in useful time (``scripts/count_decode_launches.py``)."""

    import triton.runtime.jit as jit
    counts = dict(triton=0, torch=0, triton_kernels=Counter(), torch_ops=Counter())

    class _TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not func.is_view and name not in _NO_KERNEL:
                counts["torch"] += 1
                counts["torch_ops"][name] += 1
                if not execute and name in _PRODUCTS:
                    return _on_meta(func, args, kwargs)
            return func(*args, **(kwargs or {}))

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    originals = {cls: cls.run for cls in classes}

    def counted(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                counts["triton"] += 1
                counts["triton_kernels"][getattr(self, "__name__", "kernel")] += 1
            if not execute:
                return None
            with _disable_current_modes():  # the launch's own host-side tensor handling is not the step's
                return original(self, *args, **kwargs)
        return run

    for cls, original in originals.items():
        cls.run = counted(original)
    try:
        with _TorchOps():
            out = fn()
    finally:
        for cls, original in originals.items():
            cls.run = original
    return counts, out
