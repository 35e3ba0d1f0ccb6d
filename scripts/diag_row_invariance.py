"""Which backend op makes a sequence's T-token step depend on the other rows of the step (GPU diagnosis).

    python3 scripts/diag_row_invariance.py [--T 4] [--out runs/h200/row_invariance.json]

Runs the tiny model's T-token static step (MTP block included, eager, the Triton backend) twice from the same
prefilled caches: three sequences, then the same three plus a fourth. Every backend op call is recorded; the first
call whose output, cut to the first three sequences' rows, differs between the two runs names the op whose result
depends on how many rows share the step. A row-invariant backend prints "no op differs".
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import dsv4lab
from dsv4lab.engine.decode_graph import Decoder

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny"


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [v for v in vars(out).values() if isinstance(v, torch.Tensor)] if hasattr(out, "__dict__") else []


def _recorded(m, calls: list):
    ops = m.ops
    for name in dir(type(ops)):
        fn = getattr(ops, name, None)
        if name.startswith("_") or not callable(fn) or name in ("report",):
            continue

        def wrap(*a, _fn=fn, _name=name, **k):
            out = _fn(*a, **k)
            calls.append((_name, [t.detach().clone() for t in _flat(out)]))
            return out
        setattr(ops, name, wrap)


def run(b: int, T: int) -> list:
    ids = torch.randint(2, 4096, (4, 80), generator=torch.Generator().manual_seed(T))
    starts, lens = torch.tensor([29, 13, 61, 40]), torch.tensor([T, 1, T - 1, T])
    m = dsv4lab.load(TINY, device="cuda", backend="triton", max_batch=4, max_seq_len=96)
    dec = Decoder(m, graphs=False)
    m.prefill(ids[:b], slots=list(range(b)), lengths=starts[:b], mtp=True)
    tokens = torch.stack([ids[i, s:s + T] for i, s in enumerate(starts[:b].tolist())])
    calls: list = []
    _recorded(m, calls)
    dec.run(tokens, starts[:b], torch.arange(b), lens[:b], mtp=True)
    torch.cuda.synchronize()
    return calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=4)
    p.add_argument("--out", default="runs/h200/row_invariance.json")
    a = p.parse_args()
    three, four = run(3, a.T), run(4, a.T)
    report = dict(T=a.T, calls=[len(three), len(four)], first_difference=None, differing_ops=[])
    for i, ((n3, o3), (n4, o4)) in enumerate(zip(three, four)):
        if n3 != n4:
            report["first_difference"] = dict(call=i, op=f"{n3} vs {n4}", why="call order differs")
            break
        for j, (x, y) in enumerate(zip(o3, o4)):
            if x.shape == y.shape:
                same = torch.equal(x, y) if x.shape[0] not in (3, 3 * a.T) else torch.equal(x, y)
            elif x.dim() and y.dim() and y.shape[0] > x.shape[0] and x.shape[1:] == y.shape[1:]:
                same = torch.equal(x, y[:x.shape[0]])
            else:
                continue
            if not same:
                d = dict(call=i, op=n3, output=j, shape3=list(x.shape), shape4=list(y.shape))
                report["differing_ops"].append(d)
                report["first_difference"] = report["first_difference"] or d
    print(json.dumps(report, indent=1) if report["first_difference"] else "no op differs")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
