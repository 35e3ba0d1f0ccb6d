"""Error bounds from analysis: ``|out − ref| ≤ c · u · Σ|terms| + ulps · ulp_out(ref)`` per element.

A tolerance relative to the *output* cannot hold for a sum with cancellation: when ``Σ terms`` is small and the
terms are large, a correct fp32 accumulation is off by many ulps of the output. The classical forward error bound
of a floating-point sum does hold (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1 and §4.2):

    |fl(Σ tᵢ) − Σ tᵢ| ≤ γₙ · Σ|tᵢ|,   γₙ = n·u / (1 − n·u),

for any order of summation of ``n`` terms in a format with unit roundoff ``u`` (blocked, pairwise or split-K
orders have smaller constants, so ``n`` is a safe ``c`` for all of them). The products ``x·w`` of the formats this
project multiplies (FP8×FP8, FP4×FP8, BF16×BF16, each times a power-of-two scale) are exact in fp32, so only the
sums round. The reference evaluates in float64 and rounds once, to ``acc`` and then to the output dtype; the
kernel rounds its fp32 result to the output dtype once: the two can straddle one rounding boundary of the output,
hence ``ulps`` ulps of the output dtype on top.

``magnitude`` is ``Σ|terms|`` per output element, computed alongside the reference by running the same bilinear
op on absolute values (``|x| @ |W|ᵀ`` for a projection; see :func:`abs_matmul`).

Each kernel family states its ``terms`` (the reduction length) and accumulation dtype at its call site; nothing
here is tuned to make a test pass. ``docs/troubleshooting.md`` (Verification bounds) has the derivation per family.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Unit roundoff (half an ulp at 1.0) of each accumulation/storage dtype.
UNIT_ROUNDOFF = {
    torch.float64: 2.0 ** -53,
    torch.float32: 2.0 ** -24,
    torch.float16: 2.0 ** -11,
    torch.bfloat16: 2.0 ** -8,
}
_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_NORMAL_EXP = {torch.float64: -1022, torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


def unit_roundoff(dtype: torch.dtype) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {dtype}; known: {', '.join(map(str, UNIT_ROUNDOFF))}")
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, dtype: torch.dtype) -> float:
    """``γₙ = n·u/(1−n·u)``: the worst-case relative error of an ``n``-term sum (or dot product) in ``dtype``."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} terms in {dtype}: n·u ≥ 1, no bound")
    return nu / (1 - nu)


def ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at ``|x|`` (float64), the subnormal spacing below the smallest normal."""
    a = x.detach().to(torch.float64).abs()
    e = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a))))
    e = torch.clamp(e, min=_MIN_NORMAL_EXP[dtype])
    return torch.exp2(e - _MANTISSA_BITS[dtype])


def abs_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ|x·w|`` per output of ``x @ wᵀ`` (float64): the magnitude of a projection's terms."""
    return x.detach().to(torch.float64).abs() @ w.detach().to(torch.float64).abs().T


@dataclass
class BoundCheck:
    """The outcome of :func:`check_within_bound` (``worst``: the element with the largest error/bound ratio)."""

    name: str
    ok: bool
    numel: int
    n_violations: int
    nan_mismatch: int
    max_ratio: float  # max |out−ref| / bound (≤ 1 passes)
    bitwise_equal: bool
    worst: dict = field(default_factory=dict)
    rule: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        st = "ok  " if self.ok else "FAIL"
        w = self.worst
        where = (f" worst {w['index']} out={w['out']:.6g} ref={w['ref']:.6g} bound={w['bound']:.3g}" if w else "")
        bits = " bit-identical" if self.bitwise_equal else ""
        return (f"{st} {self.name}: {self.n_violations}/{self.numel} beyond bound, max error/bound "
                f"{self.max_ratio:.3g}, NaN mismatches {self.nan_mismatch}{bits}{where} [{self.rule}]")


def check_within_bound(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor | float, *, terms: int,
                       acc_dtype: torch.dtype, out_dtype: torch.dtype, ulps: float = 1.0, c: float | None = None,
                       name: str = "") -> BoundCheck:
    """Check ``|out − ref| ≤ γ · magnitude + ulps · ulp_out(ref)`` element-wise.

    Args:
        out, ref: same shape; NaN/inf positions must match exactly (a NaN where the reference has a number — e.g.
            poisoned padding read by the kernel — always fails).
        magnitude: ``Σ|terms|`` per element (broadcastable), or a scalar.
        terms: reduction length ``n`` (γₙ with ``acc_dtype``'s unit roundoff), unless ``c`` overrides ``n``.
        out_dtype: the dtype both results were rounded to last (its ulp is the rounding-boundary allowance).
    """
    if out.shape != ref.shape:
        raise ValueError(f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}")
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    mag = torch.as_tensor(magnitude, dtype=torch.float64).detach().cpu()
    g = (c if c is not None else terms) * unit_roundoff(acc_dtype)
    g = g / (1 - g) if g < 1 else float("inf")
    bound = g * mag + ulps * ulp(r, out_dtype)
    bound = torch.broadcast_to(bound, r.shape)
    finite_o, finite_r = torch.isfinite(o), torch.isfinite(r)
    special = ~(finite_o & finite_r)
    same_special = (torch.isnan(o) & torch.isnan(r)) | (torch.isinf(o) & torch.isinf(r) & (o == r))
    nan_mismatch = int((special & ~same_special).sum())
    both = finite_o & finite_r
    err = torch.where(both, (o - r).abs(), torch.zeros_like(o))
    ratio = torch.where(both, err / torch.where(bound > 0, bound, torch.full_like(bound, float("inf"))),
                        torch.zeros_like(o))
    ratio = torch.where(both & (bound == 0) & (err > 0), torch.full_like(o, float("inf")), ratio)
    viol = int((ratio > 1).sum())
    worst: dict = {}
    if o.numel():
        flat = torch.where(special & ~same_special, torch.full_like(ratio, float("inf")), ratio).flatten()
        i = int(flat.argmax())
        idx = list(torch.unravel_index(torch.tensor(i), r.shape)) if r.ndim else []
        worst = dict(index=[int(v) for v in idx], out=float(o.flatten()[i]), ref=float(r.flatten()[i]),
                     bound=float(bound.flatten()[i]), ratio=float(flat[i]))
    max_ratio = float(ratio.max()) if ratio.numel() else 0.0
    bitwise = bool(torch.equal(out.detach().cpu(), ref.detach().cpu().to(out.dtype))) if out.dtype == ref.dtype \
        else False
    rule = (f"γ({'c=' + format(c, 'g') if c is not None else 'n=' + str(terms)}, "
            f"{str(acc_dtype).replace('torch.', '')})·Σ|terms| + {ulps:g} ulp "
            f"{str(out_dtype).replace('torch.', '')}")
    ok = viol == 0 and nan_mismatch == 0
    return BoundCheck(name=name, ok=ok, numel=o.numel(), n_violations=viol, nan_mismatch=nan_mismatch,
                      max_ratio=max_ratio, bitwise_equal=bitwise, worst=worst, rule=rule)


def assert_within_bound(out, ref, magnitude, **kw) -> BoundCheck:
    """:func:`check_within_bound`, raising ``AssertionError`` with the worst element on failure."""
    res = check_within_bound(out, ref, magnitude, **kw)
    if not res.ok:
        raise AssertionError(res.line())
    return res


__all__ = ["UNIT_ROUNDOFF", "unit_roundoff", "gamma", "ulp", "abs_matmul", "BoundCheck", "check_within_bound",
           "assert_within_bound"]
