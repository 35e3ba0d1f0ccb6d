"""Layer level: trace every stage of every layer for a fixed input and find the first one that diverges.

The model's ``trace`` hook reports, in forward order, per layer: the mHC mixes, the compressor entries, the indexer
selection, the attention output, the router's top-k and weights, MoE stage 1 (w1, w3), the activation, stage 2 (w2),
the routed combine, the shared expert, the MoE output and the block output. A run is summarised as *digests*: per
traced tensor its shape, NaN count, norm and a 64-dimensional random projection (a sketch, seeded by the tensor's
name) from which relative error and cosine against another run are estimated (Johnson–Lindenstrauss: ~1/√64
relative accuracy, ample to tell 1e-3 from 1). Integer tensors (router and indexer choices) are kept whole so
top-k agreement is measured exactly (Jaccard). Digests are small enough to commit in a golden file, which lets a
faulty *checkpoint* — not only a faulty backend — be localised on a machine that has no trusted copy.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

SKETCH_DIM = 64

# trace key suffix → human stage name (the paper's layer-level tier: router, stage 1, activation, stage 2, sum)
STAGES = {
    "mhc.attn_post": "mHC attention-site post gains",
    "mhc.attn_comb": "mHC attention-site mixing matrix",
    "attn.input": "attention input (normed)",
    "attn.compressed_entries": "compressor entries",
    "attn.indexer_selection": "indexer top-k selection",
    "attn.attn_out": "attention output",
    "mhc.ffn_post": "mHC MoE-site post gains",
    "mhc.ffn_comb": "mHC MoE-site mixing matrix",
    "ffn.input": "MoE input (normed)",
    "ffn.router_idx": "router top-k",
    "ffn.router_weights": "router weights",
    "ffn.stage1_w1": "MoE stage 1 (w1 gate projection)",
    "ffn.stage1_w3": "MoE stage 1 (w3 up projection)",
    "ffn.activation": "MoE activation (clamped SwiGLU × routing weight)",
    "ffn.stage2_w2": "MoE stage 2 (w2 down projection)",
    "ffn.routed_out": "routed-expert combine",
    "ffn.shared_out": "shared expert",
    "ffn.moe_out": "MoE output",
    "out": "block output",
}


def stage_of(key: str) -> tuple[str, str]:
    """``"layers.3.ffn.stage2_w2"`` → ``("layers.3", "MoE stage 2 (w2 down projection)")``."""
    parts = key.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 2:
        block, rest = ".".join(parts[:2]), ".".join(parts[2:])
        return block, STAGES.get(rest, rest)
    return "model", key


def _sketch_matrix(name: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return (torch.randint(0, 2, (SKETCH_DIM, n), generator=g, dtype=torch.int8) * 2 - 1).to(torch.float64)


def digest(name: str, t: torch.Tensor) -> dict:
    """A compact, deterministic summary of one traced tensor."""
    t = t.detach().cpu()
    if not torch.is_floating_point(t):
        return dict(shape=list(t.shape), kind="int", values=t.flatten().tolist())
    v = t.to(torch.float64).flatten()
    nan = torch.isnan(v)
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    sk = _sketch_matrix(name, v.numel()) @ v
    # stored rounded to fp32: the float64 sums' last bits depend on the BLAS path (thread count, CPU), and a
    # re-recorded golden must reproduce byte for byte on any machine
    return dict(shape=list(t.shape), kind="float", nan=int(nan.sum()), l2=float(v.norm().float()),
                sketch=[float(x) for x in sk.float()])


@dataclass
class StageDiff:
    key: str
    block: str
    stage: str
    ok: bool
    rel_err: float | None = None
    cosine: float | None = None
    jaccard: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def compare_digests(key: str, got: dict, want: dict, rel_tol: float, min_cos: float, min_jaccard: float) -> StageDiff:
    block, stage = stage_of(key)
    if got["shape"] != want["shape"]:
        return StageDiff(key, block, stage, False, note=f"shape {got['shape']} != golden {want['shape']}")
    if want["kind"] == "int":
        a, b = torch.tensor(got["values"]), torch.tensor(want["values"])
        if a.numel() == 0:
            return StageDiff(key, block, stage, True, jaccard=1.0)
        k = want["shape"][-1] if want["shape"] else 1
        a, b = a.view(-1, k), b.view(-1, k)
        jac = []
        for ra, rb in zip(a.tolist(), b.tolist()):
            sa, sb = {x for x in ra if x >= 0}, {x for x in rb if x >= 0}
            jac.append(1.0 if not (sa | sb) else len(sa & sb) / len(sa | sb))
        j = sum(jac) / len(jac)
        return StageDiff(key, block, stage, j >= min_jaccard, jaccard=j,
                         note="" if j >= min_jaccard else f"top-k agreement {j:.3f} < {min_jaccard}")
    if got["nan"] != want["nan"]:
        return StageDiff(key, block, stage, False, note=f"{got['nan']} NaN values, golden has {want['nan']}")
    sg = torch.tensor(got["sketch"], dtype=torch.float64)
    sw = torch.tensor(want["sketch"], dtype=torch.float64)
    nw = float(sw.norm())
    rel = float((sg - sw).norm() / nw) if nw > 0 else (0.0 if float(sg.norm()) == 0 else float("inf"))
    den = float(sg.norm() * sw.norm())
    cos = float((sg * sw).sum() / den) if den > 0 else (1.0 if rel == 0 else 0.0)
    ok = rel <= rel_tol and cos >= min_cos
    note = "" if ok else f"relative error ≈ {rel:.3g}, cosine ≈ {cos:.6f}"
    return StageDiff(key, block, stage, ok, rel_err=rel, cosine=cos, note=note)


class Tracer:
    """Collects ``(key, digest)`` in forward order (and optionally the raw tensors)."""

    def __init__(self, keep_tensors: bool = False):
        self.order: list[str] = []
        self.digests: dict[str, dict] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.keep = keep_tensors

    def __call__(self, key: str, t: torch.Tensor) -> None:
        if key in self.digests:  # a key traced twice (several sequences) keeps its first value
            return
        self.order.append(key)
        self.digests[key] = digest(key, t)
        if self.keep:
            self.tensors[key] = t.detach().cpu().clone()


def trace_model(runner, input_ids: list[int], keep_tensors: bool = False) -> Tracer:
    """Run ``input_ids`` as one fresh sequence in slot 0 with the trace hook on."""
    tr = Tracer(keep_tensors)
    runner.reset([0])
    runner.forward(torch.tensor([input_ids]), 0, slots=[0], trace=tr)
    runner.reset([0])
    return tr


def layer_tolerances(backend: str) -> tuple[float, float, float]:
    """(relative error, min cosine, min top-k Jaccard) for a traced stage.

    The reference backend reproduces its own recording exactly (reductions are correctly rounded, so the result
    does not depend on the machine): that is the check ``verify layers`` / ``verify model`` make. For other
    backends the values below are only a coarse screen (their traced stages carry the drift of every earlier stage);
    a backend's verdict comes from the stage-isolated replay (:mod:`.stages`).
    """
    if backend.startswith("reference"):
        return 1e-6, 1 - 1e-9, 1.0
    return 0.1, 0.99, 0.9


def first_divergence(tracer: Tracer, golden: dict, backend: str) -> tuple[StageDiff | None, list[StageDiff]]:
    """Compare every traced stage with the golden digests in forward order; return the first failure and all rows."""
    rel_tol, min_cos, min_jac = layer_tolerances(backend)
    rows, first = [], None
    for key in golden["order"]:
        want = golden["digests"][key]
        got = tracer.digests.get(key)
        if got is None:
            block, stage = stage_of(key)
            d = StageDiff(key, block, stage, False, note="not traced by this run")
        else:
            d = compare_digests(key, got, want, rel_tol, min_cos, min_jac)
        rows.append(d)
        if not d.ok and first is None:
            first = d
    return first, rows
