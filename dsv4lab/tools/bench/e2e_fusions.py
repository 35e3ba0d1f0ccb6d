"""``bench e2e``'s fused-path A/B (issue 33): the decode step timed with each of the decode step's fused paths
(:data:`~dsv4lab.engine.kernel_families.FUSIONS`, whatever ``FUSION_NAMES`` holds) off, alone on and all on, so a GPU
visit turns them on by measurement — the dispatch runs none of them on a GPU until a ``decode.fusion`` entry of the
tuned file says so (``docs/kernels_decode.md``, "Fused paths").

* **configurations**: ``off`` (every path false), each path alone (``--fusions`` names a subset), and ``all`` (every
  path true; left out where
  there is one path), each a :class:`~dsv4lab.engine.dispatch.Dispatch` that is the engine's own (its tuned entries
  and defaults) with its ``decode.fusion`` replaced (:func:`with_fusions`), set as ``runner.ops.config`` — and each
  its own decoder: a captured graph holds the kernels it was captured with, so a configuration's graphs are captured
  under it (a warm-up round, GPU) and kept apart.
* **per batch** of ``--fusion-batches`` (default 1 and 8 where ``--batches`` reaches them; a GPU run on one rank
  with the Triton backend): each row starts from an empty cache at position 0 with distinct first tokens per row, and
  takes ``--decode-tokens`` greedy steps through the engine's decode loop (``runner.decode_greedy``). Each
  configuration is timed against ``off`` in the order off C C off (``--rounds`` // 2 times, at least once: drift
  cancelled); ``speedup`` = median tok/s of its rounds ÷ median of the ``off`` rounds beside them. Launches: one
  eager static step (greedy choice included, as the graph holds it) under
  :func:`~dsv4lab.tools.bench.common.count_launches` — Triton launches and torch kernels per step and per layer.
  ``ids_equal_off``: every round's ids (every row, every step) equal ``off``'s first round's — the fused paths
  claim bit-exactness, so a difference (or an ``off`` that differs from itself) is a failure, listed under
  ``mismatches`` and the run's ``failed``, and the path is never recommended.
* **recommended** (:func:`recommend`): at each batch, the paths whose alone ``speedup ≥ 1 + margin`` with ``margin =
  max(noise, MIN_MARGIN)`` and ``noise`` the spread ``(max − min) / median`` of that batch's ``off`` rounds, whose
  ids equal ``off``'s at every batch measured (and ``all``'s equal too: an interaction is not blamed on one path),
  and that launch fewer kernels than ``off`` (the path engaged). Where ``all`` itself clears ``1 + margin``, a path
  alone at ``speedup ≥ 1`` is taken too: each path saves one launch per layer or so, a gain that can sit below the
  noise alone and still add up in ``all``; a path measured slower alone stays off. A configuration whose kernels
  fail (a compile error, a launch) is a row with its ``error`` and no timing, listed under ``errors`` and the run's
  ``failed``; the others are still timed, that path is never recommended, and none is where ``all`` failed.
  ``tuned``: the ``decode.fusion`` entries that choice makes (one per batch, every path named true or false; the
  dispatch takes a batch's entry for the row counts up to it and the largest batch's above) with their source
  (commit, command, the result file's name) — what ``bench e2e --tuned-out FILE`` merges into a tuned file and
  ``scripts/rebuild_tuned.py`` takes from a committed result (:func:`tuned_ops`).

``--smoke`` (``--fusion-batches 1`` asks for it): the same code on a Triton-interpreter model of its own
(:data:`SMOKE_MODEL`: the tiny preset, two SWA layers at smaller widths — the interpreter's cost is per launch
and element) and one step per round; its timings mean nothing, its launch counts and ids do.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dsv4lab.core.config import get_preset
from dsv4lab.core.errors import UserError
from dsv4lab.core.random_checkpoint import RandomCheckpoint
from dsv4lab.engine.decode_graph import Decoder
from dsv4lab.engine.dispatch import OPS, SCHEMA, Dispatch, Tuned
from dsv4lab.engine.kernel_families import FUSION_NAMES
from dsv4lab.engine.loader import load
from dsv4lab.tools.bench.common import count_launches
from dsv4lab.tools.bench.e2e_multitoken import static_path
from dsv4lab.tools.options import positive_ints
from dsv4lab.tools.verify.model import fixed_sequence

FUSION_BATCHES = (1, 8)
"""The batches timed where ``--fusion-batches`` is not given (those ``--batches`` reaches)."""
MIN_MARGIN = 0.005
"""The least margin over 1.0 a path's speedup must clear (where the ``off`` rounds happen to agree closely)."""
RULE = ("recommended at a batch: alone speedup >= 1 + max(noise, MIN_MARGIN), noise = (max - min) / median of that "
        "batch's off rounds; or, where all on clears that margin, alone speedup >= 1 (a saving smaller than the noise, "
        "not slower); ids equal to off's at every batch (all-on's too); fewer launches than off")
