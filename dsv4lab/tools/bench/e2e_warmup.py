"""``bench e2e``'s warm-up part and its first-prompt row (issue 34: no compilation on the request path).

* **warmup** (unless ``--no-warmup``): right after load, :meth:`ModelRunner.warmup
  <dsv4lab.engine.runner.ModelRunner.warmup>` — one prefill chunk per bucket and one decode step per batch tier,
  captured on the graph paths — timed, with the number of kernel specializations it launched
  (:class:`~dsv4lab.engine.warmup.WarmupReport`).
* **first_prompt**: for each ``--first-prompts`` length, in that order and before any other part has run a prompt,
  the TTFT of the *first* prompt of that length (prefill in the engine's chunks, then the first token's argmax read
  on the host), then the median of ``--rounds`` more of the same prompt (warm). ``ratio`` = first / warm; the
  issue's target is ``ratio ≤ 1.2`` at every length from 1 to 8,192 tokens. Run with ``--no-warmup`` it measures
  what a cold start costs instead (the compilation stall the warm-up removes).
"""
from __future__ import annotations

import statistics

import torch

from dsv4lab.engine.triton_prefill import prefill_chunk
from dsv4lab.tools.verify.model import fixed_sequence

FIRST_PROMPT_TARGET = 1.2
"""The issue's bound on a first prompt's TTFT, in units of the warm TTFT of the same length."""


def warmup_part(runner) -> dict:
    """The runner's warm-up, timed: the :class:`~dsv4lab.engine.warmup.WarmupReport` as a dict."""
    return runner.warmup(progress=False).to_dict()


def first_prompt_rows(runner, clock, lengths: list[int], rounds: int, after_warmup: bool) -> dict:
    """The first-prompt TTFT at each of ``lengths`` against the warm TTFT of the same prompt (see the module
    docstring). ``clock.time(fn)`` times ``fn`` with the device synchronised."""
    rows = []
    for n in lengths:
        ids = torch.tensor([fixed_sequence(runner.args, n, seed=34 + n)], device=runner.device)
        chunk = prefill_chunk(n)
        first: list[int] = []

        def once():
            first.append(int(runner.prefill(ids, chunk)[0].argmax()))  # (prefill resets the slot)
        times = [clock.time(once) for _ in range(rounds + 1)]
        warm = statistics.median(times[1:])
        ratio = times[0] / warm if warm > 0 else None
        rows.append(dict(prompt_tokens=n, chunk=chunk, first_ttft_s=round(times[0], 4), warm_ttft_s=round(warm, 4),
                         warm_rounds_s=[round(t, 4) for t in times[1:]],
                         ratio=None if ratio is None else round(ratio, 3), first_token=first[0],
                         same_token=len(set(first)) == 1))
    runner.reset()
    met = all(r["ratio"] is not None and r["ratio"] <= FIRST_PROMPT_TARGET for r in rows) if rows else None
    return dict(after_warmup=after_warmup, prefill_path=runner.prefill_path, target_ratio=FIRST_PROMPT_TARGET,
                met=met if after_warmup else None, rows=rows)


def format_first_prompts(doc: dict) -> list[str]:
    """Summary lines of the warm-up and first-prompt parts (none where they did not run)."""
    lines = []
    w = doc.get("warmup")
    if w:
        lines.append(f"warm-up {w['seconds']:.1f} s ({w['prefill_path']} prefill: {len(w['prefill_s'])} buckets; "
                     f"{w['decode_path']} decode: {len(w['decode_s'])} tiers; {w['specializations']} kernel "
                     f"specializations of {w['kernels']} kernels)")
    fp = doc.get("first_prompt")
    if fp and fp.get("rows"):
        cells = ", ".join(f"{r['prompt_tokens']}: {r['first_ttft_s']:.3f}/{r['warm_ttft_s']:.3f} s" for r in fp["rows"])
        verdict = "" if fp["met"] is None else f" (≤ {fp['target_ratio']}× warm: {'met' if fp['met'] else 'missed'})"
        lines.append(f"first prompt {'after warm-up' if fp['after_warmup'] else 'cold'}, first/warm TTFT by "
                     f"length: {cells}{verdict}")
    return lines
