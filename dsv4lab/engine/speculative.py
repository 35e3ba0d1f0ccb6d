"""Lossless self-speculative greedy decoding with the MTP block, and exact cache rollback (issue 23).

One **cycle** of a sequence whose caches hold positions ``< P`` and whose next token ``x_P`` is chosen but not run:

1. **Draft** ``k`` tokens. ``d_1`` is the greedy choice of the MTP logits at ``P−1`` (left by the previous cycle);
   ``d_2..d_k`` chain the MTP block, as DeepSeek-V3-style MTP serving does: at position ``P+j−1`` it takes its own
   output streams of the position before in place of the main model's, and the embedding of ``d_j``.
2. **Verify** the draft in one ``(k+1)``-token forward of ``[x_P, d_1..d_k]`` at ``P..P+k`` through
   ``runner.forward(..., mtp=True)``: the main logits give the greedy targets ``t_0..t_k``; the MTP block runs at
   the same positions, fed ``d_1..d_k`` and ``t_k``.
3. **Accept** the longest prefix with ``d_j = t_{j−1}`` (``m`` drafts) and emit ``d_1..d_m, t_m`` — ``m+1`` tokens,
   each the main model's greedy choice after the tokens before it.
4. **Roll back** the rest exactly (:class:`CacheSnapshot`): the main caches keep ``P..P+m``; the MTP caches keep
   ``P..P+m−1`` (at ``P+m`` they were fed ``d_{m+1}``, not ``t_m``), or ``P..P+k`` when every draft was accepted.
   After a rejection the MTP block runs once more at ``P+m`` with ``t_m``: that gives the next cycle's ``d_1``.

Why it is lossless: the reference rounds a row the same whatever the chunking and batching (decode = prefill, bit
for bit), and the rollback restores every cache byte a rejected position wrote, so the logits behind each emitted
token are those plain greedy decoding computes for it: the ids and the trajectory hash are equal
(``tests/test_speculative.py``, ``dsv4lab verify model --speculative mtp``). A backend that rounds a multi-token
forward differently from a one-token step (a prefill kernel against a decode kernel) keeps the method correct
but may break exact equality where the top-2 margin is within that rounding.

**Two paths.** On the eager decode path (``runner.decode_path == "eager"``, and for teacher forcing) a cycle runs
through ``runner.forward(..., mtp=True)`` / ``runner.forward_mtp`` with :class:`CacheSnapshot`. On the static path
(``"static"``, ``"graph"``: ``runner.decoder``) the whole cycle — chain, rollback, ``(k+1)``-token verify step with
the MTP block, acceptance, rollback, the MTP step at the last accepted position — is one static device function
(:mod:`dsv4lab.engine.speculative_step`), captured as one CUDA graph per (batch tier, ``K``) on a GPU; the host
reads each cycle's accepted counts and tokens once. Both emit the ids plain greedy decoding emits.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from dsv4lab.engine.decode_graph import step_tokens
from dsv4lab.engine.speculative_step import rollback_caches, run_cycle

METHODS = ("mtp",)


def check_speculative(method: str | None, temperature: float = 0.0) -> None:
    """Raise ``ValueError`` for an unknown method or a sampled (temperature > 0) request."""
    if method not in METHODS:
        raise ValueError(f"speculative={method!r}: known methods: {', '.join(METHODS)}")
    if temperature > 0:
        raise ValueError("speculative decoding is greedy here (lossless: the same ids as plain greedy decoding); "
                         f"temperature must be 0, got {temperature}")


def max_draft_tokens(model) -> int:
    """The most drafts one cycle may verify: its ``k+1`` positions must fall on distinct rows of every ring cache
    (the window, the compressor states: ``2·ratio`` rows), so that a snapshot of those rows can restore them, and
    fit one static step (the window rings were sized for ``step_tokens`` tokens: ``load(..., max_step_tokens)``)."""
    rings = min(period for blk in model.blocks() for _, period in blk.attn.ring_caches())
    return min(rings, step_tokens(model)) - 1


def check_draft_tokens(runner, draft_tokens) -> None:
    """Raise a one-line ``ValueError`` unless ``runner``'s model has an MTP block and ``draft_tokens`` is an integer
    in ``[1, max_draft_tokens(model)]`` (a :class:`SpeculativeDecoder`'s, and the warm-up's for speculation)."""
    if not len(runner.model.mtp):
        raise ValueError(f"{runner.checkpoint or 'this model'} has no MTP block: speculative decoding needs one")
    limit = max_draft_tokens(runner.model)
    if not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= limit:
        raise ValueError(f"draft_tokens must be an integer in [1, {limit}] for this model (a cycle's positions "
                         f"must fit its smallest ring cache and one decode step), got {draft_tokens!r}")


class CacheSnapshot:
    """What writing positions ``start[i] .. start[i]+n−1`` of each slot can destroy, kept for an exact rollback.

    Ring caches (see ``Attention.ring_caches``) hold position ``p`` in row ``p mod period``: writing ``p``
    overwrites ``p − period``, which later positions may still read, so those ``n`` rows are copied. Entry caches
    (``Attention.entry_caches``) only append: an entry completed by a rolled-back position is set back to NaN,
    what an unwritten entry holds. :meth:`restore` therefore leaves the caches byte for byte as if only the kept
    positions had been run.
    """

    def __init__(self, model, slots: torch.Tensor, start: torch.Tensor, n: int):
        self.slots, self.start, self.n = slots, start, n
        self.positions = start[:, None] + torch.arange(n, device=start.device)[None, :]  # [b, n]
        rings, self.entries = rollback_caches(model, n)
        self.rings: list[tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for is_mtp, buf, period in rings:
            rows = self.positions % period
            self.rings.append((is_mtp, buf, rows, buf[slots[:, None], rows].clone()))

    def restore(self, keep_main: torch.Tensor | None, keep_mtp: torch.Tensor | None) -> None:
        """Undo every write to a position ``≥ keep[i]`` of row ``i`` since the snapshot: the main layers' caches to
        ``keep_main``, the MTP blocks' to ``keep_mtp`` (None leaves those caches as they are)."""
        for is_mtp, buf, rows, saved in self.rings:
            keep = keep_mtp if is_mtp else keep_main
            if keep is None:
                continue
            r, j = (self.positions >= keep[:, None]).nonzero(as_tuple=True)
            buf[self.slots[r], rows[r, j]] = saved[r, j]
        for is_mtp, buf, ratio in self.entries:
            keep = keep_mtp if is_mtp else keep_main
            if keep is None:
                continue
            # entries keep//ratio .. (start+n)//ratio − 1 were completed by positions >= keep
            ent = (keep // ratio)[:, None] + torch.arange(self.n // ratio + 1, device=keep.device)[None, :]
            end = ((self.start + self.n) // ratio).clamp(max=buf.shape[1])
            r, j = (ent < end[:, None]).nonzero(as_tuple=True)
            buf[self.slots[r], ent[r, j]] = float("nan")


@dataclass
class SpeculativeStats:
    """Counters of a :class:`SpeculativeDecoder` (``cycles`` counts one row in one verify forward)."""

    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    verify_forwards: int = 0
    mtp_forwards: int = 0  # MTP-only forwards: chained drafts and the re-runs after a rejection

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_cycle(self) -> float:
        return self.emitted / self.cycles if self.cycles else float("nan")

    def to_dict(self) -> dict:
        return dict(asdict(self), acceptance_rate=self.acceptance_rate, tokens_per_cycle=self.tokens_per_cycle)


@dataclass
class StepResult:
    """One slot's cycle: the tokens it emits, the main logits ``[len(tokens), vocab]`` each was chosen from (those of
    positions ``P..P+m``), the MTP logits of the same positions, and the draft counts."""

    tokens: list[int]
    logits: torch.Tensor
    mtp_logits: torch.Tensor
    drafted: int
    accepted: int


@dataclass
class _SlotState:
    position: int          # P: positions the main and MTP caches hold
    token: int             # x_P: the greedy choice at P−1, not run yet
    draft: int             # d_1: the MTP block's greedy choice at P−1 (a guess of the token at P+1)
    streams: torch.Tensor  # the MTP block's output streams at P−1, [hc, dim]: the chained drafts' input


class SpeculativeDecoder:
    """Self-speculative greedy decoding over a runner's cache slots (see the module doc).

    :meth:`prefill` starts sequences (or continues them chunk by chunk); each :meth:`step` runs one cycle for a set
    of slots. A slot given 0 drafts runs a plain one-token step, so a caller may pick another token than the greedy
    one (a sampled request) and pass it to the next step; its MTP state is then unused.
    """

    def __init__(self, runner, draft_tokens: int = 1):
        check_draft_tokens(runner, draft_tokens)
        self.runner, self.draft_tokens = runner, draft_tokens
        self.slots: dict[int, _SlotState] = {}
        self._cycles: dict = {}  # the static path's SpeculativeCycle per draft count
        self.stats = SpeculativeStats()

    # ------------------------------------------------------------------ prefill
    def prefill(self, tokens, slots: Sequence[int], lengths=None, next_tokens=None, chunk: int | None = None,
                logits: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
        """Start sequences: :meth:`ModelRunner.prefill` of ``tokens [b, n]`` (right-padded prompts, ``lengths``)
        with the MTP block, ``chunk`` tokens per forward; remember, per slot, the next token (``next_tokens[row]``,
        or the greedy choice where that is None or −1) and the MTP block's first draft. Returns the main and MTP
        logits (``logits="all"``: ``[b, n, vocab]``; ``"last"``: ``[b, vocab]``)."""
        r = self.runner
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        b, n = tokens.shape
        lens = [n] * b if lengths is None else torch.as_tensor(lengths).tolist()
        main, mtp_logits, streams = r.prefill(tokens, chunk, slots=list(slots), lengths=lengths, logits=logits,
                                              mtp=True, next_tokens=next_tokens)
        given = None if next_tokens is None else torch.as_tensor(next_tokens).tolist()
        for i, slot in enumerate(slots):
            at = (i,) if logits == "last" else (i, lens[i] - 1)
            token = int(main[at].argmax()) if given is None or given[i] < 0 else int(given[i])
            self.slots[int(slot)] = _SlotState(lens[i], token, int(mtp_logits[at].argmax()), streams[i])
        return main, mtp_logits

    # ------------------------------------------------------------------ one cycle
    @torch.inference_mode()
    def step(self, slots: Sequence[int], tokens: Sequence[int] | None = None,
             draft_counts: Sequence[int] | None = None, drafts: Sequence[Sequence[int]] | None = None,
             teacher: Sequence[Sequence[int]] | None = None) -> list[StepResult]:
        """One cycle per slot. ``tokens``: the token each slot continues with (default: the greedy choice the
        previous cycle emitted last); ``draft_counts``: drafts per slot (default ``draft_tokens``; fewer near the
        end of a budget; capped so the cycle stays within ``max_seq_len``).

        Teacher forcing (the rollback checks of ``dsv4lab.tools.verify.speculative``, the benchmark's injected
        acceptance): ``drafts`` replaces each slot's drafted ids, −1 keeping the chain's (the chain still runs, so
        its cache writes are still undone) and ``teacher`` gives the true tokens ``t_0..t_k`` of positions
        ``P+1..P+k+1`` in place of the greedy targets (the eager path only)."""
        r = self.runner
        dev, max_len = r.device, r.args.max_seq_len
        slots = [int(s) for s in slots]
        missing = [s for s in slots if s not in self.slots]
        if missing:
            raise ValueError(f"slots {missing} were not prefilled by this decoder")
        seqs = [self.slots[s] for s in slots]
        if any(q.position >= max_len for q in seqs):
            raise ValueError(f"a sequence already holds max_seq_len={max_len} positions")
        x = [q.token for q in seqs] if tokens is None else [int(t) for t in tokens]
        want = [self.draft_tokens] * len(seqs) if draft_counts is None else [int(k) for k in draft_counts]
        ks = [max(0, min(k, self.draft_tokens, max_len - 1 - q.position)) for k, q in zip(want, seqs)]
        if teacher is None and r.decoder is not None:  # the static step (graph-replayed on a GPU)
            return self._step_static(slots, seqs, x, ks, drafts)
        K = max(ks)
        slots_t = torch.tensor(slots, device=dev)
        P = torch.tensor([q.position for q in seqs], device=dev)
        snap = CacheSnapshot(r.model, slots_t, P, K + 1)
        chained = self._draft(seqs, slots, ks)
        if drafts is not None:
            drafts = [[int(t) for t in d][:k] for d, k in zip(drafts, ks)]
            if any(len(d) != k for d, k in zip(drafts, ks)):
                raise ValueError(f"drafts: expected {ks} ids per slot")
            drafts = [[c if t < 0 else t for t, c in zip(d, cd)] for d, cd in zip(drafts, chained)]
        else:
            drafts = chained
        # the chain wrote the MTP caches ahead of P; the verify must read them as they were
        snap.restore(None, P)
        r.mtp_positions[slots_t.cpu()] = P.cpu()

        tok = torch.tensor([[xi] * (K + 1) for xi in x], dtype=torch.long)
        for i, d in enumerate(drafts):
            tok[i, 1:1 + len(d)] = torch.tensor(d, dtype=torch.long)
        lengths = torch.tensor([k + 1 for k in ks], device=dev)
        last_next = None if teacher is None else [int(t[k]) for t, k in zip(teacher, ks)]
        logits, mtp_logits, X, Xm = r.forward(tok.to(dev), P, slots=slots_t, lengths=lengths, mtp=True,
                                              next_tokens=last_next, return_hidden=True)
        targets = logits.argmax(-1).tolist() if teacher is None else [[int(t) for t in row] for row in teacher]

        accepted = []
        for i, d in enumerate(drafts):
            m = 0
            while m < len(d) and d[m] == targets[i][m]:
                m += 1
            accepted.append(m)
        m_t = torch.tensor(accepted, device=dev)
        keep = P + m_t + 1
        keep_mtp = torch.where(m_t == torch.tensor(ks, device=dev), keep, P + m_t)
        snap.restore(keep, keep_mtp)
        r.positions[slots_t.cpu()] = keep.cpu()
        r.mtp_positions[slots_t.cpu()] = keep_mtp.cpu()

        # the MTP block at P+m: from the verify when every draft held, else run again with the token emitted there
        last_mtp = [(mtp_logits[i, m], Xm[i, m]) for i, m in enumerate(accepted)]
        redo = [i for i in range(len(seqs)) if accepted[i] < ks[i]]
        if redo:
            rows, cols = torch.tensor(redo, device=dev), m_t[redo]
            lg, streams = r.forward_mtp(X[rows, cols][:, None], [[targets[i][accepted[i]]] for i in redo],
                                        P[rows] + cols, slots=slots_t[rows])
            self.stats.mtp_forwards += 1
            for a, i in enumerate(redo):
                last_mtp[i] = (lg[a, 0], streams[a, 0])

        results = []
        for i, (q, m) in enumerate(zip(seqs, accepted)):
            emitted = targets[i][:m + 1]
            self.slots[slots[i]] = _SlotState(q.position + m + 1, emitted[-1], int(last_mtp[i][0].argmax()),
                                              last_mtp[i][1])
            results.append(StepResult(emitted, logits[i, :m + 1], torch.cat((mtp_logits[i, :m], last_mtp[i][0][None])),
                                      ks[i], m))
        st = self.stats
        st.cycles += len(seqs)
        st.verify_forwards += 1
        st.drafted += sum(ks)
        st.accepted += sum(accepted)
        st.emitted += sum(m + 1 for m in accepted)
        return results

    def _step_static(self, slots: list[int], seqs: list[_SlotState], x: list[int], ks: list[int],
                     drafts: Sequence[Sequence[int]] | None) -> list[StepResult]:
        """:meth:`step` through the runner's static decoder: one :class:`~dsv4lab.engine.speculative_step.
        SpeculativeCycle` (a graph replay on a GPU), then one read of the accepted counts and tokens."""
        r = self.runner
        K = max(1, max(ks))
        forced = torch.full((len(seqs), K), -1, dtype=torch.long)
        for i, d in enumerate(drafts or []):
            d = [int(t) for t in d][:ks[i]]
            if len(d) != ks[i]:
                raise ValueError(f"drafts: expected {ks} ids per slot")
            forced[i, :len(d)] = torch.tensor(d, dtype=torch.long)
        P = torch.tensor([q.position for q in seqs])
        out = run_cycle(r.decoder, self._cycles, torch.tensor(x), torch.tensor([q.draft for q in seqs]),
                        torch.stack([q.streams for q in seqs]), P, torch.tensor(ks), torch.tensor(slots), forced)
        host = torch.cat((out.accepted[:, None], out.next_mtp_logits.argmax(-1)[:, None], out.targets), 1).tolist()
        accepted, next_draft, targets = [h[0] for h in host], [h[1] for h in host], [h[2:] for h in host]
        keep = P + torch.tensor(accepted) + 1
        r.positions[slots] = keep
        r.mtp_positions[slots] = keep
        results = []
        for i, m in enumerate(accepted):
            emitted = targets[i][:m + 1]
            # copies: the graph's output buffers are rewritten by its next replay
            self.slots[slots[i]] = _SlotState(int(keep[i]), emitted[-1], next_draft[i], out.next_streams[i].clone())
            results.append(StepResult(emitted, out.logits[i, :m + 1].clone(),
                                      torch.cat((out.mtp_logits[i, :m], out.next_mtp_logits[i][None])), ks[i], m))
        st = self.stats
        st.cycles += len(seqs)
        st.verify_forwards += 1
        st.mtp_forwards += K  # the chain's K − 1 steps and the step at the last accepted position
        st.drafted += sum(ks)
        st.accepted += sum(accepted)
        st.emitted += sum(m + 1 for m in accepted)
        return results

    def _draft(self, seqs: list[_SlotState], slots: list[int], ks: list[int]) -> list[list[int]]:
        """``d_1`` from the previous cycle, then ``d_2..d_k`` by chaining the MTP block on its own streams (it runs
        at ``P+j−1`` with the embedding of ``d_j``, writing its caches ahead; the caller restores them)."""
        drafts = [[q.draft] if k > 0 else [] for q, k in zip(seqs, ks)]
        streams = [q.streams for q in seqs]
        for j in range(1, max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > j]
            lg, out = self.runner.forward_mtp(torch.stack([streams[i] for i in rows])[:, None],
                                              [[drafts[i][j - 1]] for i in rows],
                                              [seqs[i].position + j - 1 for i in rows], slots=[slots[i] for i in rows])
            self.stats.mtp_forwards += 1
            for a, i in enumerate(rows):
                drafts[i].append(int(lg[a, 0].argmax()))
                streams[i] = out[a, 0]
        return drafts


# ---------------------------------------------------------------------------------------------- generation
def _finished(token: int, n_out: int, n_prompt: int, max_new_tokens: int, args, stop_at_eos: bool) -> bool:
    """Plain greedy decoding's stopping rule after emitting a token (see ``ModelRunner.generate``)."""
    return ((stop_at_eos and token == args.eos_token_id) or n_out >= max_new_tokens
            or n_prompt + n_out >= args.max_seq_len)


@torch.inference_mode()
def generate_speculative(runner, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft_tokens: int = 1,
                         stop_at_eos: bool = True, slots: Sequence[int] | None = None,
                         prefill_chunk: int | None = None) -> tuple[list[list[int]], SpeculativeStats]:
    """Greedy self-speculative decoding of a batch of prompts (ragged: one right-padded prefill, then cycles over
    the rows still running). Returns each prompt's new ids — equal to ``runner.generate(prompt, max_new_tokens)``
    — and the counters."""
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts or not all(prompts):
        raise ValueError("every prompt needs at least one token")
    slots = list(range(len(prompts))) if slots is None else [int(s) for s in slots]
    dec = SpeculativeDecoder(runner, draft_tokens)
    outs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens <= 0:
        return outs, dec.stats
    width = max(map(len, prompts))
    dec.prefill([p + [p[-1]] * (width - len(p)) for p in prompts], slots, lengths=[len(p) for p in prompts],
                chunk=prefill_chunk, logits="last")
    active = []
    for i, p in enumerate(prompts):
        outs[i].append(dec.slots[slots[i]].token)
        if not _finished(outs[i][-1], 1, len(p), max_new_tokens, runner.args, stop_at_eos):
            active.append(i)
    while active:
        counts = [max_new_tokens - len(outs[i]) - 1 for i in active]  # the bonus token needs no draft
        results = dec.step([slots[i] for i in active], draft_counts=counts)
        still = []
        for i, res in zip(active, results):
            for t in res.tokens:
                outs[i].append(t)
                if _finished(t, len(outs[i]), len(prompts[i]), max_new_tokens, runner.args, stop_at_eos):
                    break
            else:
                still.append(i)
        active = still
    return outs, dec.stats


__all__ = ["SpeculativeDecoder", "SpeculativeStats", "StepResult", "CacheSnapshot", "generate_speculative",
           "check_speculative", "check_draft_tokens", "max_draft_tokens", "METHODS"]