SMOKE_MODEL = dict(n_layers=2, compress_ratios=(0, 0, 0), dim=128, vocab_size=1024, moe_inter_dim=64, q_lora_rank=96,
                   n_heads=4, o_groups=2, n_routed_experts=8, n_activated_experts=2)
"""``--smoke``'s interpreter model: the tiny preset with these fields (two SWA layers: ``moe_site`` fuses every layer
but the last)."""


def fusion_batches(spec: str | None, o: dict) -> list[int]:
    """``--fusion-batches``: the batches given ('' none: a one-line error where a rank count, backend or the largest
    of ``--batches`` cannot time them); by default 1 and 8 where ``--batches`` reaches them on a GPU run of one rank
    with the Triton backend, else none."""
    most = max(o["batches"])
    if spec is None:
        on_gpu = not o["smoke"] and o["nproc"] == 1 and o["backend"] == "triton"
        return [b for b in FUSION_BATCHES if b <= most] if on_gpu else []
    if not spec.strip():
        return []
    out = positive_ints(spec, "--fusion-batches")
    if o["nproc"] != 1:
        raise UserError(f"--fusion-batches {spec!r}: the fused paths are timed on one rank (--nproc 1)")
    if o["backend"] != "triton" and not o["smoke"]:
        raise UserError(f"--fusion-batches {spec!r}: the fused paths are the Triton backend's (--backend triton)")
    if max(out) > most:
        raise UserError(f"--fusion-batches {spec!r}: each must be at most the largest of --batches ({most})")
    return out


def fusion_names(spec: str | None) -> list[str]:
    """``--fusions``: the fused paths timed alone (default every name of ``FUSION_NAMES``)."""
    if spec is None:
        return list(FUSION_NAMES)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FUSION_NAMES]
    if not names or unknown or len(set(names)) != len(names):
        raise UserError(f"--fusions {spec!r}: expected distinct fused paths among {', '.join(FUSION_NAMES)}")
    return [n for n in FUSION_NAMES if n in names]


def configurations(names=FUSION_NAMES) -> dict[str, dict[str, bool]]:
    """``off``, each of ``names`` alone, ``all`` (every fused path, where there is more than one): name → its
    ``decode.fusion`` choice (every path named)."""
    off = {n: False for n in FUSION_NAMES}
    out = {"off": off} | {n: off | {n: True} for n in names}
    if len(FUSION_NAMES) > 1:
        out["all"] = {n: True for n in FUSION_NAMES}
    return out


def with_fusions(dispatch: Dispatch, choice: dict[str, bool], label: str) -> Dispatch:
    """``dispatch`` (its tuned entries and its defaults) with its ``decode.fusion`` entries replaced by one entry of
    ``choice`` (it holds for every row count)."""
    base = dispatch.tuned
    source = "bench e2e fusions"
    ops = {op: [{k: v for k, v in e.items() if k != "at"} for e in base.entries(op)]
           for op in OPS if op != "decode.fusion" and base.entries(op)}
    ops["decode.fusion"] = [dict(rows=1, source=source, choice=dict(choice))]
    doc = dict(schema=SCHEMA, gpu=base.gpu, sources={**base.sources, source: {}}, ops=ops)
    return Dispatch(Tuned(doc, f"{base.where}, fusions {label}"), dispatch.defaults)


