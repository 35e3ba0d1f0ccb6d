"""``bench e2e``'s steps that carry several tokens (issue 32): the speculative verify step against the one-token step,
and speculative decoding's throughput with **injected acceptance**.

* **verify** (one row per ``k`` of ``--draft-tokens``): batch 1 after a 16-token prompt, on the engine's static path
  (graph replay on a GPU), µs per call of the one-token step, of the static step of ``k+1`` tokens with the MTP
  block (the verify step) and of the whole speculative cycle (draft chain, rollbacks, verify, the MTP step at the
  last accepted position; :mod:`dsv4lab.engine.speculative_step`). ``verify_over_step`` and ``cycle_over_step``
  are their times over the one-token step's; ``bytes_ratio`` and ``cycle_bytes_ratio`` the ratios of the bytes they
  read (modelled, :func:`step_bytes`) — the issue's target is ``verify_over_step ≤ 1.2 × bytes_ratio``.
* **verify profile** (CUDA, ``verify_profile``): where the verify step's time goes — GPU µs and launches by kernel
  family of the one-token step and of each verify step, replayed from graphs captured without PDL by a decoder of
  their own (as the breakdown is), and each family's µs over the one-token step's (``over_step``): the family that
  grows past the bytes ratio is what keeps the step from its target.
* **speculative** (one row per α of ``--alphas`` and ``k``): with random weights the MTP block's drafts are never
  right, so the benchmark — and only the benchmark: ``generate`` and the server never do this — replaces each draft
  by the true greedy next token with probability α (seeded; the draft of position ``P+j`` by plain greedy
  decoding's token there, which is the main model's greedy choice after the tokens before it whenever those were
  accepted). ``tok_s`` over ``--decode-tokens`` tokens against plain greedy tok/s of the same prompt in the same run
  (``speedup``); ``equal_to_greedy`` checks every emitted id. Beside it the bytes-bound ideal (modelled):
  ``ideal_speedup = E[tokens per cycle] × bytes(one-token step) / bytes(cycle)``, ``E = Σ_{j≤k} α^j``, and
  ``of_ideal`` = speedup / ideal.
* **natural acceptance** (``speculative_natural``): the same loop without injection — on the run's model (random
  weights: acceptance ≈ 0, the cost of speculating for nothing) and, in ``--smoke``, on ``data/tiny-py``, whose
  trained MTP block drafts for real (each row names its ``checkpoint``).
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

from dsv4lab.engine.decode_graph import Decoder
from dsv4lab.engine.loader import load
from dsv4lab.engine.speculative import SpeculativeDecoder, max_draft_tokens
from dsv4lab.engine.speculative_step import run_cycle
from dsv4lab.tools.bench.common import clock_us, kernel_profile, pdl_off, profiled, top_kernels
from dsv4lab.tools.perf.costmodel import decode_step, expected_distinct_experts
from dsv4lab.tools.verify.model import fixed_sequence

ALPHAS = (0.5, 0.7, 0.8, 0.9)
DRAFT_TOKENS = (1, 2, 3)


@contextlib.contextmanager
def static_path(runner):
    """The runner on its static decode path for the block (the eager path of a CPU run has no static step)."""
    before = runner.decode_path
    if before == "eager":
        runner.decode_path = "static"
    try:
        yield runner.decoder
    finally:
        runner.decode_path = before


def _timed_us(fn, device, reps: int) -> float:
    """µs per call of ``fn`` (the mean of ``reps`` back to back after one unmeasured call; CUDA events on a GPU)."""
    fn()
    if device.type == "cuda":
        return clock_us(fn, device, reps)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return round((time.perf_counter() - t0) * 1e6 / reps, 1)


# ============================================================================================ bytes (modelled)
def mtp_bytes(runner, rows: int) -> float:
    """Bytes the MTP block reads per rank for ``rows`` token rows (modelled): its dense weights, the expected
    distinct routed experts of the rows, and the LM head it predicts through."""
    blk = runner.model.mtp[0]
    dense = routed = 0
    for name, buf in blk.named_buffers():
        if buf is None or "tid2eid" in name:
            continue
        if ".experts." in f".{name}":
            routed += buf.nbytes
        else:
            dense += buf.nbytes
    a = runner.args
    frac = expected_distinct_experts(a.n_routed_experts, a.n_activated_experts, rows) / a.n_routed_experts
    return dense + routed * frac + runner.model.head.weight.nbytes


def step_bytes(runner, o: dict, rows: int, context: int, mtp_rows: int = 0) -> float:
    """Bytes a static step of ``rows`` token rows reads per rank (modelled): the cost model's decode step of that
    many rows (every weight once, the expected distinct routed experts, the KV and index keys of each row at
    ``context``), plus the MTP block for ``mtp_rows`` rows (:func:`mtp_bytes`)."""
    main = decode_step(runner.args, tp=o["tp"], ep=o["ep"], batch=rows, context=context).bytes_rank
    return main + (mtp_bytes(runner, mtp_rows) if mtp_rows else 0.0)


def cycle_bytes(runner, o: dict, k: int, context: int) -> float:
    """A speculative cycle of ``k`` drafts (modelled): the verify step (``k+1`` rows with the MTP block), the
    chain's ``k−1`` MTP steps and the MTP step at the last accepted position."""
    return step_bytes(runner, o, k + 1, context, mtp_rows=k + 1) + k * mtp_bytes(runner, 1)


