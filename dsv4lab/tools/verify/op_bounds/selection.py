"""Bounds of the selections (top-k of the indexer, the router's choice: compared as sets, ties allowed; from scores
a kernel computes itself, any set some scores inside their intervals make the top k), the integer ops, and the
checking of every expectation against an op's outputs (:func:`check_outputs`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4lab.tools.verify.bounds import BoundCheck, Interval, check_interval, elementwise_roundoff, gamma
from dsv4lab.tools.verify.op_bounds.attention import indexer_scores
from dsv4lab.tools.verify.op_bounds.elementwise import router_scores
from dsv4lab.tools.verify.op_bounds.intervals import EXACT, F64, as_f64


@dataclass
class TopK:
    """A causal top-k selection: ``out`` and ``ref`` must select the same entries, except that entries whose score
    equals the last one chosen (ties) may be exchanged — reported as ties, not mismatches."""

    scores: torch.Tensor  # [b, s, T]
    positions: torch.Tensor  # [b, s]
    ratio: int


@dataclass
class TopKInterval:
    """A causal top-k selection from scores known only up to an interval (``lo``, ``hi`` ``[..., T]``; entry ``t``
    visible where ``visible``): the output must pick ``min(k, visible count)`` distinct visible entries, and some
    scores inside the intervals must make exactly that set the top k — every picked entry's upper end at least
    every unpicked visible entry's lower end. Compared as sets (the order of near-equal picks may differ)."""

    lo: torch.Tensor
    hi: torch.Tensor
    visible: torch.Tensor
    k: int


