"""Where a prefill after decoding goes wrong on a GPU, and whether the split-K ticket kernels repeat their bits.

The 3dac085 visit (``data/results/h200/logs/visit_3dac085_tests.log``) failed four tests on one pattern — a prefill
run after the decode step's graphs exist differs from the same prefill before them — and the GEMV jobs launch
(three projections in one grid) differed from the three launches alone. This script isolates both in one process:

* ``prefill``: for each decode path (graph / static / eager) × prefill path (graph / static / eager) × PDL on/off,
  a fresh runner on ``data/tiny`` prefills prompt B, generates from prompt A (capturing the decode tiers where the
  decode path is graph), prefills B again; both are compared with the eager-everything runner's B, bit for bit.
  Also: prompt B's prefill replayed five times in a row before any decode (a graph that varies by itself is a race).
* ``chunks``: ``tests/test_prefill_step.py``'s failing chunk pattern (a one-token forward between prefill chunks) on
  every decode × prefill path against the eager-everything runner, forward by forward.
* ``gemv``: each DeepSeek-V4-Flash-width projection of the attention input alone, 30 launches, all equal to the
  first?; the jobs launch, 30 launches; each pair of jobs; jobs against singles — with PDL on and off.

    python3 scripts/diag_prefill_after_decode.py [--parts prefill,gemv] [--out runs/h200/diag_prefill.json]

Prints one line per case and writes the table as JSON (GPU name, versions, commit from ``DSV4LAB_COMMIT``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU run (a check of the script) runs the kernels in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsv4lab  # noqa: E402

TINY = ROOT / "data" / "tiny"
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (interpreter) run only checks the script


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 4096, (n,), generator=torch.Generator().manual_seed(seed))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32).cpu()


def _delta(a: torch.Tensor, b: torch.Tensor) -> str:
    if torch.equal(_bits(a), _bits(b)):
        return "equal"
    d = (a.float() - b.float()).abs()
    return f"max|Δ| {d.nan_to_num(float('inf')).max():.3g}, finite {bool(torch.isfinite(a).all())}"


def prefill_cases(rows: list) -> None:
    kw = dict(device=DEV, backend="triton", max_batch=2, max_seq_len=256, validate=False)
    a, b = _ids(7, 21), _ids(6, 22)
    ref = dsv4lab.load(TINY, decode_path="eager", prefill_path="eager", **kw)
    want = ref.prefill(b).clone()
    ref.generate(a.tolist(), 4, stop_at_eos=False)
    again = ref.prefill(b)
    rows.append(dict(part="prefill", case="eager/eager before vs after decode", result=_delta(again, want)))
    print(rows[-1], flush=True)
    del ref
    for pdl, dpath, ppath in itertools.product(("1", "0"), *[("graph", "static", "eager") if DEV == "cuda" else ("eager",)] * 2):
        os.environ["DSV4LAB_PDL"] = pdl
        t0 = time.perf_counter()
        m = dsv4lab.load(TINY, decode_path=dpath, prefill_path=ppath, **kw)
        row = dict(part="prefill", pdl=pdl, decode=dpath, prefill=ppath)
        try:
            first = m.prefill(b).clone()
            row["first_vs_eager"] = _delta(first, want)
            row["repeats"] = [_delta(m.prefill(b), first) for _ in range(5)]
            m.generate(a.tolist(), 4, stop_at_eos=False)
            row["after_decode_vs_first"] = _delta(m.prefill(b), first)
            m.generate(a.tolist(), 4, stop_at_eos=False)
            row["after_second_decode_vs_first"] = _delta(m.prefill(b), first)
        except Exception as err:  # what it got to stays in the row
            row["error"] = f"{type(err).__name__}: {err}"[:200]
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(rows[-1], flush=True)
        del m
        if DEV == "cuda":
            torch.cuda.empty_cache()
    os.environ["DSV4LAB_PDL"] = "1"


def chunk_cases(rows: list) -> None:
    """``tests/test_prefill_step.py``'s failing pattern: chunks 300, 37, 100, then one token (the decode path), then
    17 (a prefill bucket first captured after the decode graphs), then three decode steps — each forward's logits
    against the eager-everything runner's."""
    kw = dict(device=DEV, backend="triton", max_batch=2, max_seq_len=512, validate=False)
    ids = torch.randint(2, 4096, (1, 460), generator=torch.Generator().manual_seed(11))
    chunks = (300, 37, 100, 1, 17) if DEV == "cuda" else (30, 7, 10, 1, 17)

    def run(m):
        m.reset()
        out, p = [], 0
        for c in chunks:
            out.append(m.forward(ids[:, p:p + c], p, logits="last").clone())
            p += c
        for _ in range(3):
            out.append(m.forward(ids[:, p:p + 1], p).clone())
            p += 1
        return out

    want = run(dsv4lab.load(TINY, decode_path="eager", prefill_path="eager", **kw))
    paths = ("graph", "static", "eager") if DEV == "cuda" else ("eager",)
    for dpath, ppath in itertools.product(paths, paths):
        got = run(dsv4lab.load(TINY, decode_path=dpath, prefill_path=ppath, **kw))
        rows.append(dict(part="chunks", decode=dpath, prefill=ppath,
                         forwards=[_delta(u, v) for u, v in zip(got, want)]))
        print(rows[-1], flush=True)