def smoke_runner(o: dict):
    """``--smoke``'s Triton-interpreter model (:data:`SMOKE_MODEL`), on the static decode path."""
    args = get_preset("tiny").replace(**SMOKE_MODEL)
    ck = RandomCheckpoint(args, o["seed"], torch.device("cpu"), name="tiny")
    runner = load(ck, device="cpu", backend="triton", max_batch=max(o["fusion_batches"]), max_seq_len=64,
                  validate=False, decode_path="static")
    ck.close()
    return runner


# ============================================================================================ measuring
def _round(runner, clock, tokens: torch.Tensor, n: int) -> tuple[float, list[list[int]]]:
    """``n`` greedy steps from empty slots ``0..b-1`` fed ``tokens`` at position 0: (seconds, every row's ids)."""
    runner.reset()
    clock.sync()
    t0 = time.perf_counter()
    ids = runner.decode_greedy(tokens, n, slots=list(range(tokens.shape[0])))
    clock.sync()
    return time.perf_counter() - t0, ids


def _launches(runner, step, tokens: torch.Tensor) -> dict:
    """Launches of one eager static ``step`` with its greedy choice (what a graph of the step holds)."""
    dev = runner.device
    b = tokens.shape[0]
    runner.reset()
    counts, _ = count_launches(lambda: step.greedy(tokens.to(dev), torch.zeros(b, dtype=torch.long, device=dev),
                                                   torch.arange(b, device=dev)))
    runner.reset()
    total = counts["triton"] + counts["torch"]
    return dict(launches_per_step=total, launches_per_layer=round(total / runner.args.n_layers, 2),
                triton_launches=counts["triton"], torch_launches=counts["torch"])


