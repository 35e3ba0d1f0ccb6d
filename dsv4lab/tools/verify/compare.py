"""The compare helper: descriptive metrics of ``out`` against ``ref``, and the older output-relative tolerance.

``compare(name, out, ref, tol)`` reports bitwise equality, max abs error, relative L2, cosine similarity and NMSE;
it first requires inf/NaN positions to match, then checks every element with ``|out-ref| <= atol + rtol·|ref|``
and names the worst element with its coordinates and both values.

Verdicts on kernels and stages do not come from here: ``verify kernels``, ``verify layers`` and the kernel tests
judge every output by an error bound derived from the arithmetic (:mod:`.bounds`, :mod:`.op_bounds`,
docs/verification.md) and report these metrics beside it, for reading. :func:`tolerance` (a tolerance from the
dtype and the kind of op, after the flash-attention rule) remains for the benchmarks' quick correctness screen; an
output-relative tolerance cannot hold for sums with cancellation or for quantizer flips.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class Tolerance:
    """``|out - ref| <= atol + rtol·|ref|`` per element, plus ``cosine >= min_cosine`` overall."""

    atol: float
    rtol: float
    min_cosine: float
    why: str = ""


# Unit roundoff of each compute dtype (half an ulp at 1.0).
_EPS = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

# How many roundings a kind of op accumulates relative to one element's unit roundoff, and what extra error
# the op's own quantization can add (an FP8/INT8 activation quantizer rounds a different element when inputs
# differ by one ulp, so quantized paths get a floor of one quantization step on a few elements).
OP_KINDS = {
    "exact": (0.0, 0.0),          # bit-identical is required (layouts, packing, pure data movement)
    "elementwise": (4.0, 0.0),    # norms, rope, activations
    "reduction": (64.0, 0.0),     # dot products / GEMMs with fp32 accumulation
    "quantized": (64.0, 2.0 ** -3),  # paths that re-quantize activations (FP8 E4M3: 3 mantissa bits)
    "int8": (64.0, 2.0 ** -6),    # the paper's INT8 route: per-32 int8 activations (7 bits)
    "attention": (128.0, 0.0),    # softmax-weighted sums
}


def tolerance(dtype: torch.dtype, kind: str = "reduction") -> Tolerance:
    """The tolerance for a result computed in ``dtype`` by an op of ``kind`` (see :data:`OP_KINDS`)."""
    if kind not in OP_KINDS:
        raise ValueError(f"unknown op kind {kind!r}; known: {', '.join(OP_KINDS)}")
    if kind == "exact":
        return Tolerance(0.0, 0.0, 1.0, "bitwise")
    mult, quant_step = OP_KINDS[kind]
    eps = _EPS.get(dtype, 2.0 ** -24)
    rtol = 2 * mult * eps + quant_step  # ×2: the flash-attention rule
    atol = rtol * 1e-2
    min_cos = 1.0 - max(1e3 * eps * eps * mult, 1e-12) if quant_step == 0 else 1.0 - 10 * quant_step ** 2
    return Tolerance(atol=atol, rtol=rtol, min_cosine=min(min_cos, 1.0 - 1e-15),
                     why=f"{kind} in {str(dtype).replace('torch.', '')}")


@dataclass
class Comparison:
    name: str
    ok: bool
    bitwise_equal: bool
    max_abs: float
    rel_l2: float
    cosine: float
    nmse: float
    n_bad: int
    numel: int
    nan_mismatch: int
    worst: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)
    message: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        st = "ok  " if self.ok else "FAIL"
        w = self.worst
        where = f" worst {w.get('index')} out={w.get('out'):.6g} ref={w.get('ref'):.6g}" if w else ""
        return (f"{st} {self.name}: max_abs {self.max_abs:.3g} rel_l2 {self.rel_l2:.3g} cos {self.cosine:.8f} "
                f"nmse {self.nmse:.3g} bad {self.n_bad}/{self.numel}{where}{(' — ' + self.message) if self.message else ''}")


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, tol: Tolerance | None = None,
            dtype: torch.dtype | None = None, kind: str = "reduction") -> Comparison:
    """Compare ``out`` against ``ref`` (shapes must match). ``tol`` defaults to ``tolerance(dtype, kind)``."""
    if tol is None:
        tol = tolerance(dtype or out.dtype, kind)
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(name, False, False, float("inf"), float("inf"), 0.0, float("inf"), out.numel(),
                          out.numel(), 0, tol=asdict(tol), message=f"shape {list(out.shape)} != {list(ref.shape)}")
    if out.dtype in (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool):
        eq = bool(torch.equal(out, ref))
        diff = (out.long() - ref.long()).abs()
        bad = int((diff != 0).sum())
        worst = {}
        if bad:
            i = int(diff.flatten().argmax())
            idx = list(torch.unravel_index(torch.tensor(i), out.shape))
            worst = dict(index=[int(v) for v in idx], out=float(out.flatten()[i]), ref=float(ref.flatten()[i]))
        return Comparison(name, eq, eq, float(diff.max()) if diff.numel() else 0.0, 0.0 if eq else 1.0,
                          1.0 if eq else 0.0, 0.0 if eq else 1.0, bad, out.numel(), 0, worst, asdict(tol))
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    bitwise = bool(torch.equal(out.detach().cpu(), ref.detach().cpu().to(out.dtype))) if out.dtype == ref.dtype \
        else bool(torch.equal(o, r))
    nan_o, nan_r = ~torch.isfinite(o), ~torch.isfinite(r)
    same_special = (nan_o == nan_r) & (torch.isnan(o) == torch.isnan(r)) & ((o == r) | torch.isnan(o) | ~nan_o)
    nan_mismatch = int((~same_special & (nan_o | nan_r)).sum())
    fin = ~nan_o & ~nan_r
    of, rf = o[fin], r[fin]
    diff = (of - rf).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_norm = float(rf.norm())
    rel_l2 = float((of - rf).norm() / ref_norm) if ref_norm > 0 else (0.0 if max_abs == 0 else float("inf"))
    denom = float(of.norm() * rf.norm())
    cosine = float((of * rf).sum() / denom) if denom > 0 else (1.0 if max_abs == 0 else 0.0)
    nmse = float(((of - rf) ** 2).sum() / (rf ** 2).sum()) if ref_norm > 0 else (0.0 if max_abs == 0 else float("inf"))
    limit = tol.atol + tol.rtol * r.abs()
    bad_mask = fin & ((o - r).abs() > limit)
    n_bad = int(bad_mask.sum())
    worst = {}
    full_diff = torch.where(fin, (o - r).abs() - limit, torch.where(nan_o != nan_r, torch.inf, -torch.inf))
    if full_diff.numel():
        i = int(full_diff.flatten().argmax())
        idx = list(torch.unravel_index(torch.tensor(i), o.shape))
        worst = dict(index=[int(v) for v in idx], out=float(o.flatten()[i]), ref=float(r.flatten()[i]))
    ok = nan_mismatch == 0 and n_bad == 0 and (cosine >= tol.min_cosine or max_abs == 0)
    msg = ""
    if nan_mismatch:
        msg = f"{nan_mismatch} inf/NaN position(s) differ"
    elif n_bad:
        msg = f"{n_bad} element(s) beyond atol {tol.atol:.2g} + rtol {tol.rtol:.2g}·|ref|"
    elif not ok:
        msg = f"cosine {cosine:.8f} < {tol.min_cosine}"
    return Comparison(name, ok, bitwise, max_abs, rel_l2, cosine, nmse, n_bad, o.numel(), nan_mismatch, worst,
                      asdict(tol), msg)
