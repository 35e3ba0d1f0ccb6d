"""Count the kernel launches of DeepSeek-V4-Flash's decode step on a machine without a GPU.

The decode step's launches depend on the model's widths (which projections stack, which kernels a shape takes) and
on the dispatch's choices (a GPU's tuned file, which fused paths run) — never on values: the step has no host syncs
and no data-dependent shapes. So the step of a Flash-width model is run with every Triton launch counted and
skipped and the products shaped on the meta device (``count_launches(..., execute=False)``), under the dispatch a
GPU would use (``--tuned``: its tuned file over the GPU defaults; ``--fusions``: none, as the GPU runs today until
a visit times them, or all). A model of each layer kind (SWA, CSA, HCA) is built at Flash's widths with a few routed
experts (the launches do not depend on their number) — one layer of the kind, then two: the second layer's launches
are the kind's per layer, the first model's the step's own (embedding, head, greedy) plus a last layer — and the
30-layer cut's step is composed from them:

    step(30) = step([kind of layer 29]) + Σ_{i < 29} per_layer(kind of layer i)

Counted, not timed: what a CUDA graph of the step would hold (a cuBLAS call is one torch op here; on a GPU it may be
more than one kernel — ``bench e2e``'s profile counts those).

    python scripts/count_decode_launches.py [--layers 30] [--batch 1] [--tuned FILE] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels are imported as interpreted functions (never run here)

import torch  # noqa: E402

from dsv4lab.core.config import get_preset  # noqa: E402
from dsv4lab.core.random_checkpoint import RandomCheckpoint  # noqa: E402
from dsv4lab.engine.decode_graph import StaticDecodeStep  # noqa: E402
from dsv4lab.engine.dispatch import GPU_DEFAULTS, Dispatch, read_tuned  # noqa: E402
from dsv4lab.engine.kernel_families import FUSION_NAMES  # noqa: E402
from dsv4lab.engine.loader import load  # noqa: E402
from dsv4lab.tools.bench.common import count_launches  # noqa: E402
from dsv4lab.tools.bench.e2e import cut_layers  # noqa: E402
from dsv4lab.tools.bench.e2e_fusions import with_fusions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"swa": 0, "csa": 4, "hca": 128}
SMALL = dict(n_routed_experts=8, vocab_size=1024, n_mtp_layers=0)
"""What the counting models change of Flash: a few routed experts, a small vocabulary, no MTP block (the one-token
step reads none of it; each is one launch whatever its size)."""


def _model(kind: str, layers: int, seed: int):
    args = get_preset("flash").replace(n_layers=layers, compress_ratios=(KINDS[kind],) * layers, n_hash_layers=0,
                                       **SMALL)
    ck = RandomCheckpoint(args, seed, torch.device("cpu"), name=f"flash-{kind}{layers}")
    runner = load(ck, device="cpu", backend="triton", max_batch=8, max_seq_len=256, validate=False,
                  decode_path="static")
    ck.close()
    return runner


def _count(runner, dispatch: Dispatch, batch: int) -> dict:
    runner.ops.config = dispatch
    step = StaticDecodeStep(runner)
    b = torch.arange(batch)
    tokens, positions = (b * 7 + 3) % runner.args.vocab_size, 100 + b
    # a first call fills the backend's one-time caches (host work: grouped weights, bank views), as on a GPU
    count_launches(lambda: step.greedy(tokens, positions, b), execute=False)
    counts, _ = count_launches(lambda: step.greedy(tokens, positions, b), execute=False)
    runner.reset()
    return dict(triton=counts["triton"], torch=counts["torch"], total=counts["triton"] + counts["torch"],
                triton_kernels=dict(counts["triton_kernels"].most_common()), torch_ops=dict(counts["torch_ops"]))


def _dispatches(tuned: Path | None) -> dict[str, Dispatch]:
    base = Dispatch(read_tuned(tuned) if tuned else None, GPU_DEFAULTS)
    return {"gpu_default": base,
            "all_fused": with_fusions(base, {n: True for n in FUSION_NAMES}, "all")}


def count(layers: int, batch: int, tuned: Path | None, seed: int = 0, progress=print) -> dict:
    """Per kind and for the ``layers``-layer cut of Flash: launches per step and per layer under each dispatch."""
    kinds = [cut_layers(get_preset("flash"), layers).layer_kind(i) for i in range(layers)]
    dispatches = _dispatches(tuned)
    per_kind: dict = {}
    for kind in sorted(set(kinds)):
        t0 = time.perf_counter()
        one, two = _model(kind, 1, seed), _model(kind, 2, seed)
        per_kind[kind] = {}
        for name, d in dispatches.items():
            c1, c2 = _count(one, d, batch), _count(two, d, batch)
            kernels = {k: n - c1["triton_kernels"].get(k, 0) for k, n in c2["triton_kernels"].items()}
            per_kind[kind][name] = dict(one_layer_step=c1, per_layer=c2["total"] - c1["total"],
                                        per_layer_triton=c2["triton"] - c1["triton"],
                                        per_layer_kernels={k: n for k, n in kernels.items() if n})
        del one, two
        each = ", ".join(f"{n} {v['per_layer']}/layer" for n, v in per_kind[kind].items())
        progress(f"{kind}: {each} ({time.perf_counter() - t0:.0f} s)")
    steps = {}
    for name in dispatches:
        last = per_kind[kinds[-1]][name]["one_layer_step"]["total"]
        total = last + sum(per_kind[k][name]["per_layer"] for k in kinds[:-1])
        steps[name] = dict(launches_per_step=total, launches_per_layer=round(total / layers, 2))
    return dict(model="flash", layers=layers, layer_kinds={k: kinds.count(k) for k in sorted(set(kinds))},
                batch=batch, tuned=str(tuned) if tuned else None, counting_model=SMALL, per_kind=per_kind,
                step=steps, commit=_commit(), torch=torch.__version__,
                method=__doc__.split("\n\n")[1].replace("\n", " "))


def _commit() -> str | None:
    import subprocess
    out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30, help="the Flash cut whose step is composed (default 30)")
    p.add_argument("--batch", type=int, default=1, help="rows of the step (default 1)")
    p.add_argument("--tuned", default=str(ROOT / "kernels/dsv4lab_kernels/tuned/h200.json"),
                   help="the GPU's tuned file the dispatch reads ('none': the GPU defaults alone)")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    tuned = None if a.tuned == "none" else Path(a.tuned)
    if tuned is not None and not tuned.exists():
        print(f"count_decode_launches: --tuned {tuned}: no such file", file=sys.stderr)
        return 2
    out = count(a.layers, a.batch, tuned, progress=lambda m: print(m, file=sys.stderr))
    for name, s in out["step"].items():
        print(f"{name:<12} {s['launches_per_step']} launches per step, {s['launches_per_layer']} per layer "
              f"({a.layers}-layer Flash cut, batch {a.batch})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
