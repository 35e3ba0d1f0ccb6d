"""One speculative cycle as a static device function (fixed shapes per batch tier and draft count ``K``): the draft
chain, the rollback of what the chain wrote, the verify step of ``K+1`` tokens with the MTP block, the acceptance,
the rollback of the rejected positions and the MTP block's step at the last accepted position — no host read, so
:class:`~dsv4lab.engine.decode_graph.DecodeGraphs` captures it per (tier, ``K``) and a cycle is one graph replay.

It is :class:`~dsv4lab.engine.speculative.SpeculativeDecoder`'s cycle (see that module for the method) on the static
step (:mod:`dsv4lab.engine.decode_graph`), with two rewrites that make it uniform over the rows:

* :class:`StaticSnapshot` is :class:`~dsv4lab.engine.speculative.CacheSnapshot` as one gather of ``K+1`` ring rows per
  ring cache and, per rollback, one scatter per ring cache and one NaN fill of at most ``K//r + 1`` entries per entry
  cache (rows not rolled back go to the spare cache slot);
* after the acceptance the MTP caches are rolled back to ``P+m`` for **every** row and the MTP block runs once at
  ``P+m`` with the token emitted there (``t_m``) and the main streams of that position. Where a draft was rejected
  that is the eager decoder's re-run; where every draft held (``m = k``) it recomputes what the verify step's MTP
  row ``k`` computed from the same inputs (its last real row is fed the greedy choice ``t_k``), and writes the same
  values — one code path, no branch on the host.

A row verifies ``k[i] ≤ K`` drafts (``k[i] = 0``: a plain step; the row still returns the MTP block's next draft).
The chain runs ``K−1`` one-token MTP steps for every row; a row's steps past its ``k[i]`` stay at its position
``P + k[i] − 1`` (so no write leaves the snapshot's range or ``max_seq_len``) and are rolled back with the rest.
``forced [b, K]`` replaces drafts (−1 keeps the MTP block's): teacher forcing, and the benchmark's injected
acceptance (``bench e2e``); ``generate`` and the server never pass it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


CacheList = list[tuple[bool, torch.Tensor, int]]


def rollback_caches(model, n: int) -> tuple[CacheList, CacheList]:
    """The caches a rollback of ``n`` positions restores, in block order (main layers, then the MTP block):
    ``(is_mtp, buffer, period)`` per ring cache and ``(is_mtp, buffer, ratio)`` per entry cache. A ring cache of
    fewer than ``n`` rows is refused (``n`` positions would overwrite each other's rows)."""
    rings: CacheList = []
    entries: CacheList = []
    for i, blk in enumerate(model.blocks()):
        is_mtp = i >= model.args.n_layers
        for buf, period in blk.attn.ring_caches():
            if n > period:
                raise ValueError(f"a snapshot of {n} positions does not fit a ring cache of {period} rows")
            rings.append((is_mtp, buf, period))
        for buf, ratio in blk.attn.entry_caches():
            entries.append((is_mtp, buf, ratio))
    return rings, entries


class StaticSnapshot:
    """What writing positions ``start[i] .. start[i]+n−1`` of each row's slot can destroy, as fixed-shape tensors:
    :meth:`take` gathers the ``n`` ring rows of every ring cache (main layers and MTP block); :meth:`restore` puts
    back the rows of positions ``≥ keep[i]`` and sets the entries those positions completed back to NaN — byte for
    byte the state of a run of the kept positions alone (as :class:`~dsv4lab.engine.speculative.CacheSnapshot`).

    One launch per cache and direction: a row that must not be restored is written to the **spare cache slot**
    instead (no sequence owns it, the graphs pad batches there), so a restore is one scatter, never a gather, a
    select and a scatter; the index tensors are computed once per call and shared by the caches."""

    def __init__(self, model, n: int):
        if getattr(model, "spare_slot", None) is None:
            raise ValueError("the static rollback writes what it keeps to the spare cache slot: load the model "
                             "with dsv4lab.load")
        self.n, self.spare = n, model.spare_slot
        self.rings, self.entries = rollback_caches(model, n)

    def _rows(self, start: torch.Tensor) -> dict[int, torch.Tensor]:
        """Ring rows ``[b, n]`` of the positions ``start … start+n−1``, per ring period."""
        pos = start[:, None] + torch.arange(self.n, device=start.device)[None, :]
        return {period: pos % period for period in {p for _, _, p in self.rings}}

    def take(self, slots: torch.Tensor, start: torch.Tensor) -> list[torch.Tensor]:
        rows = self._rows(start)
        return [buf[slots[:, None], rows[period]] for _, buf, period in self.rings]  # (indexing copies)

    def restore(self, saved: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor,
                keep_main: torch.Tensor | None, keep_mtp: torch.Tensor | None) -> None:
        """Undo every write to a position ``≥ keep[i]`` of row ``i`` since :meth:`take`: the main layers' caches to
        ``keep_main``, the MTP block's to ``keep_mtp`` (None leaves those as they are)."""
        rows = self._rows(start)
        pos = start[:, None] + torch.arange(self.n, device=start.device)[None, :]
        for is_mtp, keep in ((False, keep_main), (True, keep_mtp)):
            if keep is None:
                continue
            dest = torch.where(pos >= keep[:, None], slots[:, None], self.spare)  # [b, n]: the slot, or the spare
            for (mtp, buf, period), old in zip(self.rings, saved):
                if mtp == is_mtp:
                    buf[dest, rows[period]] = old
            firsts: dict[int, tuple] = {}
            for mtp, buf, ratio in self.entries:
                if mtp != is_mtp:
                    continue
                # entries keep//r .. (start+n)//r − 1 were completed by positions ≥ keep (a contiguous run)
                if ratio not in firsts:
                    ent = (keep // ratio)[:, None] + torch.arange(self.n // ratio + 1, device=keep.device)[None, :]
                    firsts[ratio] = (ent, (start + self.n) // ratio)
                ent, end = firsts[ratio]
                drop = ent < end.clamp(max=buf.shape[1])[:, None]
                # the NaN is a device tensor: a Python float would be copied from the host, which a CUDA graph
                # capture refuses (the H200 visit at d1b16dd ran every speculative cycle eagerly because of it)
                buf.index_put_((torch.where(drop, slots[:, None], self.spare), ent.clamp(max=buf.shape[1] - 1)),
                               torch.full((), float("nan"), dtype=buf.dtype, device=buf.device))


@dataclass
class CycleOutput:
    """One cycle's results per row: the drafts ``[b, K]``, the main model's greedy targets ``[b, K+1]``, the
    accepted count ``m [b]`` (the row emits ``targets[:m+1]``), the verify step's main and MTP logits ``[b, K+1,
    vocab]``, and the MTP block at ``P+m``: its logits ``[b, vocab]`` (the next cycle's first draft is their argmax)
    and output streams ``[b, hc, D]`` (the next chain's input)."""

    drafts: torch.Tensor
    targets: torch.Tensor
    accepted: torch.Tensor
    logits: torch.Tensor
    mtp_logits: torch.Tensor
    next_mtp_logits: torch.Tensor
    next_streams: torch.Tensor


class SpeculativeCycle:
    """``cycle(x, d1, streams, start, k, slots, forced) → CycleOutput`` for ``K`` drafts (see the module doc):
    ``x [b]`` the token at ``start`` (not run yet), ``d1 [b]`` the MTP block's draft of the token after it,
    ``streams [b, hc, D]`` its output streams at ``start − 1``, ``k [b]`` drafts to verify per row (``≤ K``),
    ``forced [b, K]`` drafts to use instead of the chain's (−1: the chain's). The caches end holding positions
    ``< start + m + 1`` (main and MTP); ``runner.positions`` and ``mtp_positions`` are the caller's."""

    def __init__(self, step, K: int):
        if K < 1:
            raise ValueError(f"a speculative cycle needs at least one draft, got K={K}")
        self.step, self.K = step, K
        self.snapshot = StaticSnapshot(step.model, K + 1)

    @torch.inference_mode()
    def __call__(self, x, d1, streams, start, k, slots, forced) -> CycleOutput:
        step, K, snap = self.step, self.K, self.snapshot
        b = x.shape[0]
        saved = snap.take(slots, start)
        drafts, st = [d1], streams
        last = start + (k - 1).clamp(min=0)  # the chain never writes past a row's last verified position
        for j in range(1, K):  # d_{j+1} from the MTP block at P+j−1, fed d_j and its own streams
            lg, st = step.mtp(st, drafts[-1], torch.minimum(start + j - 1, last), slots)
            drafts.append(lg.argmax(-1))
        drafts = torch.where(forced >= 0, forced, torch.stack(drafts, 1))
        snap.restore(saved, slots, start, None, start)  # the verify reads the MTP caches as they were
        out = step.run(torch.cat((x[:, None], drafts), 1), start, slots, lengths=k + 1, mtp=True)
        targets = out.logits.argmax(-1)
        held = (drafts == targets[:, :K]) & (torch.arange(K, device=x.device)[None, :] < k[:, None])
        m = held.long().cumprod(1).sum(1)
        snap.restore(saved, slots, start, start + m + 1, start + m)
        rows = torch.arange(b, device=x.device)
        lg, st = step.mtp(out.hidden[rows, m], targets[rows, m], start + m, slots)
        return CycleOutput(drafts, targets, m, out.logits, out.mtp_logits, lg, st)


def run_cycle(decoder, cycles: dict, x, d1, streams, start, k, slots, forced) -> CycleOutput:
    """One cycle of ``K = forced.shape[1]`` drafts through ``decoder`` (graph-replayed per (tier, K) where the
    decoder has graphs); ``cycles`` caches the :class:`SpeculativeCycle` per ``K``."""
    K = forced.shape[1]
    if K not in cycles:
        cycles[K] = SpeculativeCycle(decoder.step, K)
    spare = decoder.runner.spare_slot if decoder.runner.spare_slot is not None else 0
    return decoder.call(f"speculative K{K}", cycles[K], [x, d1, streams, start, k, slots, forced],
                        [0, 0, 0, 0, 0, spare, -1])


__all__ = ["StaticSnapshot", "SpeculativeCycle", "CycleOutput", "run_cycle"]