# ============================================================================================ verify
def _after_prompt(runner, o: dict):
    """Slot 0 speculatively prefilled with the verify rows' 16-token prompt: ``(P, its slot state, slots [1],
    positions [1], the next token [1])``, the last three on the device."""
    dev = runner.device
    prompt = fixed_sequence(runner.args, 16, seed=5)
    spec = SpeculativeDecoder(runner, max(o["draft_tokens"]))
    spec.prefill([prompt], [0], logits="last")
    state = spec.slots[0]
    P = len(prompt)
    return P, state, torch.tensor([0], device=dev), torch.tensor([P], device=dev), torch.tensor([state.token],
                                                                                                 device=dev)


def verify_rows(runner, o: dict) -> list[dict]:
    """µs of the one-token step, the verify step and the whole cycle at batch 1, and their bytes (module doc)."""
    dev = runner.device
    reps = 5 if dev.type == "cuda" else 1
    rows = []
    with static_path(runner) as decoder:
        P, state, slots, pos, tok = _after_prompt(runner, o)
        advance = decoder.stepper(slots)
        step_us = _timed_us(lambda: advance(tok, pos), dev, reps)  # position P rewritten each call
        one = step_bytes(runner, o, 1, P)
        cycles: dict = {}
        for k in o["draft_tokens"]:
            tokens, n = tok.repeat(1, k + 1), torch.tensor([k + 1], device=dev)
            verify_us = _timed_us(lambda: decoder.run(tokens, pos, slots, n, mtp=True), dev, reps)
            args = (tok, torch.tensor([state.draft], device=dev), state.streams[None], pos,
                    torch.tensor([k], device=dev), slots, torch.full((1, k), -1, device=dev))
            cycle_us = _timed_us(lambda: run_cycle(decoder, cycles, *args), dev, reps)
            vb, cb = step_bytes(runner, o, k + 1, P, mtp_rows=k + 1), cycle_bytes(runner, o, k, P)
            rows.append(dict(draft_tokens=k, verify_over_step=round(verify_us / step_us, 3),
                             bytes_ratio=round(vb / one, 3), cycle_over_step=round(cycle_us / step_us, 3),
                             cycle_bytes_ratio=round(cb / one, 3), step_us=step_us, verify_us=verify_us,
                             cycle_us=cycle_us, step_bytes=round(one), verify_bytes=round(vb), cycle_bytes=round(cb),
                             path=runner.decode_path if runner.decode_path != "eager" else "static"))
    runner.reset()
    return rows


def verify_profile(runner, o: dict) -> dict:
    """The module doc's verify profile: ``{"step": {...}, "verify_k1": {...}, ...}``, each with ``total_us``,
    ``launches``, ``gpu_us`` and ``launches_by_family`` (by kernel family), its 25 costliest ``kernels``, the verify
    steps also ``over_step``."""
    dev = runner.device
    if dev.type != "cuda":
        return {}
    out: dict = {}
    with pdl_off():
        _, _, slots, pos, tok = _after_prompt(runner, o)
        plain = Decoder(runner, graphs=True)
        advance = plain.stepper(slots)
        calls = {"step": lambda: advance(tok, pos)}  # position P rewritten each call, as in verify_rows
        for k in o["draft_tokens"]:
            tokens, n = tok.repeat(1, k + 1), torch.tensor([k + 1], device=dev)
            calls[f"verify_k{k}"] = lambda tokens=tokens, n=n: plain.run(tokens, pos, slots, n, mtp=True)
        for name, fn in calls.items():
            fn()  # captures its graph
            prof, reps = profiled(fn, dev)
            us, launches = kernel_profile(prof, reps)
            out[name] = dict(total_us=round(sum(us.values()), 1), launches=round(sum(launches.values()), 1),
                             gpu_us=us, launches_by_family=launches, kernels=top_kernels(prof, reps, 25))
        del plain, advance, calls
    runner.reset()
    base = out["step"]["gpu_us"]
    for name, row in out.items():
        if name != "step":
            row["over_step"] = {f: round(t / base[f], 2) if base.get(f) else None for f, t in row["gpu_us"].items()}
    return out