def fusion_rows(runner, clock, batch: int, o: dict) -> list[dict]:
    """Every configuration at ``batch`` rows (module doc): ``off``'s row first, then each against it."""
    configs = configurations(o.get("fusions", FUSION_NAMES))
    base = runner.ops.config
    dispatches = {name: with_fusions(base, choice, name) for name, choice in configs.items()}
    tokens = torch.tensor(fixed_sequence(runner.args, batch, seed=33 + batch))
    n = o["fusion_tokens"]
    with static_path(runner):
        kept = runner.decoder  # the engine's, captured under its own dispatch: put back after
        decoders: dict = {}

        def use(name: str) -> None:
            runner.ops.config = dispatches[name]
            if name not in decoders:
                runner.drop_decoders()  # a fresh decoder: its graphs captured under this configuration
                decoders[name] = runner.decoder
                if decoders[name].graphs is not None:
                    _round(runner, clock, tokens, 2)  # captures the tier (and compiles what it is first to run)
            runner.decoder = decoders[name]
        try:
            eager = Decoder(runner, graphs=False).step
            runner.ops.config = dispatches["off"]
            _launches(runner, eager, tokens)  # the backend's one-time caches (grouped weights, bank views) filled
            launches, errors = {}, {}
            for name in configs:
                runner.ops.config = dispatches[name]
                try:
                    launches[name] = _launches(runner, eager, tokens)
                except Exception as err:  # noqa: BLE001 — a path whose kernels fail is reported, the rest timed
                    if name == "off":
                        raise
                    errors[name] = _error(err)
            seconds: dict[str, list[float]] = {name: [] for name in configs}
            paired: dict[str, list[float]] = {}
            first: list = []  # the first round's ids: every round is compared with them
            equal = {name: True for name in configs}

            def timed(which: str) -> float:
                use(which)
                s, ids = _round(runner, clock, tokens, n)
                seconds[which].append(s)
                first[:] = first or [ids]
                equal[which] = equal[which] and ids == first[0]
                return s
            rounds = max(1, o["rounds"] // 2)
            for name in [c for c in list(configs)[1:] if c not in errors]:
                paired[name] = []
                try:
                    for which in ("off", name, name, "off") * rounds:
                        s = timed(which)
                        if which == "off":
                            paired[name].append(s)
                except Exception as err:  # noqa: BLE001 — its capture or a launch failed: reported, not timed
                    if not seconds["off"]:
                        raise
                    errors[name] = _error(err)
                decoders.pop(name, None)  # its graphs released before the next configuration captures
            while len(seconds["off"]) < 2 * rounds:  # every other configuration failed: off timed alone
                timed("off")
        finally:
            runner.ops.config = base
            runner.drop_decoders()
            if kept is not None:
                runner.decoder = kept
            runner.reset()

    def tok_s(s: list[float]) -> list[float]:
        return [batch * n / x for x in s]

    def rounded(xs: list[float]) -> list[float]:
        return [round(x, 2) for x in xs]
    rows = []
    for name, choice in configs.items():
        if name in errors:  # never recommended (recommend); the run lists it under failed
            rows.append(dict(batch=batch, config=name, on=[k for k, v in choice.items() if v], error=errors[name]))
            continue
        mine = statistics.median(tok_s(seconds[name]))
        against = statistics.median(tok_s(paired[name])) if name != "off" else mine
        rows.append(dict(batch=batch, config=name, on=[k for k, v in choice.items() if v], tok_s=round(mine, 2),
                         rounds_tok_s=rounded(tok_s(seconds[name])), speedup=round(mine / against, 4),
                         **({"off_rounds_tok_s": rounded(tok_s(paired[name]))} if name != "off" else {}),
                         **launches[name], launches_saved=launches["off"]["launches_per_step"]
                         - launches[name]["launches_per_step"], ids_equal_off=equal[name],
                         decode_tokens=n, path=runner.decode_path if runner.decode_path != "eager" else "static"))
    return rows


def _error(err: BaseException) -> str:
    """A configuration's failure in one line (its type and the first line of its message)."""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"


# ============================================================================================ the choice
def recommend(rows: list[dict], names=FUSION_NAMES) -> dict:
    """The choice the rows support (:data:`RULE`): per batch the recommended paths, the noise margin and why each
    path is or is not recommended; ``mismatches`` lists every configuration whose ids differed from ``off``'s,
    ``errors`` every one whose kernels failed (a compile error, a launch): that path is never recommended, and where
    ``all`` failed no path is (its interactions were not seen)."""
    batches = sorted({r["batch"] for r in rows})
    failed = {r["config"]: r["error"] for r in rows if r.get("error")}  # its kernels failed: never recommended
    rows = [r for r in rows if not r.get("error")]
    at = {(r["batch"], r["config"]): r for r in rows}
    mismatches = [f"{r['config']} at batch {r['batch']}" + (" (off differs from itself between rounds)"
                                                             if r["config"] == "off" else "")
                  for r in rows if not r["ids_equal_off"]]
    blocked = {r["config"] for r in rows if not r["ids_equal_off"]}
    out = dict(recommended={}, margin={}, noise={}, why={}, mismatches=mismatches, errors=failed)
    for b in batches:
        off = at.get((b, "off"))
        if off is None:
            continue
        rounds = off["rounds_tok_s"]
        noise = (max(rounds) - min(rounds)) / statistics.median(rounds) if len(rounds) > 1 else 0.0
        margin = max(noise, MIN_MARGIN)
        out["noise"][str(b)], out["margin"][str(b)] = round(noise, 4), round(margin, 4)
        chosen, why = [], {}
        every = at.get((b, "all"))
        all_wins = (every is not None and not blocked and every["launches_per_step"] < off["launches_per_step"]
                    and every["speedup"] >= 1 + margin)
        for name in names:
            r = at.get((b, name))
            if name in failed:
                why[name] = f"failed: {failed[name]}"
            elif "all" in failed:
                why[name] = f"all on failed: {failed['all']}"
            elif r is None:
                why[name] = "not measured"
            elif name in blocked or "off" in blocked:
                why[name] = "ids differ from off's" if name in blocked else "off's ids differ between rounds"
            elif "all" in blocked:
                why[name] = "ids with every path on differ from off's"
            elif r["launches_per_step"] >= off["launches_per_step"]:
                why[name] = f"no launch saved ({r['launches_per_step']} vs {off['launches_per_step']} per step)"
            elif r["speedup"] < 1 + margin and all_wins and r["speedup"] >= 1:
                why[name] = (f"speedup {r['speedup']} >= 1 and all on {every['speedup']} >= 1 + margin "
                             f"{round(margin, 4)}")
                chosen.append(name)
            elif r["speedup"] < 1 + margin:
                why[name] = f"speedup {r['speedup']} < 1 + margin {round(margin, 4)}"
            else:
                why[name] = f"speedup {r['speedup']} >= 1 + margin {round(margin, 4)}"
                chosen.append(name)
        out["recommended"][str(b)], out["why"][str(b)] = chosen, why
    return out


def fusion_section(rows: list[dict], doc: dict, o: dict) -> dict:
    """The JSON section ``fusions``: the rows, the choice (:func:`recommend`: among the paths timed alone) and its
    tuned entries (a path not timed: false)."""
    names = list(o.get("fusions", FUSION_NAMES))
    choice = recommend(rows, names)
    sid = f"{doc.get('commit')}/e2e"
    command = (f"dsv4lab bench e2e --nproc 1 --layers {o['layers']} --fusion-batches "
               f"{','.join(map(str, o['fusion_batches']))} --decode-tokens {o['decode_tokens']} --rounds {o['rounds']}"
               + ("" if names == list(FUSION_NAMES) else f" --fusions {','.join(names)}"))
    source = dict(commit=doc.get("commit"), command=command + (" --smoke" if o["smoke"] else ""),
                  result=Path(o.get("out") or "e2e.json").name, gpu=doc.get("gpu"), torch=doc.get("torch"),
                  triton=doc.get("triton"))
    entries = [dict(rows=int(b), source=sid, choice={n: n in chosen for n in FUSION_NAMES},
                    speedup={r["config"]: r["speedup"] for r in rows
                             if r["batch"] == int(b) and r["config"] != "off" and not r.get("error")})
               for b, chosen in choice["recommended"].items()]
    return dict(names=names, rule=RULE, min_margin=MIN_MARGIN, rows=rows, **choice,
                tuned={"sources": {sid: source}, "decode.fusion": entries})


def tuned_ops(doc: dict) -> tuple[tuple[str, dict], dict[str, list[dict]]]:
    """``((source id, provenance), {"decode.fusion": entries})`` of an e2e result's ``fusions`` section — what a
    tuned file takes from it (:class:`~dsv4lab.tools.bench.tuned.TunedWriter`, ``scripts/rebuild_tuned.py``)."""
    tuned = (doc.get("fusions") or {}).get("tuned")
    if doc.get("smoke"):
        raise UserError("a smoke run of bench e2e (an interpreter model) chooses no fused path")
    if not tuned or not tuned.get("decode.fusion"):
        raise UserError("this bench e2e result timed no fused path (no 'fusions' section with entries)")
    return next(iter(tuned["sources"].items())), {"decode.fusion": tuned["decode.fusion"]}


def format_fusions(doc: dict) -> list[str]:
    """Summary lines of the fused-path A/B (a mismatch printed loudly)."""
    f = doc.get("fusions")
    if not f:
        return []
    lines = []
    for b in sorted({r["batch"] for r in f["rows"]}):
        rows = [r for r in f["rows"] if r["batch"] == b and not r.get("error")]  # a failed one: FUSION FAILED
        lines.append(f"fusions b={b} (noise {f['noise'].get(str(b))}, margin {f['margin'].get(str(b))}): " + "; ".join(
            f"{r['config']} {r['tok_s']} tok/s ×{r['speedup']}, {r['launches_per_step']} launches "
            f"({r['launches_per_layer']}/layer){'' if r['ids_equal_off'] else ', IDS DIFFER'}" for r in rows))
    lines.append("fusions recommended: " + "; ".join(f"b={b}: {', '.join(v) or 'none'}"
                                                      for b, v in f["recommended"].items()))
    for m in f["mismatches"]:
        lines.append(f"FUSION MISMATCH: {m}: token ids differ from the unfused step's (never recommended)")
    for name, err in (f.get("errors") or {}).items():
        lines.append(f"FUSION FAILED: {name}: {err} (never recommended; the other configurations were timed)")
    return lines


__all__ = ["FUSION_BATCHES", "MIN_MARGIN", "RULE", "SMOKE_MODEL", "fusion_batches", "fusion_names", "configurations",
           "with_fusions", "smoke_runner", "fusion_rows", "recommend", "fusion_section", "tuned_ops", "format_fusions"]
