"""Error bounds from analysis: what a correct evaluation of an op may differ from the reference by, per element.

Two forms, both derived, never tuned (``docs/verification.md`` has the derivation of every op family):

1. **A sum's forward error** — ``|out − ref| ≤ γₙ(u_acc) · Σ|terms| + ulps · ulp_out`` (:func:`check_within_bound`).
   A tolerance relative to the *output* cannot hold for a sum with cancellation: when ``Σ terms`` is small and the
   terms are large, a correct fp32 accumulation is off by many ulps of the output. The classical bound does hold
   (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1 and §4.2):

       |fl(Σ tᵢ) − Σ tᵢ| ≤ γₙ · Σ|tᵢ|,   γₙ = n·u / (1 − n·u),

   for any order of summation of ``n`` terms in a format with unit roundoff ``u`` (blocked, pairwise or split-K
   orders have smaller constants, so ``n`` is a safe ``c`` for all of them). The products ``x·w`` of the formats
   this project multiplies (FP8×FP8, FP4×FP8, BF16×BF16, each times a power-of-two scale) are exact in fp32, so
   only the sums round. Both results are rounded to the output dtype last; two values within δ of each other round
   to values within ``δ + ulp(max(|out|, |ref|))`` (each rounding moves a value by at most half an ulp of the
   binade it lands in), hence ``ulps = 1`` of the output dtype at the larger magnitude.

2. **An interval** ``[lo, hi]`` that must contain the output (:class:`Interval`, :func:`check_interval`) — for
   chains with roundings or quantizers *inside* them (a bf16 rounding, then an FP8 activation quantizer, then a
   dot product: the routed experts, the indexer's scores, RMS norms computed in bf16 steps). The exact value is
   evaluated in float64 and every step of the chain is applied to both ends: a sum widens the interval by its
   γₙ·Σ|terms|, a monotone rounding or quantizer maps ``[lo, hi]`` to ``[q(lo), q(hi)]``. So a quantizer whose
   input lies near a rounding boundary may legitimately land on either neighbour (a "flip", which no
   output-relative tolerance can absorb) and the bound allows exactly those flips, and only where the interval
   straddles the boundary — still tight enough to fail a permuted weight or a wrong scale.

``u_acc`` is the unit roundoff of the evaluation's accumulation, named in :data:`UNIT_ROUNDOFF`: IEEE fp32 with
round-to-nearest (``"fp32"``), fp32 accumulation in tensor cores, which truncate when aligning addends (one full ulp
per addition, ``"fp32_tc"``: Fasi, Higham, Mikaitis & Pranesh, *Numerical behavior of NVIDIA tensor cores*, PeerJ
CS 2021), the same with each MMA step's ``m + 1`` addends aligned to the largest and truncated, counted per term
(``2(1 + 1/m)·u ≤ 4u``, ``"fp32_tc4"``: the decode kernels' tensor-core routes), and Hopper's FP8 MMA, which keeps
about 14 significant bits of its running sum (``"fp8_mma"``: DeepSeek-V3 technical report §3.3.2). Each call site
states the reduction length and the accumulation it assumes; a backend names the model of each call it makes
(``accumulation_for``, see :mod:`dsv4lab.tools.verify.stages`).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

# Unit roundoff (half an ulp at 1.0) of each accumulation/storage format; strings name accumulation models.
UNIT_ROUNDOFF = {
    torch.float64: 2.0 ** -53,
    torch.float32: 2.0 ** -24,
    torch.float16: 2.0 ** -11,
    torch.bfloat16: 2.0 ** -8,
    "fp64": 2.0 ** -53,
    "fp32": 2.0 ** -24,      # IEEE fp32, round to nearest (CUDA cores, CPUs, Triton's interpreter)
    "fp32_tc": 2.0 ** -23,   # fp32 accumulation inside tensor cores: truncation, one ulp per addition
    "fp32_tc4": 2.0 ** -22,  # tensor-core MMA steps of m products, every addend aligned and truncated: ≤ 2(1+1/m)·u
    "fp8_mma": 2.0 ** -13,   # Hopper FP8 MMA: ~14 significant bits of the running sum, truncated (see BLOCKED)
    "bf16": 2.0 ** -8,
}
DEFAULT_ACCUMULATION = "fp32_tc"
"""The accumulation assumed for a backend that states none: fp32 with truncation, valid on every device."""

_MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_NORMAL_EXP = {torch.float64: -1022, torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}


ELEMENTWISE_U = 2.0 ** -24
"""Unit roundoff of the element-wise steps (products, exp, rsqrt, divisions) of any named accumulation model: they
run in fp32 on CUDA cores (or wider) whatever accumulates the dot products."""


def unit_roundoff(acc) -> float:
    """``u`` of a dtype or a named accumulation model (see :data:`UNIT_ROUNDOFF`)."""
    if acc not in UNIT_ROUNDOFF:
        raise ValueError(f"no unit roundoff for {acc}; known: {', '.join(map(str, UNIT_ROUNDOFF))}")
    return UNIT_ROUNDOFF[acc]


BLOCKED = {"fp8_mma": (128, "fp32_tc")}
"""Accumulations that keep reduced precision only inside blocks of ``b`` terms, whose partial sums are then added
in another model (a kernel promotes its FP8 MMA result to fp32 once per 128-wide K block, the scale block)."""


def elementwise_roundoff(acc) -> float:
    """``u`` of the element-wise arithmetic beside an accumulation ``acc``: a dtype's own (an evaluation in bf16 is
    bf16 throughout); for a named model fp32's (:data:`ELEMENTWISE_U`), or the model's own where smaller (fp64)."""
    u = unit_roundoff(acc)
    return u if isinstance(acc, torch.dtype) else min(u, ELEMENTWISE_U)


def gamma(n: float, acc) -> float:
    """``γₙ = n·u/(1−n·u)``: the worst-case relative error of an ``n``-term sum (or dot product) in ``acc``; for a
    blocked model (:data:`BLOCKED`) ``γ_min(n,b)(u_inner) + γ_⌈n/b⌉(u_outer)``."""
    if acc in BLOCKED:
        b, outer = BLOCKED[acc]
        inner = min(n, b) * unit_roundoff(acc)
        return inner / (1 - inner) + (gamma(math.ceil(n / b), outer) if n > b else 0.0)
    nu = n * unit_roundoff(acc)
    if nu >= 1:
        raise ValueError(f"{n} terms in {acc}: n·u ≥ 1, no bound")
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


def _name(acc) -> str:
    return str(acc).replace("torch.", "")


@dataclass
class BoundCheck:
    """The outcome of :func:`check_within_bound` / :func:`check_interval` (``worst``: the element with the largest
    error/bound ratio, its index, both values and the bound there)."""

    name: str
    ok: bool
    numel: int
    n_violations: int
    nan_mismatch: int
    max_ratio: float  # max |out−ref| / bound (≤ 1 passes)
    bitwise_equal: bool
    worst: dict = field(default_factory=dict)
    rule: str = ""
    bound_defect: str = ""  # the bound does not contain the reference: its derivation is wrong, not the kernel

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        st = "ok  " if self.ok else "FAIL"
        w = self.worst
        where = (f" worst {w['index']} out={w['out']:.6g} ref={w['ref']:.6g} bound={w['bound']:.3g}"
                 if w and w.get("out") is not None else "")
        bits = " bit-identical" if self.bitwise_equal else ""
        defect = f" BOUND DEFECT: {self.bound_defect}" if self.bound_defect else ""
        return (f"{st} {self.name}: {self.n_violations}/{self.numel} beyond bound, max error/bound "
                f"{self.max_ratio:.3g}, NaN mismatches {self.nan_mismatch}{bits}{where} [{self.rule}]{defect}")


def _bitwise(out: torch.Tensor, ref: torch.Tensor) -> bool:
    if out.dtype != ref.dtype or out.shape != ref.shape:
        return False
    a, b = out.detach().cpu(), ref.detach().cpu()
    if a.is_floating_point():  # NaN == NaN at the same position counts as equal bits here
        return bool(torch.equal(torch.isnan(a), torch.isnan(b))
                    and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
    return bool(torch.equal(a, b))


def _special(o: torch.Tensor, r: torch.Tensor):
    """(special positions, NaN/inf mismatches): a NaN where the reference has a number always fails."""
    finite_o, finite_r = torch.isfinite(o), torch.isfinite(r)
    special = ~(finite_o & finite_r)
    same = (torch.isnan(o) & torch.isnan(r)) | (torch.isinf(o) & torch.isinf(r) & (o == r))
    return special, special & ~same


def _summarise(name, out, ref, o, r, err, room, special, mismatch, rule, defect="") -> BoundCheck:
    """``err``: |out−ref| (0 at special positions); ``room``: the bound on the side ``out`` lies on."""
    both = ~special
    ratio = torch.where(both, err / torch.where(room > 0, room, torch.full_like(room, float("inf"))),
                        torch.zeros_like(err))
    ratio = torch.where(both & (room <= 0) & (err > 0), torch.full_like(err, float("inf")), ratio)
    viol = int((ratio > 1).sum())
    worst: dict = {}
    if o.numel():
        flat = torch.where(mismatch, torch.full_like(ratio, float("inf")), ratio).flatten()
        i = int(flat.argmax())
        idx = list(torch.unravel_index(torch.tensor(i), r.shape)) if r.ndim else []
        worst = dict(index=[int(v) for v in idx], out=float(o.flatten()[i]), ref=float(r.flatten()[i]),
                     bound=float(room.flatten()[i]), ratio=float(flat[i]))
    max_ratio = float(ratio.max()) if ratio.numel() else 0.0
    n_mis = int(mismatch.sum())
    return BoundCheck(name=name, ok=viol == 0 and n_mis == 0 and not defect, numel=o.numel(), n_violations=viol,
                      nan_mismatch=n_mis, max_ratio=max_ratio, bitwise_equal=_bitwise(out, ref), worst=worst,
                      rule=rule, bound_defect=defect)


def check_within_bound(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor | float, *, terms: int,
                       acc_dtype, out_dtype: torch.dtype, ulps: float = 1.0, c: float | None = None,
                       name: str = "") -> BoundCheck:
    """Check ``|out − ref| ≤ γ · magnitude + ulps · ulp_out(max(|out|, |ref|))`` element-wise.

    Args:
        out, ref: same shape; NaN/inf positions must match exactly (a NaN where the reference has a number — e.g.
            poisoned padding read by the kernel — always fails).
        magnitude: ``Σ|terms|`` per element (broadcastable), or a scalar.
        terms: reduction length ``n`` (γₙ with ``acc_dtype``'s unit roundoff), unless ``c`` overrides ``n``.
        acc_dtype: a dtype or a named accumulation model of :data:`UNIT_ROUNDOFF`.
        out_dtype: the dtype both results were rounded to last (its ulp is the rounding-boundary allowance).
    """
    if out.shape != ref.shape:
        raise ValueError(f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}")
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    mag = torch.as_tensor(magnitude, dtype=torch.float64).detach().cpu()
    g = gamma(c if c is not None else terms, acc_dtype)
    top = torch.maximum(o.abs(), r.abs()).nan_to_num(0.0, 0.0, 0.0)
    bound = torch.broadcast_to(g * mag + ulps * ulp(top, out_dtype), r.shape)
    special, mismatch = _special(o, r)
    err = torch.where(special, torch.zeros_like(o), (o - r).abs())
    rule = (f"γ({'c=' + format(c, 'g') if c is not None else 'n=' + str(terms)}, {_name(acc_dtype)})·Σ|terms| "
            f"+ {ulps:g} ulp {_name(out_dtype)}")
    return _summarise(name, out, ref, o, r, err, bound, special, mismatch, rule)


def assert_within_bound(out, ref, magnitude, **kw) -> BoundCheck:
    """:func:`check_within_bound`, raising ``AssertionError`` with the worst element on failure."""
    res = check_within_bound(out, ref, magnitude, **kw)
    if not res.ok:
        raise AssertionError(res.line())
    return res


# ============================================================================================ intervals
def _f64(t) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(torch.float64)


@dataclass
class Interval:
    """Per element, the closed range ``[lo, hi]`` (float64) a correct evaluation's output must lie in.

    Built from the exact value of a step (float64) and widened step by step; ``rule`` accumulates a readable
    account of the steps (the bound's derivation, printed with a failure). NaN in ``lo``/``hi`` means "NaN
    expected here" (e.g. slots of experts another rank holds).
    """

    lo: torch.Tensor
    hi: torch.Tensor
    rule: str = ""

    # ---------------------------------------------------------------- construction
    @classmethod
    def point(cls, value, rule: str = "") -> "Interval":
        v = _f64(value)
        return cls(v, v.clone(), rule)

    @classmethod
    def around(cls, center, radius, rule: str = "") -> "Interval":
        c, r = _f64(center), _f64(radius)
        return cls(c - r, c + r, rule)

    @property
    def mid(self) -> torch.Tensor:
        return (self.lo + self.hi) / 2

    @property
    def rad(self) -> torch.Tensor:
        return (self.hi - self.lo) / 2

    @property
    def mag(self) -> torch.Tensor:
        """``max(|lo|, |hi|)``: the largest magnitude in the interval."""
        return torch.maximum(self.lo.abs(), self.hi.abs())

    def _with(self, lo, hi, step: str) -> "Interval":
        return Interval(lo, hi, f"{self.rule} → {step}" if self.rule else step)

    # ---------------------------------------------------------------- steps
    def widen(self, radius, step: str = "") -> "Interval":
        r = _f64(radius)
        return self._with(self.lo - r, self.hi + r, step or "± error")

    def round(self, dtype: torch.dtype) -> "Interval":
        """Round both ends to ``dtype`` (monotone): through fp32 first, as every kernel and the reference do."""
        def rnd(t):
            t32 = t.to(torch.float32)
            return (t32 if dtype == torch.float32 else t32.to(dtype)).to(torch.float64)
        if dtype == torch.float64:
            return self
        return self._with(rnd(self.lo), rnd(self.hi), f"round {_name(dtype)}")

    def monotone(self, fn, increasing: bool = True, step: str = "") -> "Interval":
        a, b = fn(self.lo), fn(self.hi)
        return self._with(a, b, step) if increasing else self._with(b, a, step)

    def clamp(self, lo=None, hi=None) -> "Interval":
        return self._with(self.lo.clamp(lo, hi), self.hi.clamp(lo, hi), "clamp")

    def relu(self) -> "Interval":
        return self._with(self.lo.clamp_min(0), self.hi.clamp_min(0), "relu")

    def add(self, other: "Interval | torch.Tensor | float") -> "Interval":
        if isinstance(other, Interval):
            return self._with(self.lo + other.lo, self.hi + other.hi, "add")
        o = _f64(other)
        return self._with(self.lo + o, self.hi + o, "add")

    def mul(self, other: "Interval | torch.Tensor | float") -> "Interval":
        """Product with a value (sign-aware) or another interval (the four corners)."""
        if isinstance(other, Interval):
            c = torch.stack((self.lo * other.lo, self.lo * other.hi, self.hi * other.lo, self.hi * other.hi))
            return self._with(c.amin(0), c.amax(0), "mul")
        o = _f64(other)
        a, b = self.lo * o, self.hi * o
        return self._with(torch.minimum(a, b), torch.maximum(a, b), "mul")

    def sum(self, dim: int, acc, step: str = "") -> "Interval":
        """An ``n``-term sum along ``dim`` evaluated in ``acc``: ``[Σlo, Σhi] ± γₙ·Σ max|·|`` (NaN terms skipped:
        they are the slots another rank holds, which the reference skips too)."""
        n = self.lo.shape[dim]
        lo, hi = self.lo.nan_to_num(0.0), self.hi.nan_to_num(0.0)
        slack = gamma(n, acc) * torch.maximum(lo.abs(), hi.abs()).sum(dim)
        return self._with(lo.sum(dim) - slack, hi.sum(dim) + slack, step or f"Σ{n} in {_name(acc)}")

    def matmul(self, w: torch.Tensor, acc, step: str = "", terms: int | None = None) -> "Interval":
        """``x @ wᵀ`` for ``x`` in this interval ``[..., K]``: ``mid@wᵀ ± rad@|w|ᵀ ± γ_n(acc)·|x|max@|w|ᵀ`` with
        ``n = terms`` roundings (default K; the float64 products and sums of the bound itself add γ_K(fp64))."""
        wf = _f64(w)
        k = wf.shape[-1]
        n = terms or k
        mid = self.mid @ wf.T
        spread = self.rad @ wf.abs().T + (gamma(n, acc) + gamma(k, torch.float64)) * (self.mag @ wf.abs().T)
        return self._with(mid - spread, mid + spread, step or f"dot K={k} ({n} roundings) in {_name(acc)}"
                          if terms else step or f"dot K={k} in {_name(acc)}")

    def contains(self, x: torch.Tensor) -> torch.Tensor:
        v = _f64(x)
        return ((v >= self.lo) & (v <= self.hi)) | (torch.isnan(v) & torch.isnan(self.lo))


def check_interval(out: torch.Tensor, ref: torch.Tensor, iv: Interval, name: str = "",
                   rule: str | None = None) -> BoundCheck:
    """Check ``out ∈ [iv.lo, iv.hi]`` element-wise; the reported ratio is ``|out − ref|`` over the room the bound
    leaves on ``out``'s side of ``ref``. The bound must contain ``ref`` itself, else the *bound* is reported as
    defective (a wrong derivation must never pass or fail a kernel silently). NaN in the bound means NaN expected."""
    if out.shape != ref.shape:
        raise ValueError(f"{name}: shape {list(out.shape)} != reference {list(ref.shape)}")
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    lo = torch.broadcast_to(iv.lo.detach().cpu(), r.shape)
    hi = torch.broadcast_to(iv.hi.detach().cpu(), r.shape)
    special, mismatch = _special(o, r)
    outside_ref = ~special & ((r < lo) | (r > hi))
    defect = ""
    if bool(outside_ref.any()):
        i = int(outside_ref.flatten().nonzero()[0])
        idx = [int(v) for v in torch.unravel_index(torch.tensor(i), r.shape)] if r.ndim else []
        defect = (f"{int(outside_ref.sum())} reference value(s) outside their own bound, first {idx}: "
                  f"ref={float(r.flatten()[i]):.9g} not in "
                  f"[{float(lo.flatten()[i]):.9g}, {float(hi.flatten()[i]):.9g}]")
    err = torch.where(special, torch.zeros_like(o), (o - r).abs())
    room = torch.where(o >= r, hi - r, r - lo)
    return _summarise(name, out, ref, o, r, err, room, special, mismatch, rule if rule is not None else iv.rule,
                      defect)


__all__ = ["UNIT_ROUNDOFF", "DEFAULT_ACCUMULATION", "ELEMENTWISE_U", "unit_roundoff", "elementwise_roundoff", "gamma",
           "ulp", "abs_matmul", "BoundCheck", "check_within_bound", "assert_within_bound", "Interval", "check_interval"]
