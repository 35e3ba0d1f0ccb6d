"""Shared fixtures. Triton's interpreter must be selected before any kernel module is imported."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


if not _has_gpu():  # on a CPU the Triton kernels run in the interpreter; on a GPU they are compiled
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _list_the_interpreters_builtins_once() -> None:
    """Triton's interpreter (3.9) swaps ``triton.language``'s builtins for interpreted ones at every launch and at
    every call of a nested ``@triton.jit`` function, each time listing the modules' members with
    ``inspect.getmembers`` (a quarter of the interpreter's time in this suite). The builtins of those modules never
    change: list them once, before any launch, and patch exactly the ones the original would (those not yet patched).
    Checked equal: the Triton stage replay of a model gives the same report, value for value. Another Triton, or a
    module not listed here, keeps the original function."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_builtin", None)
    if (original is None or not hasattr(interpreter, "_patch_attr")
            or list(inspect.signature(original).parameters) != ["pkg", "builder", "scope"]):
        return
    listed = {id(pkg): [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
              for pkg in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)}

    def patch_builtin(pkg, builder, scope):
        names = listed.get(id(pkg))
        if names is None:
            return original(pkg, builder, scope)
        if names and not tl.core.is_builtin(getattr(pkg, names[0])) and not tl.core.is_builtin(getattr(pkg, names[-1])):
            return  # patched already (a nested call inside a launch): a module is patched and restored all at once
        for name in names:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


def _source_digest(fn) -> str:
    import hashlib
    import inspect
    try:
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        return ""


def _map_the_interpreters_dtypes_once() -> None:
    """Two more per-call costs of Triton's interpreter (3.9) that depend on nothing that changes: ``_get_np_dtype``
    builds its 18-entry table of dtypes (each key hashed) at every call — ~300,000 calls in one stage replay — and
    ``_patch_lang`` lists a kernel's globals (``inspect.ismodule`` on each) at every launch and every nested
    ``@triton.jit`` call to find ``triton.language``. Here the table is built once and the globals are scanned by
    identity; the same dtypes and the same modules come out (modules compare by identity), so every value the
    interpreter computes is unchanged (the MoE decode kernels' outputs checked bit for bit). Measured: the MoE
    decode kernels −20% CPU time, whole kernel test files −5 to −10%. Another Triton (functions of other source)
    keeps the originals."""
    import numpy as np
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    get_np_dtype, patch_lang = getattr(interpreter, "_get_np_dtype", None), getattr(interpreter, "_patch_lang", None)
    if get_np_dtype is None or patch_lang is None:
        return
    try:
        table = {ty: get_np_dtype(ty) for ty in (
            tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
            tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8,
            tl.float8e4b15)}
    except (AttributeError, KeyError):
        return
    if len(table) != 18 or _source_digest(get_np_dtype) != "8f20d41e3207891a" or (
            _source_digest(patch_lang) != "e5beeba74ada4829"):
        return  # another Triton: its functions are not the ones written out here
    pointer, block, uint64 = tl.pointer_type, tl.block_type, np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return uint64
        if isinstance(tt_dtype, block):
            if isinstance(tt_dtype.element_ty, pointer):
                return uint64
            return table[tt_dtype.element_ty]
        return table[tt_dtype]

    builder, scope_class = interpreter.interpreter_builder, interpreter._LangPatchScope

    def patch_lang(fn):  # the original's body, with the lookup of triton.language by identity
        scope = scope_class()
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        assert len(langs) >= 1, "triton.language must be visible from within jit'd function"
        for lang in langs:
            interpreter._patch_builtin(lang, builder, scope)
            interpreter._patch_builtin(lang.tensor, builder, scope)
            if lang == tl:
                interpreter._patch_builtin(lang.math, builder, scope)
            interpreter._patch_lang_tensor(lang.tensor, scope)
            interpreter._patch_lang_core(lang, scope)
        interpreter._patch_builtin(tl.core.tensor_descriptor_base, builder, scope)
        return scope

    interpreter._get_np_dtype = np_dtype
    interpreter._patch_lang = patch_lang