def _causal_visible(n_entries: int, positions, ratio: int) -> torch.Tensor:
    return torch.arange(n_entries, device=positions.device) < ((positions + 1) // ratio)[..., None]


def _topk_interval(scores: Interval, positions, ratio: int, topk: int) -> TopKInterval:
    return TopKInterval(scores.lo, scores.hi, _causal_visible(scores.lo.shape[-1], positions, ratio), topk)


def indexer_select(nm, acc, qi, w, keys, positions, ratio, topk, all_reduce=None):
    """The scores' interval (:func:`indexer_scores`) and the selections it allows (:class:`TopKInterval`)."""
    return _topk_interval(indexer_scores(nm, acc, qi, w, keys), positions, ratio, topk)


def indexer_select_decode(nm, acc, qi, w, keys, slots, positions, topk, all_reduce=None, w_scale=1.0):
    """:func:`indexer_select` of one query per row over its slot's key cache (the head weights scaled in act, as
    the reference scales them: the same product on both sides)."""
    w = w * w_scale if w_scale != 1.0 else w
    return _topk_interval(indexer_scores(nm, acc, qi[:, None], w[:, None], keys[slots]), positions[:, None], 4, topk)


@dataclass
class RouterChoice:
    """The router's ``(idx, weights)``, judged together: the choice must be one that some scores inside the
    biased scores' intervals make (``biased`` None: hash routing, the choice is exact), and each weight must lie in
    the interval of ``score_i / Σ_{chosen} score_j · route_scale`` **for the experts that output chose**."""

    scores: Interval  # [T, E]
    biased: Interval | None
    k: int
    route_scale: float
    normalise: bool
    acc: object

    def weights(self, idx: torch.Tensor) -> Interval:
        """The weights' interval for the choice ``idx [T, k]``: ``w_i = s_i/(s_i + R_i)`` grows with ``s_i`` and falls
        with the rest ``R_i`` of the sum, so ``[lo_i/(lo_i + R_hi), hi_i/(hi_i + R_lo)]``; the sum (γ_k), its fp32
        rounding, the division and the product with ``route_scale`` add ``γ_k + 3u``."""
        i = idx.to(self.scores.lo.device)
        lo, hi = torch.gather(self.scores.lo, 1, i), torch.gather(self.scores.hi, 1, i)
        if self.normalise:
            rest_lo, rest_hi = lo.sum(-1, keepdim=True) - lo, hi.sum(-1, keepdim=True) - hi
            lo, hi = lo / (lo + rest_hi), hi / (hi + rest_lo)
        iv = Interval(lo * self.route_scale, hi * self.route_scale, f"{self.scores.rule} → s/Σs × route_scale")
        rel = gamma(self.k, self.acc) + 3 * elementwise_roundoff(self.acc)
        return iv.widen(rel * iv.mag, "Σ, division, scale").round(torch.float32)

    def check(self, outs, refs, names) -> list[BoundCheck]:
        (idx_o, w_o), (idx_r, w_r) = outs, refs
        if self.biased is None:
            choice = check_expectation(idx_o, idx_r, EXACT, names[0])
        else:
            t = TopKInterval(self.biased.lo, self.biased.hi, torch.ones_like(self.biased.lo, dtype=torch.bool), self.k)
            choice = check_topk_interval(idx_o, idx_r, t, names[0])
        same = (idx_o.cpu() == idx_r.cpu()).all(-1, keepdim=True)
        iv_o = self.weights(idx_o)
        own = check_interval(w_r, w_r, self.weights(idx_r), names[1])  # the reference inside its own bound
        # rows whose choice differs (legitimately or not — the choice check judges that) are judged on out's side
        ref_like = w_r if bool(same.all()) else torch.where(same.to(w_r.device), w_r, iv_o.mid.to(w_r))
        weights = check_interval(w_o, ref_like, iv_o, names[1])
        weights.bound_defect = weights.bound_defect or own.bound_defect
        weights.ok = weights.ok and not own.bound_defect
        return [choice, weights]


def router_topk(nm, acc, logits, gate, ids):
    """The scores' interval (:func:`router_scores`), ``+ bias`` in fp32 for the choice, and the weights of the
    chosen experts (:class:`RouterChoice`)."""
    a = gate.args
    sc = router_scores(nm, acc, logits, a.score_func)
    biased = None if gate.hash_routed else sc.add(as_f64(gate.bias.to(torch.float32))).round(torch.float32)
    return RouterChoice(sc, biased, a.n_activated_experts, a.route_scale, a.score_func != "softmax", acc)


def indexer_topk(nm, acc, scores, positions, ratio, topk):
    return TopK(scores, positions, ratio)


def compressed_rope_position(nm, acc, block, ratio):
    return EXACT


def check_topk(out: torch.Tensor, ref: torch.Tensor, t: TopK, name: str = "") -> BoundCheck:
    """Same selected set per query, or a difference made only of entries tied with the last score chosen."""
    o, r = out.detach().cpu(), ref.detach().cpu()
    if o.shape != r.shape:
        return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                          dict(note=f"shape {list(o.shape)} != {list(r.shape)}"), "top-k set")
    sc = t.scores.detach().cpu().to(F64)
    bad, ties, worst = 0, 0, {}
    rows = o.reshape(-1, o.shape[-1]).tolist()
    refs = r.reshape(-1, r.shape[-1]).tolist()
    scores = sc.reshape(-1, sc.shape[-1])
    for i, (ro, rr) in enumerate(zip(rows, refs)):
        so, sr = {x for x in ro if x >= 0}, {x for x in rr if x >= 0}
        if so == sr and ro.count(-1) == rr.count(-1):
            continue
        diff = so ^ sr
        kth = min(float(scores[i, j]) for j in sr) if sr else None
        tied = (len(so) == len(sr) and all(0 <= j < scores.shape[1] for j in diff)
                and all(float(scores[i, j]) == kth for j in diff))
        if tied:
            ties += 1
        else:
            bad += 1
            if not worst:
                idx = [int(v) for v in torch.unravel_index(torch.tensor(i), o.shape[:-1])]
                worst = dict(index=idx, out=None, ref=None, bound=0.0, ratio=float("inf"),
                             only_out=sorted(so - sr), only_ref=sorted(sr - so))
    return BoundCheck(name, bad == 0, len(rows), bad, 0, 0.0 if bad == 0 else float("inf"), bool(torch.equal(o, r)),
                      worst, f"top-k set ({ties} row(s) differ only among tied scores)")


def _picks_mask(idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mask [R, n] of the entries picked, malformed [R])`` for rows of entry indices (−1 = none): a row is
    malformed when it repeats an entry or names one outside ``[0, n)``."""
    valid = idx >= 0
    bad = (idx >= n).any(-1)
    mask = torch.zeros(idx.shape[0], n, dtype=torch.bool)
    rows = torch.arange(idx.shape[0])[:, None].expand_as(idx)
    ok = valid & (idx < n)
    mask[rows[ok], idx[ok]] = True
    return mask, bad | (mask.sum(-1) != ok.sum(-1))


def _legal_picks(idx: torch.Tensor, t: TopKInterval, lo, hi, visible) -> torch.Tensor:
    """Per row: ``idx`` picks ``min(k, visible)`` distinct visible entries and no unpicked visible entry's lower end
    exceeds a picked entry's upper end."""
    n = lo.shape[-1]
    mask, malformed = _picks_mask(idx, n)
    need = torch.clamp(visible.sum(-1), max=t.k)
    count_ok = (mask.sum(-1) == need) & ((idx >= 0).sum(-1) == need) & ~(mask & ~visible).any(-1)
    low_pick = torch.where(mask, hi, torch.full_like(hi, float("inf"))).amin(-1)
    high_rest = torch.where(visible & ~mask, lo, torch.full_like(lo, float("-inf"))).amax(-1)
    return ~malformed & count_ok & (low_pick >= high_rest)


