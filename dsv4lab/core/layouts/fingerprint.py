"""Fingerprinting: the permutation between two ops, or between an op and recorded activations.

:func:`fingerprint` compares two ops (callables ``[n, in] → [n, out]``) and returns the permutation ``perm`` with
``suspect(x)[:, i] == reference(x)[:, perm[i]]`` (``side="rows"``) or the input-side one (``side="cols"``), its
block structure, the residual after alignment and a confidence, in two probe calls. :func:`fingerprint_recorded`
does the same against recorded arrays (golden activation dumps) instead of a reference op. The fingerprint of a
stored layout is the layout itself (:meth:`FingerprintResult.layout`), so the repair is its inverse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dsv4lab.core.errors import LayoutError
from dsv4lab.core.layouts.algebra import BlockStructure, Layout, detect_block_structure, layout_from_perm
from dsv4lab.core.layouts.formats import ScalePolicy, Side


@dataclass
class FingerprintResult:
    """What :func:`fingerprint` found.

    Attributes:
        side: ``"rows"`` (output side) or ``"cols"`` (input side).
        perm: suspect index ``i`` holds reference index ``perm[i]`` (rows: ``suspect(x)[:, i] ==
            reference(x)[:, perm[i]]``; cols: ``suspect(x) == reference(x')`` with ``x'[:, perm[i]] = x[:, i]``).
        block: the permutation's block structure (``None`` for the identity).
        residual: ``‖suspect − aligned reference‖ / ‖reference‖`` after alignment (0 for an exact
            permutation).
        residual_unaligned: the same before alignment.
        confidence: the smallest gap, over all suspect indices, between the matched similarity (cosine, 1 for
            an exact match) and the best alternative; 0 means some index is indistinguishable from another.
        ambiguous: suspect indices whose match is not unique (gap below ``1e-6``).
        probe_calls: calls made to the ops; probe_rows: input rows per call.
    """

    side: Side
    perm: torch.Tensor
    block: BlockStructure | None
    residual: float
    residual_unaligned: float
    confidence: float
    ambiguous: list[int]
    probe_calls: int
    probe_rows: int

    @property
    def is_identity(self) -> bool:
        return self.block is None

    @property
    def exact(self) -> bool:
        """Unique matches and (near-)zero residual: the ops differ by exactly this permutation."""
        return not self.ambiguous and self.residual < 1e-6

    @property
    def description(self) -> str:
        return "no permutation" if self.block is None else self.block.description

    def layout(self, scales: ScalePolicy = "follow") -> Layout | None:
        """The stored layout this permutation describes (its inverse is the repair)."""
        return layout_from_perm(self.perm, self.side, scales)

    def summary(self) -> str:
        return (f"{self.side}: {self.description}; residual {self.residual:.3g} (unaligned "
                f"{self.residual_unaligned:.3g}); confidence {self.confidence:.3f}"
                + (f"; {len(self.ambiguous)} ambiguous" if self.ambiguous else "")
                + f"; {self.probe_calls} probe calls × {self.probe_rows} rows")

    def to_json(self) -> dict:
        return dict(side=self.side, description=self.description, identity=self.is_identity,
                    residual=self.residual, residual_unaligned=self.residual_unaligned,
                    confidence=self.confidence, ambiguous=self.ambiguous[:100], probe_calls=self.probe_calls,
                    probe_rows=self.probe_rows,
                    layout=(lay.to_json() if (lay := self.layout()) is not None else None))


def _unit_columns(m: torch.Tensor) -> torch.Tensor:
    norm = m.norm(dim=0, keepdim=True)
    return torch.where(norm > 0, m / norm.clamp_min(1e-300), torch.zeros_like(m))


def match_columns(suspect: Sequence[torch.Tensor],
                  reference: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Match the columns of suspect matrices to those of reference matrices by mean cosine similarity.

    ``suspect`` and ``reference`` are lists of ``[n_g, m]`` matrices (one per probe group; the score of a pair is
    the mean over groups of the column cosines, so a per-group rescaling does not hide a match). See
    :func:`match_scores` for the assignment and the margins.
    """
    widths = {t.shape[1] for t in list(suspect) + list(reference)}
    if len(widths) != 1 or len(suspect) != len(reference):
        raise LayoutError(f"match_columns: suspect and reference must be the same number of [n, m] matrices with "
                          f"one m (got widths {sorted(widths)})")
    m, g = widths.pop(), len(suspect)
    # sum over groups of Sgᵀ·Rg is one product of the stacked unit columns
    s_t = torch.cat([_unit_columns(t.to(torch.float64)) for t in suspect]).T.contiguous()
    r = torch.cat([_unit_columns(t.to(torch.float64)) for t in reference])
    return match_scores(lambda rows: (s_t[rows] @ r) / g, m)


def match_subspaces(parts: torch.Tensor, reference: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Match suspect items to reference columns when each suspect item is known only up to per-group scales.

    ``parts`` ``[G, n, m]`` holds each suspect item's per-group contributions (e.g. a row's output on inputs
    restricted to one scale group); ``reference`` ``[n, m]``. The score of a pair is the cosine between the
    reference column and the span of the item's ``G`` contributions (1 when some per-group scaling of the item
    reproduces it), so a scale tensor that did not follow its rows cannot hide the match. Needs ``n`` well
    above ``G``.
    """
    g, n, m = parts.shape
    basis = parts.to(torch.float64).permute(2, 1, 0)  # [m, n, G]
    q, r = torch.linalg.qr(basis)
    diag = r.diagonal(dim1=-2, dim2=-1).abs()
    q = q * (diag > 1e-12 * diag.amax(dim=-1, keepdim=True).clamp_min(1e-300))[:, None, :]  # drop empty groups
    ref = _unit_columns(reference.to(torch.float64))
    return match_scores(lambda rows: torch.einsum("ing,nj->igj", q[rows], ref).norm(dim=1), m)


def match_scores(scores: Callable[[torch.Tensor], torch.Tensor], m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assign each of ``m`` suspect items a distinct reference item from a score function.

    ``scores(rows)`` gives the ``[len(rows), m]`` similarities of some suspect items to every reference item.
    Each suspect item takes its best reference item; when several claim the same one the best keeps it and the
    others take their best free item, repeatedly (greedy, no Hungarian solve). Returns ``(perm, margin)``:
    ``margin[i]`` is the matched score minus the best score of any other reference item (≤ 0 for an item that
    lost a conflict).
    """
    chunk = max(1, (1 << 24) // max(m, 1))
    top1 = torch.empty(m, dtype=torch.long)
    top1_val = torch.empty(m, dtype=torch.float64)
    top2_val = torch.full((m,), math.inf, dtype=torch.float64)  # m == 1: nothing else to confuse it with
    for start in range(0, m, chunk):
        rows = torch.arange(start, min(m, start + chunk))
        v, i = scores(rows).topk(min(2, m), dim=1)
        top1[rows], top1_val[rows] = i[:, 0], v[:, 0]
        if m > 1:
            top2_val[rows] = v[:, 1]
    perm = top1.clone()
    first_won = _claim_winners(top1, top1_val, m)
    lost = (~first_won).nonzero().flatten()
    margin = torch.where(torch.isfinite(top2_val), top1_val - top2_val, torch.ones_like(top1_val))
    if len(lost):
        taken = torch.zeros(m, dtype=torch.bool)
        taken[top1[first_won]] = True
        if len(lost) * m > (1 << 26):  # degenerate (e.g. every output zero): hand out free columns in order
            perm[lost] = (~taken).nonzero().flatten()[: len(lost)]
            margin[lost] = 0.0
        else:
            sc = scores(lost)
            pending = torch.arange(len(lost))
            while len(pending):
                val, cand = sc[pending].masked_fill(taken[None, :], -math.inf).max(dim=1)
                won = _claim_winners(cand, val, m)
                perm[lost[pending[won]]] = cand[won]
                taken[cand[won]] = True
                pending = pending[~won]
            margin[lost] = sc.gather(1, perm[lost][:, None])[:, 0] - top1_val[lost]
    return perm, margin


def _claim_winners(claimed: torch.Tensor, score: torch.Tensor, m: int) -> torch.Tensor:
    """Which claimants win: for each claimed item, the claimant with the highest score (ties: lowest position)."""
    order = torch.sort(-score, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    best = torch.full((m,), len(order), dtype=torch.long)
    best.scatter_reduce_(0, claimed, rank, reduce="amin")
    return best[claimed] == rank


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖ / ‖b‖`` in fp64 (0 when both are zero, ∞ when only ``b`` is)."""
    den = float(b.to(torch.float64).norm())
    num = float((a.to(torch.float64) - b.to(torch.float64)).norm())
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _result(side, perm, margin, residual, residual0, calls, rows, ambiguity_tol=1e-6) -> FingerprintResult:
    amb = (margin < ambiguity_tol).nonzero().flatten().tolist()
    conf = float(margin.min().clamp(0.0, 1.0)) if len(margin) else 1.0
    return FingerprintResult(side, perm, detect_block_structure(perm, side), residual, residual0, conf, amb,
                             calls, rows)


class _Counted:
    def __init__(self, fn, what):
        self.fn, self.what, self.calls = fn, what, 0

    def __call__(self, x):
        self.calls += 1
        y = self.fn(x)
        if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != x.shape[0]:
            raise LayoutError(f"fingerprint: the {self.what} op returned {getattr(y, 'shape', type(y))} for an "
                              f"input of shape {list(x.shape)}; expected [{x.shape[0]}, out_features]")
        return y.to(torch.float64)


def probe_inputs(in_features: int, n_probes: int, groups: int = 1, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random normal probes ``[groups·n_probes, in_features]``; with ``groups > 1`` probe block ``g`` is non-zero
    only on input columns of group ``g`` (so per-group output rescalings can be seen through)."""
    if groups < 1 or in_features % groups:
        raise LayoutError(f"probe groups: {in_features} input features cannot be split into {groups} groups")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(groups * n_probes, in_features, generator=gen, dtype=torch.float64)
    if groups > 1:
        width = in_features // groups
        mask = (torch.arange(in_features)[None, :] // width) == (torch.arange(groups * n_probes)[:, None] // n_probes)
        x = x * mask
    return x.to(dtype)


def fingerprint(reference: Callable[[torch.Tensor], torch.Tensor], suspect: Callable[[torch.Tensor], torch.Tensor],
                in_features: int, *, out_features: int | None = None, side: Side = "rows", n_probes: int = 64,
                groups: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> FingerprintResult:
    """Find the permutation between two ops (callables ``[n, in_features] → [n, out_features]``).

    ``side="rows"`` (output side): **2 probe calls** (one per op) on one batch of ``groups·n_probes`` random
    inputs; each suspect output column is matched to the reference column with the highest mean cosine over the
    probe groups. ``side="cols"`` (input side): **2 probe calls** on the ``in_features`` unit inputs; each
    suspect input's response is matched to a reference input's response. Exact for any permutation of an op
    whose rows (columns) are distinguishable; indistinguishable ones are reported in ``ambiguous`` and drive the
    confidence to 0. An identical pair gives the identity ("no permutation").
    """
    ref, sus = _Counted(reference, "reference"), _Counted(suspect, "suspect")
    if side == "rows":
        x = probe_inputs(in_features, n_probes, groups, seed, dtype).to(device)
        r, s = ref(x).cpu(), sus(x).cpu()
        if r.shape != s.shape or (out_features is not None and r.shape[1] != out_features):
            raise LayoutError(f"fingerprint: reference gives {list(r.shape)}, suspect {list(s.shape)}"
                              + (f", expected out_features={out_features}" if out_features else ""))
        perm, margin = match_columns(s.split(n_probes), r.split(n_probes))
        res, res0 = relative_error(s, r[:, perm]), relative_error(s, r)
        return _result(side, perm, margin, res, res0, ref.calls + sus.calls, x.shape[0])
    if side == "cols":
        x = torch.eye(in_features, dtype=dtype, device=device)
        r, s = ref(x).cpu(), sus(x).cpu()  # row j = the op's response to input j alone
        if r.shape != s.shape:
            raise LayoutError(f"fingerprint: reference gives {list(r.shape)}, suspect {list(s.shape)}")
        perm, margin = match_columns([s.T], [r.T])
        res, res0 = relative_error(s, r[perm]), relative_error(s, r)
        return _result(side, perm, margin, res, res0, ref.calls + sus.calls, x.shape[0])
    raise LayoutError(f"fingerprint: side must be 'rows' or 'cols', got {side!r}")


def fingerprint_recorded(inputs: torch.Tensor, outputs: torch.Tensor,
                         suspect: Callable[[torch.Tensor], torch.Tensor], *, side: Side = "rows",
                         groups: int = 1) -> FingerprintResult:
    """Fingerprint a suspect op against recorded arrays (golden activation dumps of a trusted run).

    ``inputs`` ``[n, in]`` and ``outputs`` ``[n, out]`` are what the trusted op saw and produced. Rows: **1
    probe call** (the suspect on the recorded inputs), columns matched by cosine over the ``n`` recorded rows —
    distinct outputs separate once ``n`` is a few dozen. With ``groups > 1`` the call holds the recorded inputs
    restricted to each of ``groups`` contiguous input groups (``groups·n`` rows) and each recorded output is
    matched to the span of a suspect output's per-group parts (:func:`match_subspaces`), which sees through
    scales that did not follow their rows; it needs ``n`` well above ``groups``. Columns: the suspect's response
    to the unit inputs (**1 call**), then either the reference's responses solved by least squares (needs
    ``n ≥ in`` independent rows) or, for ``out ≥ in``, the permuted inputs solved from the suspect's responses;
    **1 more call** measures the residual.
    """
    x, y = inputs, outputs.to(torch.float64)
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise LayoutError(f"fingerprint_recorded: inputs {list(x.shape)} and outputs {list(y.shape)} must be "
                          f"[n, in] and [n, out] with the same n")
    sus = _Counted(suspect, "suspect")
    if side == "rows":
        if groups > 1:
            n, k = x.shape
            if k % groups:
                raise LayoutError(f"fingerprint_recorded: {k} input features cannot be split into {groups} groups")
            mask = (torch.arange(k)[None, :] // (k // groups)) == torch.arange(groups)[:, None]
            parts = sus((x[None] * mask[:, None, :].to(x.dtype)).reshape(groups * n, k)).cpu()
            parts = parts.view(groups, n, -1)
            s = parts.sum(0)  # the op is linear: the parts add up to its output on the recorded inputs
        else:
            s = sus(x).cpu()
        if s.shape != y.shape:
            raise LayoutError(f"fingerprint_recorded: suspect gives {list(s.shape)}, recorded outputs are "
                              f"{list(y.shape)}")
        perm, margin = match_subspaces(parts, y) if groups > 1 else match_columns([s], [y])
        return _result(side, perm, margin, relative_error(s, y[:, perm]), relative_error(s, y), sus.calls,
                       groups * x.shape[0])
    if side != "cols":
        raise LayoutError(f"fingerprint_recorded: side must be 'rows' or 'cols', got {side!r}")
    n, k = x.shape
    xd = x.to(torch.float64)
    m_s = sus(torch.eye(k, dtype=x.dtype)).cpu()  # [in, out]: response to each input alone
    if n >= k and int(torch.linalg.matrix_rank(xd)) == k:
        m_r = torch.linalg.lstsq(xd, y).solution  # [in, out]: the trusted op's response to each input
        perm, margin = match_columns([m_s.T], [m_r.T])
    elif y.shape[1] >= k and int(torch.linalg.matrix_rank(m_s)) == k:
        permuted_inputs = y @ torch.linalg.pinv(m_s)  # = x[:, perm], since reference(x) = suspect(x[:, perm])
        perm, margin = match_columns([permuted_inputs], [xd])
    else:
        raise LayoutError(f"fingerprint_recorded: an input-side fingerprint needs ≥ {k} independent recorded rows "
                          f"(got {n}) or an op with out_features ≥ in_features of full rank")
    s = sus(x[:, perm]).cpu()
    return _result(side, perm, margin, relative_error(s, y), relative_error(sus(x).cpu(), y), sus.calls, k)


__all__ = ["FingerprintResult", "fingerprint", "fingerprint_recorded", "match_columns", "match_subspaces",
           "match_scores", "probe_inputs", "relative_error"]