def _skip_the_interpreters_dead_overflow_checks() -> None:
    """Triton's interpreter (3.9) builds, for every int32 add, sub and mul, the operation again in int64 and the
    comparisons with the int32 range (six more interpreted ops) for ``device_assert``, which does nothing unless
    ``debug`` is set (and the interpreter's options never set it): the result of that work is thrown away. A GPU
    compile emits the same unused ops and its dead-code elimination drops them; the interpreter runs each one.
    With ``sanitize_overflow`` off in the interpreter's options they are not built, so no value and no check
    changes (with ``debug`` on, or another Triton whose assert and check are not these, nothing is touched: the
    assert would then be real). Measured in this suite: a third of the interpreter's time in index-heavy kernels
    (the prefill chunk of tiny-py, the MoE decode stages)."""
    import dataclasses
    try:
        from triton.language.semantic import TritonSemantic
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if options is None or getattr(options, "debug", True) or not getattr(options, "sanitize_overflow", False):
        return
    if (_source_digest(TritonSemantic.device_assert) != "361fee05925913d2"
            or _source_digest(TritonSemantic.binary_op_sanitize_overflow_impl) != "bdd7f3e24aa645ab"):
        return  # another Triton: its assert may do something without debug; keep its checks
    builder.options = dataclasses.replace(options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _list_the_interpreters_builtins_once()
    _map_the_interpreters_dtypes_once()
    _skip_the_interpreters_dead_overflow_checks()

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "data" / "tiny"


def pytest_configure(config):
    # Under pytest-xdist (make test runs one worker per core) each worker gets its share of the cores: torch's
    # default of one thread per core in every worker would oversubscribe the machine several times over.
    # The subprocesses a test starts (CLI runs, notebook kernels, torchrun ranks) get the same share through
    # OMP_NUM_THREADS: with torch's default they spin one OpenMP thread per core against the other worker, and a
    # 12-token `generate` took 17 s instead of 5 s on a loaded 2-core machine.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    # the long tests first (stable otherwise): under pytest-xdist the last tests handed out decide how long one
    # worker idles while the other finishes, so a long test must not be among them. Long: marked slow, or a
    # browser, notebook or multi-process run (10-35 s each on the CI machine). `make test` hands tests out two at a
    # time (--maxschedchunk 2), so the long ones alternate between the workers. The browser tests, the longest, go
    # first of all: xdist's first hand-out gives the first two tests to one worker, and those two (test_browser's
    # interactive ones, next to each other) share that worker's JupyterLab.
    long = ("slow", "browser", "notebooks", "distributed")
    items.sort(key=lambda item: 0 if "browser" in item.keywords else 1 if any(m in item.keywords for m in long) else 2)
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA/ROCm GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    return TINY


@pytest.fixture(scope="session")
def layer_cut(tmp_path_factory):
    """``layer_cut("tiny-py")``: a copy of ``data/<name>`` with only its first three main layers (SWA, CSA with the
    indexer, HCA; the first two hash-routed, the third score-routed) and its MTP block — every tensor byte, width
    and shape as in the original. For whole-model runs in the Triton interpreter, whose cost is per layer: the six
    layers of the tiny models repeat these three kinds with the same shapes (written once per session, ~0.1 s)."""
    from dsv4lab.core.checkpoint import Checkpoint, expected_tensors, write_state_dict
    from dsv4lab.tools.bench.e2e import cut_layers
    folder = tmp_path_factory.mktemp("layer_cuts")
    made: dict[str, Path] = {}

    def cut(name: str) -> Path:
        if name not in made:
            src = ROOT / "data" / name
            ck = Checkpoint(src)
            args = cut_layers(ck.args, 3)
            assert [args.layer_kind(i) for i in range(3)] == ["swa", "csa", "hca"] and args.n_hash_layers == 2
            extra = {f: src / f for f in ("tokenizer.json", "oracles.json") if (src / f).exists()}
            made[name] = write_state_dict(folder / name, args, {s.name: ck.get(s.name) for s in expected_tensors(args)},
                                          extra_files=extra)
        return made[name]
    return cut


def once_per_run(tmp_path_factory, name: str, produce):
    """``produce(folder)``, computed once per pytest run also under pytest-xdist, for a module fixture that each
    worker would compute again: the first worker to ask computes it in a folder of the run's shared temporary
    directory while holding a lock, the others wait for it and read its value (pickled beside it). Without
    xdist, ``produce`` of a fresh folder of this session's."""
    import fcntl
    import pickle
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return produce(tmp_path_factory.mktemp(name))
    folder = tmp_path_factory.getbasetemp().parent / f"once-{name}"  # the workers' basetemps' parent: this run's
    with open(f"{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        done = folder / "value.pickle"
        if not done.exists():
            folder.mkdir(exist_ok=True)
            value = produce(folder)
            done.write_bytes(pickle.dumps(value))
        return pickle.loads(done.read_bytes())


_mhc_bounds: dict = {}
MHC_BOUNDED_ONCE = ("hc_pre", "hc_pre_norm", "hc_post_pre_norm")  # their arguments: tensors and the ModelArgs


@pytest.fixture(scope="session", autouse=True)
def _each_mhc_bound_once():
    """The stage tier's bound of an mHC call (its Sinkhorn first-order bound: 16 backward passes, ~90% of the time
    of a stage replay on the reference) is a function of the call's inputs, the numerics, the accumulation model
    and the bound function alone: computed once per identical set of these per session. Replays of one recording
    against several backends, and verify_model runs of one checkpoint (or of faulted copies that agree up to a
    layer), bound each mHC call once; every output is still judged by its bound. Keyed by the inputs' bytes, so a
    call on other inputs, or a test's own bound function, is bounded afresh."""
    import hashlib

    import torch
    from dsv4lab.core.config import ModelArgs
    from dsv4lab.tools.verify import stages
    compute = stages.bound_of

    def identity(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy()
            return ("tensor", str(t.dtype), tuple(t.shape), hashlib.blake2b(raw).hexdigest())
        if isinstance(v, ModelArgs):
            return ("args", repr(v))
        raise TypeError(type(v).__name__)

    def bound_once(call, numerics, acc):
        if call.op not in MHC_BOUNDED_ONCE or call.state or call.kwargs:
            return compute(call, numerics, acc)
        try:
            key = (call.op, stages.OP_BOUNDS[call.op], numerics, acc, tuple(identity(a) for a in call.args))
        except (TypeError, KeyError, RuntimeError):  # an argument of another kind: bounded as the tier bounds it
            return compute(call, numerics, acc)
        if key not in _mhc_bounds:
            _mhc_bounds[key] = compute(call, numerics, acc)
        return _mhc_bounds[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stages, "bound_of", bound_once)
        yield


@pytest.fixture(autouse=True)
def _gpu_counters_left_at_zero(request):
    """After every GPU test: each ticket counter (split-K GEMV, attention combine, mHC site:
    ``kernels/dsv4lab_kernels/tickets.py``) and each indexer arrival counter is back at zero — what every later
    launch, and every graph captured before, relies on (a counter left at k finishes a tile k programs early, before
    its partials are stored). A test that leaves one non-zero errors here with the count, and the counters are zeroed
    so that the tests after it start clean."""
    yield
    if "gpu" not in request.keywords:
        return
    import torch
    if not torch.cuda.is_available():
        return
    from dsv4lab_kernels import indexer_decode, tickets
    try:
        torch.cuda.synchronize()
    except RuntimeError:  # the test's own CUDA error: reported by the test
        return
    left = 0
    for buf in tickets.workspaces() + indexer_decode.arrival_counters():
        if buf.is_cuda:
            n = int((buf != 0).sum())
            if n:
                left += n
                buf.zero_()
    if left:
        pytest.fail(f"{left} ticket/arrival counter(s) left non-zero after the test: a kernel launch that did not "
                    "finish its tiles (kernels/dsv4lab_kernels/tickets.py)")


@pytest.fixture
def tiny_copy(tmp_path) -> Path:
    """A private copy of data/tiny that a test may damage."""
    dst = tmp_path / "tiny"
    shutil.copytree(TINY, dst)
    return dst


_models: dict = {}


def load_tiny(**kw):
    """Session-cached loads of data/tiny (loading is cheap, but tests share them)."""
    import dsv4lab
    key = tuple(sorted((k, str(v)) for k, v in kw.items()))
    if key not in _models:
        _models[key] = dsv4lab.load(TINY, **kw)
    m = _models[key]
    m.reset()
    return m


def calibrated_max_kl(checkpoint: str) -> float:
    """The per-position KL bound of ``verify model``'s calibrated rule for ``checkpoint`` (``data/<name>``):
    ``KL_FLOOR_FACTOR_MAX`` × the max of its committed rounding floor (``data/results/host/noise_floor.json``). For a
    gross-error guard on a few decode steps, where the mean rule has too few positions to mean anything."""
    import json
    from dsv4lab.tools.verify.model import KL_FLOOR_FACTOR_MAX
    rows = json.loads((ROOT / "data" / "results" / "host" / "noise_floor.json").read_text())["rows"]
    floor = next(r for r in rows if r["checkpoint"] == checkpoint)["rounding_floor"]
    return KL_FLOOR_FACTOR_MAX * floor["max_kl"]


_floors: dict = {}


def rounding_floor(checkpoint: Path, golden: str) -> dict:
    """``{"mean_kl", "max_kl"}`` of ``checkpoint``'s rounding-noise floor, measured as
    ``scripts/measure_noise_floor.py`` measures the committed ones (``data/results/host/noise_floor.json``): the
    reference against itself with fp32 instead of exact reductions, teacher-forced on the ids of
    ``data/golden/<golden>.json``. For a checkpoint with no committed floor (a ``layer_cut``); cached per session."""
    key = (str(checkpoint), golden)
    if key not in _floors:
        import dsv4lab
        from dsv4lab.tools.verify.model import load_golden, rounding_noise_floor
        ids = load_golden(ROOT / "data" / "golden" / f"{golden}.json")["teacher_forced"]["ids"]
        kl = rounding_noise_floor(dsv4lab.load(checkpoint, max_batch=1), ids)
        _floors[key] = dict(mean_kl=sum(kl) / len(kl), max_kl=max(kl))
    return _floors[key]


def in_poisoned(t, poison_byte: int, extra: int = 256):
    """``t`` at the front of a larger buffer whose tail bytes are ``poison_byte`` (a read past ``t`` sees NaN)."""
    import torch
    raw = t.contiguous().view(torch.uint8).flatten()
    buf = torch.full((raw.numel() + extra,), poison_byte, dtype=torch.uint8, device=t.device)
    buf[: raw.numel()] = raw
    return buf[: raw.numel()].view(t.dtype).view(t.shape)


def poisoned_x(x):
    """A bf16 activation at the front of a buffer of NaNs (a read past its rows or columns sees NaN)."""
    import torch
    nan = int(torch.tensor(float("nan"), dtype=torch.bfloat16).view(torch.int16))
    buf = torch.full((x.numel() + 128,), nan, dtype=torch.int16, device=x.device)
    buf[: x.numel()] = x.contiguous().view(torch.int16).flatten()
    return buf[: x.numel()].view(torch.bfloat16).view(x.shape)


def compiled_kernel_rows(script: str) -> list[dict]:
    """The ``kernels`` rows of ``scripts/<script> --quick --json`` (a compile script: Triton's NVIDIA backend and its
    ptxas on this machine, no GPU), run without ``TRITON_INTERPRET``; skips where this Triton has no such backend
    or no ptxas for sm_90, fails with the script's output where it fails."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--quick", "--json"], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=600)
    if out.returncode != 0 and "ptxas" in out.stderr and "not found" in out.stderr:
        pytest.skip("no ptxas for sm_90 here")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return json.loads(out.stdout)["kernels"]