# ============================================================================================ speculative
def speculate(runner, prompt: list[int], n: int, k: int, truth: list[int] | None = None, alpha: float = 0.0,
              seed: int = 0, sync=lambda: None) -> dict:
    """Greedy self-speculative decoding of ``n`` tokens after ``prompt`` (slot 0), ``k`` drafts per cycle; with
    ``truth`` (plain greedy's first ``n+1`` ids: the prefill's and the ``n`` after it) each draft is replaced by
    the true token with probability ``alpha`` (seeded). Returns the ids (the prefill's choice first), the decode
    seconds (the prefill excluded) and the counters."""
    gen = torch.Generator().manual_seed(seed)
    dec = SpeculativeDecoder(runner, k)
    dec.prefill([prompt], [0], logits="last")
    out = [dec.slots[0].token]
    sync()
    t0 = time.perf_counter()
    while len(out) < n + 1:
        c = min(k, n - len(out))  # the bonus token needs no draft
        forced = [-1] * c
        if truth is not None:
            draw = torch.rand(c, generator=gen).tolist()
            forced = [truth[len(out) - 1 + j] if u < alpha else -1 for j, u in zip(range(1, c + 1), draw)]
        out += dec.step([0], draft_counts=[c], drafts=[forced])[0].tokens
    sync()
    dt = time.perf_counter() - t0
    runner.reset()
    return dict(ids=out[:n + 1], seconds=dt, stats=dec.stats)