def check_topk_interval(out: torch.Tensor, ref: torch.Tensor, t: TopKInterval, name: str = "") -> BoundCheck:
    """A selection against :class:`TopKInterval` (rows are the leading dims of ``out``); the reference's own
    selection must be legal too, else the bound is reported as defective."""
    o, r = out.detach().cpu().long(), ref.detach().cpu().long()
    if o.shape != r.shape:
        return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                          dict(note=f"shape {list(o.shape)} != {list(r.shape)}"), "top-k set (score intervals)")
    n = t.lo.shape[-1]
    lo, hi = t.lo.detach().cpu().reshape(-1, n), t.hi.detach().cpu().reshape(-1, n)
    visible = torch.broadcast_to(t.visible.detach().cpu(), t.lo.shape).reshape(-1, n)
    o2, r2 = o.reshape(lo.shape[0], -1), r.reshape(lo.shape[0], -1)
    ok_o, ok_r = _legal_picks(o2, t, lo, hi, visible), _legal_picks(r2, t, lo, hi, visible)
    same = _picks_mask(o2, n)[0].eq(_picks_mask(r2, n)[0]).all(-1)
    bad = int((~ok_o).sum())
    worst, defect = {}, ""
    if bad:
        i = int((~ok_o).nonzero()[0])
        so, sr = {int(x) for x in o2[i] if x >= 0}, {int(x) for x in r2[i] if x >= 0}
        idx = [int(v) for v in torch.unravel_index(torch.tensor(i), o.shape[:-1])]
        worst = dict(index=idx, out=None, ref=None, bound=0.0, ratio=float("inf"), only_out=sorted(so - sr),
                     only_ref=sorted(sr - so))
    if not bool(ok_r.all()):
        i = int((~ok_r).nonzero()[0])
        defect = f"the reference's own selection of row {i} is not a top-{t.k} of its score intervals"
    differ = int((ok_o & ~same).sum())
    return BoundCheck(name, bad == 0 and not defect, lo.shape[0], bad, 0, 0.0 if bad == 0 else float("inf"),
                      bool(torch.equal(o, r)), worst,
                      f"top-k set from score intervals ({differ} row(s) differ within the intervals)", defect)


def check_expectation(out, ref, expect, name: str = "") -> BoundCheck:
    """Check one output against its expectation (an :class:`Interval`, ``EXACT``, a :class:`TopK` or a
    :class:`TopKInterval`)."""
    if isinstance(expect, Interval):
        return check_interval(out, ref, expect, name)
    if isinstance(expect, TopK):
        return check_topk(out, ref, expect, name)
    if isinstance(expect, TopKInterval):
        return check_topk_interval(out, ref, expect, name)
    if expect == EXACT:
        o, r = out.detach().cpu(), ref.detach().cpu()
        if o.shape != r.shape or o.dtype != r.dtype:
            return BoundCheck(name, False, r.numel(), r.numel(), 0, float("inf"), False,
                              dict(note=f"{o.dtype}{list(o.shape)} != {r.dtype}{list(r.shape)}"), "exact")
        same = (o == r) | (torch.isnan(o) & torch.isnan(r)) if o.is_floating_point() else o == r
        eq = bool(same.all())
        worst = {}
        if not eq:
            i = int((~same).flatten().nonzero()[0])
            worst = dict(index=[int(v) for v in torch.unravel_index(torch.tensor(i), r.shape)],
                         out=float(o.flatten()[i]), ref=float(r.flatten()[i]), bound=0.0, ratio=float("inf"))
        return BoundCheck(name, eq, r.numel(), int((~same).sum()), 0, 0.0 if eq else float("inf"), eq, worst, "exact")
    raise TypeError(f"{name}: unknown expectation {type(expect).__name__}")


def check_outputs(outs: tuple, refs: tuple, expects, names: list[str]) -> list[BoundCheck]:
    """Check every output of a call: ``expects`` is what the op's bound function returned — one expectation per
    output (a tuple, or a bare one for a single output), or a joint expectation (with a ``check`` method)."""
    if hasattr(expects, "check"):
        return expects.check(outs, refs, names)
    expects = expects if isinstance(expects, tuple) else (expects,)
    if len(expects) != len(refs):
        raise ValueError(f"{names[0]}: the bound has {len(expects)} expectations for {len(refs)} outputs")
    return [check_expectation(o, r, e, n) for o, r, e, n in zip(outs, refs, expects, names)]
