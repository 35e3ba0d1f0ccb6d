"""Does the static prefill step read memory it never wrote? Every fresh allocation poisoned, op by op.

``scripts/diag_prefill_after_decode.py`` on an H100 at 5329f29: a prefill graph replayed after another graph was
captured in its memory pool gives non-finite logits, where the same step run eagerly does not — the mark of a
kernel that reads bytes of a fresh buffer it never wrote (harmless while the pool still holds the capture's own
values). Here ``torch.empty``/``empty_like``/``empty_strided``/``Tensor.new_empty`` fill every floating buffer
with NaN (and, with ``--ints``, every integer buffer with 0x7F bytes), the prompt runs through the static step in
chunks (300, 37, 100, one decode token, 17) on ``data/tiny``, and each backend op's outputs are checked: the first
op whose tensor inputs are finite and whose outputs are not is named, with the rows that went non-finite. Each
forward's logits are compared with a run without poison.

    python3 scripts/diag_uninitialized_reads.py [--ints] [--out runs/h200/diag_uninitialized_reads.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dsv4lab  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ORIGINAL = {n: getattr(torch, n) for n in ("empty", "empty_like", "empty_strided")}
ORIGINAL_NEW_EMPTY = torch.Tensor.new_empty


def _poison(t: torch.Tensor, ints: bool) -> torch.Tensor:
    if t.numel() == 0 or not t.is_contiguous():
        return t
    if t.is_floating_point():
        t.view(torch.uint8).fill_(0xFF)  # NaN in fp32/bf16/fp16 and E4M3
    elif ints and t.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8):
        t.view(torch.uint8).fill_(0x7F)
    return t


def poison_allocations(on: bool, ints: bool) -> None:
    for name, fn in ORIGINAL.items():
        setattr(torch, name, (lambda f: lambda *a, **k: _poison(f(*a, **k), ints))(fn) if on else fn)
    torch.Tensor.new_empty = (lambda self, *a, **k: _poison(ORIGINAL_NEW_EMPTY(self, *a, **k), ints)) if on \
        else ORIGINAL_NEW_EMPTY


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or bool(torch.isfinite(t.float()).all())


def watch_ops(ops, findings: list, label: list) -> None:
    """Wrap every public method of the backend: record each call whose tensor inputs are finite and whose
    outputs are not."""
    for name in dir(type(ops)):
        if name.startswith("_") or not callable(getattr(type(ops), name, None)):
            continue
        fn = getattr(ops, name)

        def wrapped(*a, __fn=fn, __name=name, **k):
            out = __fn(*a, **k)
            ins = list(_tensors((a, k)))
            if all(_finite(t) for t in ins):
                for i, t in enumerate(_tensors(out)):
                    if not _finite(t):
                        bad = ~torch.isfinite(t.float())
                        where = bad.reshape(-1, t.shape[-1]).any(-1).nonzero().flatten()
                        findings.append(dict(forward=label[0], op=__name, output=i, shape=list(t.shape),
                                             non_finite=int(bad.sum()), of=t.numel(),
                                             flat_rows=where[:12].tolist(), n_rows=int(where.numel()),
                                             inputs=[list(x.shape) for x in ins][:8]))
                        print(findings[-1], flush=True)
                        break
            return out
        setattr(ops, name, wrapped)


def run(m, ids, chunks, label):
    m.reset()
    out, p = [], 0
    for i, c in enumerate(chunks):
        label[0] = i
        out.append(m.forward(ids[:, p:p + c], p, logits="last").float().clone())
        p += c
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ints", action="store_true")
    p.add_argument("--out", default="runs/h200/diag_uninitialized_reads.json")
    args = p.parse_args()
    kw = dict(device=DEV, backend="triton", max_batch=2, max_seq_len=512, validate=False, decode_path="eager",
              prefill_path="static")
    ids = torch.randint(2, 4096, (1, 460), generator=torch.Generator().manual_seed(11))
    chunks = (300, 37, 100, 1, 17, 1) if DEV == "cuda" else (30, 7, 10, 1, 17, 1)
    label = [0]
    clean = run(dsv4lab.load(TINY, **kw), ids, chunks, label)
    rows = []
    for ints in (False, True) if args.ints else (False,):
        m = dsv4lab.load(TINY, **kw)
        findings: list = []
        watch_ops(m.ops, findings, label)
        poison_allocations(True, ints)
        try:
            got = run(m, ids, chunks, label)
            error = None
        except Exception as err:  # an out-of-bounds index from a poisoned integer buffer ends the run
            got, error = [], f"{type(err).__name__}: {err}"[:300]
        finally:
            poison_allocations(False, ints)
        rows.append(dict(ints=ints, error=error, findings=findings[:40],
                         forwards=["equal" if torch.equal(u, v) else
                                   f"max|Δ| {(u - v).abs().nan_to_num(float('inf')).max():.3g}"
                                   for u, v in zip(got, clean)]))
        print({k: v for k, v in rows[-1].items() if k != "findings"}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import triton
    Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                                              torch=torch.__version__, triton=triton.__version__,
                                              commit=os.environ.get("DSV4LAB_COMMIT", "unknown"), rows=rows),
                                         indent=1))
    print("wrote", args.out)
    return 0


TINY = ROOT / "data" / "tiny"

if __name__ == "__main__":
    raise SystemExit(main())
