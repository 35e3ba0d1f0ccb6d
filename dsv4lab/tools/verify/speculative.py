"""``verify model --speculative mtp``: speculative decoding checked against the golden oracles of plain greedy
decoding, and teacher-forced logits across rollbacks at every cache boundary (issue 23).

* **speculative_oracles / speculative_trajectory** — the fixed-id oracles and the 256-token trajectory decoded
  with :func:`~dsv4lab.engine.speculative.generate_speculative`: the ids and hashes must equal the golden ones,
  which plain greedy decoding recorded (lossless).
* **rollback_vs_recompute** — a teacher-forced sequence run through speculative cycles whose drafts are made to
  fail at chosen places (:func:`rollback_vs_recompute`): one rejection lands on each boundary position (the
  window filling and wrapping, every compression ratio's block completion, the index top-k), so the position is
  written, rolled back and written again. The main and MTP logits of every position must equal those of one
  forward of the whole sequence (KL ≤ the bound, 1e-9 on the reference: bit-exact in practice).
"""
from __future__ import annotations

import torch

from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.engine.speculative import SpeculativeDecoder, generate_speculative
from dsv4lab.tools.verify.model import boundaries, boundary_report, first_mismatch, fixed_sequence, kl_per_position, \
    teacher_forced_length
from dsv4lab.tools.verify.report import md_table


def critical_positions(args) -> list[int]:
    """Positions whose rollback exercises a cache boundary: for each boundary ``b`` of
    :func:`dsv4lab.tools.verify.model.boundaries`, ``b−1`` (completes a block, fills the window) and ``b`` (wraps)."""
    return sorted({p for b in boundaries(args).values() for p in (b - 1, b)})


@torch.inference_mode()
def rollback_vs_recompute(runner, ids: list[int], draft_tokens: int = 3, seed: int = 0, slot: int = 0) -> dict:
    """Teacher-force ``ids`` through speculative cycles with forced rejections; compare with one forward.

    Each cycle at position ``P`` verifies ``k`` drafts (``draft_tokens``, fewer at the end): the first ``m`` are
    the true next ids, the rest wrong, so positions ``P+m+1..P+k`` are written and rolled back. ``m`` is random
    (seeded), except that every :func:`critical_positions` position is made the first rejected one of some
    cycle. Returns the per-position logits of both runs (``main``/``mtp``: ``(recompute, cycled)``, the last id
    only feeds the MTP block of the position before it), the rolled-back positions and the counters.
    """
    N = len(ids) - 1
    if N < 2:
        raise ValueError("rollback_vs_recompute needs at least 3 ids")
    t = torch.tensor([ids], device=runner.device)
    runner.reset([slot])
    full, full_mtp = runner.forward(t[:, :N], 0, slots=[slot], mtp=True, next_tokens=[ids[N]])
    runner.reset([slot])
    dec = SpeculativeDecoder(runner, draft_tokens)
    main, mtp = torch.full_like(full[0], float("nan")), torch.full_like(full_mtp[0], float("nan"))
    lg, mlg = dec.prefill(t[:, :1], [slot], next_tokens=[ids[1]])
    main[0], mtp[0] = lg[0, 0], mlg[0, 0]
    g = torch.Generator().manual_seed(seed)
    todo = [q for q in critical_positions(runner.args) if 1 <= q < N]
    rolled: list[int] = []
    P = 1
    while P < N:
        k = min(draft_tokens, N - 1 - P)
        m = int(torch.randint(0, k + 1, (1,), generator=g))
        while todo and todo[0] <= P:  # passed without a rollback (only when it is the position of x_P itself)
            todo.pop(0)
        if todo and todo[0] <= P + k:
            m = todo.pop(0) - P - 1  # the critical position is the first rejected one
        elif todo and todo[0] == P + k + 1 and m == k and k > 0:
            m = k - 1  # do not step onto it as x_P: the next cycle rejects it
        wrong = [(ids[P + j] + 1) % runner.args.vocab_size for j in range(m + 1, k + 1)]
        res = dec.step([slot], tokens=[ids[P]], draft_counts=[k], drafts=[ids[P + 1:P + m + 1] + wrong],
                       teacher=[ids[P + 1:P + k + 2]])[0]
        assert res.accepted == m, (res.accepted, m)
        main[P:P + m + 1], mtp[P:P + m + 1] = res.logits, res.mtp_logits
        rolled += range(P + m + 1, P + k + 1)
        P += m + 1
    runner.reset([slot])
    return dict(main=(full[0], main), mtp=(full_mtp[0], mtp), rolled_back=rolled, stats=dec.stats.to_dict(),
                missed_critical=todo)