def speculative_rows(runner, clock, o: dict, greedy_round) -> tuple[list[dict], list[dict]]:
    """Plain greedy decoding of ``--decode-tokens`` tokens after a 16-token prompt (``greedy_round``: bench e2e's
    ``decode_round``, the engine's decode loop), then speculative decoding of the same tokens per ``k`` and α
    (injected acceptance) and once per ``k`` without injection; every output checked against the plain greedy ids.
    Returns ``(rows, natural rows)``."""
    n = o["decode_tokens"]
    prompt = fixed_sequence(runner.args, 16, seed=6)
    runs = [greedy_round(runner, 1, n, prompt) for _ in range(o["rounds"] + 1)][1:]  # the first warms up
    truth = runs[-1][1]
    greedy_tok_s = n / statistics.median(s for s, _ in runs)
    P = len(prompt)
    one = step_bytes(runner, o, 1, P + n // 2)
    rows, natural = [], []
    with static_path(runner):
        for k in o["draft_tokens"]:
            speculate(runner, prompt, min(n, 2 * k + 2), k, truth, 0.5, sync=clock.sync)  # compiles, captures
            ideal_cost = cycle_bytes(runner, o, k, P + n // 2) / one
            for alpha in o["alphas"]:
                r = speculate(runner, prompt, n, k, truth, alpha, seed=1000 * k + round(100 * alpha), sync=clock.sync)
                tok_s = n / r["seconds"]
                expected = sum(alpha ** j for j in range(k + 1))
                ideal = expected / ideal_cost
                st = r["stats"]
                rows.append(dict(alpha=alpha, draft_tokens=k, tok_s=round(tok_s, 2),
                                 speedup=round(tok_s / greedy_tok_s, 3), equal_to_greedy=r["ids"] == truth,
                                 greedy_tok_s=round(greedy_tok_s, 2), acceptance_rate=round(st.acceptance_rate, 4),
                                 tokens_per_cycle=round(st.tokens_per_cycle, 3), cycles=st.cycles,
                                 ideal_speedup_modelled=round(ideal, 3),
                                 of_ideal=round(tok_s / greedy_tok_s / ideal, 3)))
            r = speculate(runner, prompt, n, k, sync=clock.sync)
            natural.append(dict(checkpoint="this run's model", **_natural_row(r, n, k, truth, greedy_tok_s)))
    return rows, natural


def speculative_mismatches(rows: list[dict]) -> list[str]:
    """The speculative rows whose output differs from plain greedy's (``equal_to_greedy`` false), named by draft
    count and α or checkpoint: greedy speculation is lossless by construction, so ``bench e2e`` lists them as a
    failure of the run (the H200 visit at 11a5fe7 had every row so, and the run said nothing)."""
    return [f"k={r['draft_tokens']}" + (f" alpha={r['alpha']}" if "alpha" in r else f" ({r['checkpoint']})")
            for r in rows if not r["equal_to_greedy"]]


def _natural_row(r: dict, n: int, k: int, truth: list[int], greedy_tok_s: float) -> dict:
    st, tok_s = r["stats"], n / r["seconds"]
    return dict(draft_tokens=k, tok_s=round(tok_s, 2), speedup=round(tok_s / greedy_tok_s, 3),
                equal_to_greedy=r["ids"] == truth, acceptance_rate=round(st.acceptance_rate, 4),
                tokens_per_cycle=round(st.tokens_per_cycle, 3), cycles=st.cycles)


NATURAL_PROMPT = "def __init__(self, name, value=None):\n        self."
"""The prompt of the natural-acceptance rows: text of the kind ``data/tiny-py`` was trained on (Python source)."""


def natural_acceptance(checkpoint, o: dict, n: int = 24) -> list[dict]:
    """Speculative decoding without injection on a trained checkpoint (``--smoke``: ``data/tiny-py``, its MTP block
    trained with it), ``n`` tokens after :data:`NATURAL_PROMPT` on the static path, against its own plain greedy
    decoding of the same prompt."""
    m = load(checkpoint, max_batch=1, decode_path="static")
    prompt = [m.args.bos_token_id] + m.tokenizer.encode(NATURAL_PROMPT)
    first = m.prefill(prompt).argmax(-1).cpu()
    t0 = time.perf_counter()
    truth = [int(first[0])] + m.decode_greedy(first, n)[0]
    greedy_tok_s = n / (time.perf_counter() - t0)
    m.reset()
    rows = []
    for k in o["draft_tokens"]:
        if k <= max_draft_tokens(m.model):
            rows.append(dict(checkpoint=str(checkpoint), **_natural_row(speculate(m, prompt, n, k), n, k, truth,
                                                                         greedy_tok_s)))
    return rows


def format_multitoken(doc: dict) -> list[str]:
    """Summary lines of the verify and speculative parts."""
    lines = []
    for r in doc.get("verify") or []:
        lines.append(f"verify k={r['draft_tokens']}: {r['verify_over_step']}× the 1-token step ({r['verify_us']} vs "
                     f"{r['step_us']} µs; bytes ratio {r['bytes_ratio']}, modelled); whole cycle "
                     f"{r['cycle_over_step']}× (bytes {r['cycle_bytes_ratio']}×)")
    prof = doc.get("verify_profile") or {}
    for name, row in prof.items():
        if name != "step":
            grown = sorted(row["over_step"].items(), key=lambda kv: -(row["gpu_us"][kv[0]] - prof["step"]["gpu_us"]
                                                                         .get(kv[0], 0.0)))[:4]
            lines.append(f"{name} without PDL: {row['total_us']} µs in {row['launches']} launches (1-token step "
                         f"{prof['step']['total_us']} in {prof['step']['launches']}); most added µs: "
                         + ", ".join(f"{f} {row['gpu_us'][f]} ({x}×)" for f, x in grown))
    for r in doc.get("speculative") or []:
        lines.append(f"speculative α={r['alpha']} k={r['draft_tokens']}: {r['tok_s']} tok/s = {r['speedup']}× plain "
                     f"greedy ({r['greedy_tok_s']}), ideal {r['ideal_speedup_modelled']}× (modelled; "
                     f"{r['of_ideal']} of it), acceptance {r['acceptance_rate']}, equal to greedy "
                     f"{r['equal_to_greedy']}")
    for r in doc.get("speculative_natural") or []:
        lines.append(f"speculative k={r['draft_tokens']} without injection ({r['checkpoint']}): acceptance "
                     f"{r['acceptance_rate']}, {r['tokens_per_cycle']} tokens/cycle, {r['speedup']}× plain greedy, "
                     f"equal to greedy {r['equal_to_greedy']}")
    return lines