def gemv_cases(rows: list) -> None:
    """The CSA layer's attention-input projections (``scripts/check_gemv_jobs_layouts.py``'s) on the device."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_gemv_jobs_layouts import projections
    from dsv4lab_kernels import fp8_gemv as gemv
    for pdl, M in itertools.product(("1", "0"), (1, 8)):
        os.environ["DSV4LAB_PDL"] = pdl
        jobs = [{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in c.items()} for c in projections(M)]

        def flat(res):
            return [t.clone() for r in res for t in (r if isinstance(r, tuple) else (r,))]

        singles = [flat([gemv.fp8_gemv(**c)]) for c in jobs]
        for i, c in enumerate(jobs):
            runs = [flat([gemv.fp8_gemv(**c)]) for _ in range(30 if DEV == "cuda" else 1)]
            bad = sum(not all(torch.equal(u, v) for u, v in zip(r, singles[i])) for r in runs)
            rows.append(dict(part="gemv", pdl=pdl, rows=M, case=f"job {i} alone, 30 launches", differing=bad))
            print(rows[-1], flush=True)
        want = [t for s in singles for t in s]
        runs = [flat(gemv.fp8_gemv_jobs([gemv.gemv_plan(**c) for c in jobs])) for _ in range(30 if DEV == "cuda" else 1)]
        rows.append(dict(part="gemv", pdl=pdl, rows=M, case="jobs 0+1+2, 30 launches",
                         differing_from_first=sum(not all(torch.equal(u, v) for u, v in zip(r, runs[0]))
                                                  for r in runs),
                         vs_singles=[_delta(u, v) for u, v in zip(runs[0], want)]))
        print(rows[-1], flush=True)
        for pair in ((0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1)):
            got = flat(gemv.fp8_gemv_jobs([gemv.gemv_plan(**jobs[i]) for i in pair]))  # (the order: the position)
            ref = [t for i in pair for t in singles[i]]
            rows.append(dict(part="gemv", pdl=pdl, rows=M, case=f"jobs {pair}",
                             vs_singles=[_delta(u, v) for u, v in zip(got, ref)]))
            print(rows[-1], flush=True)
    os.environ["DSV4LAB_PDL"] = "1"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="gemv,prefill,chunks")
    p.add_argument("--out", default="runs/h200/diag_prefill_after_decode.json")
    args = p.parse_args()
    import triton
    rows: list = []
    meta = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
                commit=os.environ.get("DSV4LAB_COMMIT", "unknown"))
    for part in args.parts.split(","):
        try:
            {"prefill": prefill_cases, "gemv": gemv_cases, "chunks": chunk_cases}[part](rows)
        except Exception as err:  # a diagnostic records what broke and goes on with the next part
            rows.append(dict(part=part, error=f"{type(err).__name__}: {err}"[:400]))
            print(rows[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