def verify_speculative(runner, golden: dict, kl_bound: float, draft_tokens: int = 1,
                       skip_trajectory: bool = False) -> dict:
    """The speculative tiers (see the module doc) as ``{tier: row}``, in the shape of ``verify_model``'s tiers."""
    exact = runner.backend.startswith("reference") or getattr(runner.ops, "exact_semantics", False)
    tiers: dict = {}
    rows = []
    for o in golden["oracles"]:
        (ids,), st = generate_speculative(runner, [o["prompt_ids"]], len(o["expected_ids"]), draft_tokens)
        mm = first_mismatch(ids, o["expected_ids"])
        rows.append(dict(name=o["name"], ok=mm is None, hash=trajectory_hash(ids), expected_hash=o["hash"],
                         first_mismatch=mm, acceptance_rate=st.acceptance_rate))
    tiers["speculative_oracles"] = dict(ok=all(r["ok"] for r in rows), binding=exact, rows=rows,
                                        summary=", ".join(f"{r['name']!r}: {r['hash']}" for r in rows))
    if not skip_trajectory and "trajectory" in golden:
        tr = golden["trajectory"]
        (ids,), st = generate_speculative(runner, [tr["prompt_ids"]], tr["n_tokens"], draft_tokens,
                                          stop_at_eos=False)
        mm = first_mismatch(ids, tr["ids"])
        tiers["speculative_trajectory"] = dict(
            ok=mm is None, binding=exact, hash=trajectory_hash(ids), expected_hash=tr["hash"], first_mismatch=mm,
            stats=st.to_dict(), summary=f"hash {trajectory_hash(ids)} (golden {tr['hash']}), "
                                        f"acceptance {st.acceptance_rate:.3f}, {st.tokens_per_cycle:.2f} tokens/cycle")
    tf = golden.get("teacher_forced") or dict(ids=fixed_sequence(runner.args, teacher_forced_length(runner.args)))
    rb = rollback_vs_recompute(runner, tf["ids"], max(draft_tokens, 3))
    kl = [max(a, b) for a, b in zip(kl_per_position(*rb["main"]), kl_per_position(*rb["mtp"]))]
    brows, first, mx = boundary_report(kl, runner.args, kl_bound)
    tiers["rollback_vs_recompute"] = dict(
        ok=first is None and not rb["missed_critical"], binding=True, max_kl=mx, first_divergence=first,
        boundaries=brows, rolled_back=len(rb["rolled_back"]), missed_critical=rb["missed_critical"],
        summary=f"max KL {mx:.3g} (main and MTP logits) over {len(kl)} positions, {len(rb['rolled_back'])} "
                f"positions rolled back (every boundary among them), first divergence {first}")
    return tiers


def render_speculative(tiers: dict) -> list[str]:
    """Markdown lines of the speculative tiers for ``model.md``."""
    lines = []
    if "speculative_oracles" in tiers:
        lines += ["## Speculative decoding (MTP) against the golden oracles", "", md_table(
            tiers["speculative_oracles"]["rows"], ["name", "ok", "hash", "expected_hash", "first_mismatch",
                                                   "acceptance_rate"]), ""]
    for name in ("speculative_trajectory", "rollback_vs_recompute"):
        if name in tiers:
            lines += [f"- **{name}**: {'ok' if tiers[name]['ok'] else 'FAIL'} — {tiers[name]['summary']}"]
    if "rollback_vs_recompute" in tiers:
        lines += ["", md_table(tiers["rollback_vs_recompute"]["boundaries"], ["boundary", "positions", "max_kl", "ok"]),
                  ""]
    return lines


__all__ = ["critical_positions", "rollback_vs_recompute", "verify_speculative", "render_speculative"]
