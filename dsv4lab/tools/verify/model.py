"""Model level: fixed-id oracles, the 256-token trajectory hash, teacher-forced cached-vs-recompute logits around
every boundary, and (for fast backends) teacher-forced agreement with the reference.

A golden file (``data/golden/<checkpoint>.json``, written by :func:`record_golden` / ``dsv4lab verify record``)
holds, for one checkpoint: the fixed-id oracles (prompt ids → greedy ids + trajectory hash, with the top-1/top-2
logit margin of every step), a 256-token greedy trajectory hash, a teacher-forced sequence crossing every window,
compression-ratio and index-top-k boundary, and the layer digests of a fixed input (see :mod:`.layers`). It is
recorded with the reference backend in bf16 with every quantization simulation on — the checkpoint's production
semantics — and re-recording reproduces it byte for byte.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4lab import __version__
from dsv4lab.core import quant
from dsv4lab.core.config import PRESETS, ModelArgs, get_preset
from dsv4lab.engine.loader import load
from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.core.errors import DSV4LabError, UserError
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.paths import GOLDEN_DIR, display_path, read_json
from dsv4lab.core.provenance import write_text_if_changed
from dsv4lab.tools.verify.layers import first_divergence, trace_model
from dsv4lab.tools.verify.stages import DECODE_PATHS, verify_stages

GOLDEN_VERSION = 1
TRAJECTORY_TOKENS = 256


# ------------------------------------------------------------------------------------------ identity
def checkpoint_identity(path: str | Path) -> dict:
    """sha256 of config.json and the index, and of every shard when the checkpoint is small (< 1 GB)."""
    path = Path(path)
    out = {"name": path.name}
    for f in ("config.json", "model.safetensors.index.json"):
        if (path / f).exists():
            out[f] = hashlib.sha256((path / f).read_bytes()).hexdigest()
    shards = sorted(path.glob("*.safetensors"))
    if shards and sum(p.stat().st_size for p in shards) < (1 << 30):
        h = hashlib.sha256()
        for p in shards:
            h.update(p.read_bytes())
        out["weights"] = h.hexdigest()
    return out


IDENTITY_KEYS = ("weights", "model.safetensors.index.json", "config.json")
"""The content hashes a golden binds to, the most telling first (the weights are hashed below 1 GB only)."""


def identity_mismatch(recorded: dict, checkpoint: str | Path) -> tuple[str, str, str | None] | None:
    """The first content hash of :data:`IDENTITY_KEYS` that ``recorded`` (a golden's ``checkpoint`` entry) holds
    and ``checkpoint`` does not match: ``(key, recorded hash, this checkpoint's hash or None)``; None when every
    recorded hash matches."""
    ident = checkpoint_identity(checkpoint)
    for key in IDENTITY_KEYS:
        if key in recorded and ident.get(key) != recorded[key]:
            return key, recorded[key], ident.get(key)
    return None


def require_recorded_from(golden: dict, golden_path: str | Path, checkpoint: str | Path) -> None:
    """Refuse, in one line naming both hashes, a golden that was recorded from other content than ``checkpoint``:
    the golden found for a checkpoint must be its own (``--golden FILE`` compares another one deliberately)."""
    mismatch = identity_mismatch(golden.get("checkpoint") or {}, checkpoint)
    if mismatch is None:
        return
    key, theirs, ours = mismatch
    what = "weights" if key == "weights" else key
    raise UserError(f"{display_path(golden_path)} was recorded from a checkpoint whose {what} sha256 is "
                    f"{theirs[:16]}…, but {checkpoint} has {(ours or 'none')[:16]}…: not this checkpoint's golden "
                    f"(record its own with `dsv4lab verify record --checkpoint {checkpoint} --out FILE`, or compare "
                    f"against this one deliberately with --golden {display_path(golden_path)})")


def golden_path_for(checkpoint: str | Path) -> Path:
    """Where a checkpoint's golden file is written: ``data/golden/<folder name>.json``."""
    return GOLDEN_DIR / f"{Path(checkpoint).resolve().name}.json"


def find_golden(checkpoint: str | Path) -> Path:
    """The golden file to verify ``checkpoint`` against.

    ``data/golden/<folder name>.json`` when it exists; otherwise the golden recorded from a checkpoint of that
    name, or the one whose config matches (the same ``config.json`` bytes, or a golden named after a preset with
    the same model config) — so a renamed copy, or the real checkpoint in a folder of any name, finds its golden.
    When several match and the weights do not decide, the error lists them.
    """
    path = Path(checkpoint)
    named = golden_path_for(path)
    if named.exists():
        return named
    ident = checkpoint_identity(path)
    try:
        model_config = ModelArgs.from_json(path).to_hf_config()
    except DSV4LabError:
        model_config = None
    candidates: list[tuple[Path, bool]] = []
    for golden in sorted(GOLDEN_DIR.glob("*.json")):
        try:
            recorded = read_json(golden).get("checkpoint") or {}
        except (DSV4LabError, AttributeError):
            continue
        if recorded.get("name") == path.resolve().name:
            return golden
        same_bytes = recorded.get("config.json") is not None and recorded.get("config.json") == ident.get("config.json")
        same_preset = (golden.stem in PRESETS and model_config is not None
                       and get_preset(golden.stem).to_hf_config() == model_config)
        if same_bytes or same_preset:
            candidates.append((golden, all(ident.get(k) == v for k, v in recorded.items() if k != "name")))
    identical = [g for g, same in candidates if same]
    if len(identical) == 1 or len(candidates) == 1:
        return (identical or [candidates[0][0]])[0]
    if candidates:
        raise UserError(f"{checkpoint}: no golden named {named.name}, and {len(candidates)} goldens have this "
                        f"checkpoint's config ({', '.join(display_path(g) for g, _ in candidates)}): pass one "
                        f"with --golden")
    raise UserError(f"{checkpoint}: no golden named {named.name} and none recorded from a checkpoint with this config "
                    f"in {display_path(GOLDEN_DIR)}; pass --golden FILE or record one with "
                    f"`dsv4lab verify record --checkpoint {checkpoint}`")


# ------------------------------------------------------------------------------------------ inputs
def boundaries(args) -> dict[str, int]:
    """Absolute positions where a cache mechanism changes behaviour (the paper's planned tier: compressor-4,
    SWA-128, indexer-512 — generalised to any config)."""
    b = {f"window {args.window_size}": args.window_size}
    for r in sorted({r for r in args.compress_ratios[: args.n_layers] if r}):
        b[f"ratio {r}"] = r
        b[f"ratio {r} × 2"] = 2 * r
    if any(args.has_indexer(i) for i in range(args.n_layers)):
        b[f"index top-k {args.index_topk}"] = 4 * args.index_topk
    return b


def teacher_forced_length(args) -> int:
    need = max(boundaries(args).values()) + 32
    return min(args.max_seq_len, max(300, need))


def fixed_sequence(args, n: int, seed: int = 1234) -> list[int]:
    """A fixed pseudo-random id sequence (avoiding BOS/EOS), the same on every machine."""
    g = torch.Generator().manual_seed(seed)
    lo = max(args.bos_token_id, args.eos_token_id) + 1
    return torch.randint(lo, args.vocab_size, (n,), generator=g).tolist()


def default_oracles(args, tokenizer, checkpoint: Path) -> list[dict]:
    """The checkpoint's own ``oracles.json`` (human-readable prompts) if present, else fixed id prompts."""
    own = checkpoint / "oracles.json"
    if own.exists():
        data = json.loads(own.read_text())
        items = data.get("oracles", data) if isinstance(data, dict) else data
        out = []
        for o in items:
            ids = o.get("prompt_ids")
            if ids is None and tokenizer is not None:
                ids = tokenizer.encode(o["prompt"], add_bos=True)
            out.append(dict(name=o.get("name", o.get("prompt", "oracle")), prompt=o.get("prompt"), prompt_ids=ids,
                            max_new_tokens=int(o.get("max_new_tokens", 16))))
        return out
    seq = fixed_sequence(args, 64, seed=99)
    return [dict(name="ids 5..9", prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=16),
            dict(name="fixed 40 ids", prompt_ids=[args.bos_token_id] + seq[:39], max_new_tokens=16),
            dict(name="single BOS", prompt_ids=[args.bos_token_id], max_new_tokens=12)]


# ------------------------------------------------------------------------------------------ tiers
@torch.inference_mode()
def greedy_with_margins(runner, prompt_ids: list[int], n: int, stop_at_eos: bool = True) -> tuple[list[int], list[float]]:
    """Greedy ids and the top-1 − top-2 logit margin at each step (small margins = fragile oracles)."""
    logits = runner.prefill(prompt_ids, slots=[0])[0]
    out, margins = [], []
    for i in range(n):
        top = torch.topk(logits, 2)
        nxt = int(logits.argmax())
        out.append(nxt)
        margins.append(float(top.values[0] - top.values[1]))
        if stop_at_eos and nxt == runner.args.eos_token_id:
            break
        if len(prompt_ids) + len(out) >= runner.args.max_seq_len:
            break
        logits = runner.forward(torch.tensor([[nxt]]), len(prompt_ids) + i, slots=[0])[0, -1]
    runner.reset([0])
    return out, margins


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def cached_vs_recompute(runner, ids: list[int]) -> dict:
    """Teacher-forced: logits of every position computed (a) in one prefill (recompute) and (b) token by token
    through the caches; per-position KL(recompute ‖ cached) and the argmax agreement."""
    t = torch.tensor([ids])
    runner.reset([0])
    full = runner.forward(t, 0, slots=[0])[0]
    runner.reset([0])
    steps = [runner.forward(t[:, p:p + 1], p, slots=[0])[0, 0] for p in range(len(ids))]
    runner.reset([0])
    cached = torch.stack(steps)
    return dict(kl=kl_per_position(full, cached), argmax_equal=(full.argmax(-1) == cached.argmax(-1)).tolist())


@torch.inference_mode()
def chunked_vs_recompute(runner, ids: list[int], chunk: int) -> dict:
    """Teacher-forced: one-shot prefill logits vs the same sequence prefilled in chunks of ``chunk`` tokens
    (chunked prefill continues the caches mid-block, mid-window and across the index top-k boundary)."""
    t = torch.tensor([ids])
    runner.reset([0])
    full = runner.forward(t, 0, slots=[0])[0]
    chunked = runner.prefill(t, chunk, slots=[0], logits="all")[0]
    runner.reset([0])
    return dict(kl=kl_per_position(full, chunked), chunk=chunk)


def fp32_reduction_ops(numerics) -> ReferenceOps:
    """The reference with fp32 instead of exact (fp64) reductions — a change of summation order only: the
    rounding-noise floor's second run."""
    return ReferenceOps(dataclasses.replace(numerics, exact_reductions=False))


@contextlib.contextmanager
def _fp32_reductions(reference_runner):
    """The runner's reference with fp32 instead of exact (fp64) reductions for the block; its own ops and a reset
    slot 0 afterwards."""
    exact_ops = reference_runner.ops
    reference_runner.ops = fp32_reduction_ops(exact_ops.numerics)
    try:
        reference_runner.reset([0])
        yield reference_runner
    finally:
        reference_runner.ops = exact_ops
        reference_runner.reset([0])


@torch.inference_mode()
def rounding_noise_floor(reference_runner, ids: list[int], exact: torch.Tensor | None = None) -> list[float]:
    """Teacher-forced per-position KL between the reference and the same reference with fp32 instead of exact
    (fp64) reductions: a change of summation order only, no change of semantics. How far a correct but not
    bit-exact backend can drift on this checkpoint is of this order; a layout fault is orders of magnitude above.
    ``exact``: the reference's logits of ``ids`` when the caller already has them."""
    t = torch.tensor([ids])
    if exact is None:
        reference_runner.reset([0])
        exact = reference_runner.forward(t, 0, slots=[0])[0]
    with _fp32_reductions(reference_runner) as fp32:
        reordered = fp32.forward(t, 0, slots=[0])[0]
    return kl_per_position(exact, reordered)


@torch.inference_mode()
def rounding_noise_floors_with_mtp(reference_runner, ids: list[int]) -> dict[str, list[float]]:
    """:func:`rounding_noise_floor` of the main and of the MTP head: ``{"main": kl, "mtp": kl}`` over positions
    ``0..len(ids)−2`` (the last id only feeds the MTP block of the position before it). The MTP logits sit one
    block deeper than the main ones and amplify a change of summation order differently, so a comparison of MTP
    logits is judged by the MTP head's own floor, measured the same way."""
    n = len(ids) - 1
    t = torch.tensor([ids[:n]])
    reference_runner.reset([0])
    main, mtp = reference_runner.forward(t, 0, slots=[0], mtp=True, next_tokens=[ids[n]])
    with _fp32_reductions(reference_runner) as fp32:
        main32, mtp32 = fp32.forward(t, 0, slots=[0], mtp=True, next_tokens=[ids[n]])
    return dict(main=kl_per_position(main[0], main32[0]), mtp=kl_per_position(mtp[0], mtp32[0]))


def kl_per_position(p_logits: torch.Tensor, q_logits: torch.Tensor) -> list[float]:
    lp = torch.log_softmax(p_logits.double(), -1)
    lq = torch.log_softmax(q_logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0).tolist()


def boundary_report(kl: list[float], args, bound: float, radius: int = 2) -> tuple[list[dict], int | None, float]:
    """KL around every boundary position, the first position above ``bound`` and the max KL."""
    rows = []
    for name, pos in boundaries(args).items():
        lo, hi = max(0, pos - 1 - radius), min(len(kl), pos + radius)
        if lo >= hi:
            continue
        window = kl[lo:hi]
        rows.append(dict(boundary=name, positions=[lo, hi - 1], max_kl=max(window), ok=max(window) <= bound))
    first = next((i for i, v in enumerate(kl) if v > bound or math.isnan(v)), None)
    return rows, first, max(kl) if kl else 0.0


# ------------------------------------------------------------------------------------------ record
def record_golden(checkpoint: str | Path, out: str | Path | None = None, dump_layers: str | Path | None = None,
                  device: str = "cpu", progress: bool = False) -> dict:
    """Record the golden oracles of ``checkpoint`` with the reference backend (bf16, simulations on)."""
    checkpoint = Path(checkpoint)
    runner = load(checkpoint, device=device, dtype=torch.bfloat16, backend="reference", max_batch=1)
    args = runner.args
    oracles = []
    for o in default_oracles(args, runner.tokenizer, checkpoint):
        ids, margins = greedy_with_margins(runner, o["prompt_ids"], o["max_new_tokens"])
        oracles.append(dict(o, expected_ids=ids, hash=trajectory_hash(ids), min_margin=min(margins),
                            margins=[round(m, 4) for m in margins]))
    traj_prompt = oracles[0]["prompt_ids"]
    traj_ids, traj_margins = greedy_with_margins(runner, traj_prompt, TRAJECTORY_TOKENS, stop_at_eos=False)
    tf_ids = fixed_sequence(args, teacher_forced_length(args))
    tf = cached_vs_recompute(runner, tf_ids)
    layer_ids = tf_ids[: min(len(tf_ids), max(96, 2 * args.window_size + 8))]
    tracer = trace_model(runner, layer_ids, keep_tensors=dump_layers is not None)
    golden = dict(
        version=GOLDEN_VERSION, checkpoint=checkpoint_identity(checkpoint),
        recorded_with=dict(backend="reference", dtype="bfloat16", act_quant=True, kv_fp8_sim=True,
                           indexer_fp4_sim=True, exact_reductions=True,
                           attention_block=runner.ops.numerics.attention_block, dsv4lab=__version__),
        oracles=oracles,
        trajectory=dict(prompt_ids=traj_prompt, n_tokens=len(traj_ids), hash=trajectory_hash(traj_ids),
                        ids=traj_ids, min_margin=min(traj_margins)),
        teacher_forced=dict(ids=tf_ids, boundaries=boundaries(args), max_kl_reference=max(tf["kl"])),
        layers=dict(input_ids=layer_ids, order=tracer.order, digests=tracer.digests),
    )
    if dump_layers is not None:
        write_linear_dumps(runner, layer_ids, dump_layers)
        golden["layer_dumps"] = Path(dump_layers).name
    if out is not None:  # written whole or not at all: a temporary file renamed over the old one
        write_text_if_changed(Path(out), json.dumps(golden, indent=1, sort_keys=False) + "\n")
    return golden


def write_linear_dumps(runner, ids: list[int], path: str | Path) -> Path:
    """Per routed expert of every layer: the rows that reached its w1/w3/w2 in the fixed run, as recorded
    linear inputs/outputs (``<linear>.input [n, in]``, ``<linear>.output [n, out]``) for layout fingerprinting
    against golden dumps (:func:`dsv4lab.core.layouts.load_golden_dumps`)."""
    tr = trace_model(runner, ids, keep_tensors=True)
    nm = runner.ops.numerics
    arrays: dict[str, torch.Tensor] = {}
    for li in range(runner.args.n_layers):
        p = f"layers.{li}."
        idx = tr.tensors.get(p + "ffn.router_idx")
        if idx is None:
            continue
        # the MoE input: recompute it from the traced stages is not possible, so record it via a second hook
        x = tr.tensors.get(p + "ffn.input")
        g, u = tr.tensors[p + "ffn.stage1_w1"], tr.tensors[p + "ffn.stage1_w3"]
        h, o = tr.tensors[p + "ffn.activation"], tr.tensors[p + "ffn.stage2_w2"]
        for e in torch.unique(idx).tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            name = f"{p}ffn.experts.{e}"
            if x is not None:
                xq = quant.act_qdq_fp8(x[tok]) if nm.act_quant else x[tok].to(nm.acc)
                arrays[f"{name}.w1.input"] = xq.float().contiguous()
                arrays[f"{name}.w1.output"] = g[tok, slot].float().contiguous()
                arrays[f"{name}.w3.input"] = xq.float().clone()
                arrays[f"{name}.w3.output"] = u[tok, slot].float().contiguous()
            hq = h[tok, slot].to(nm.act)
            hq = quant.act_qdq_fp8(hq) if nm.act_quant else hq.to(nm.acc)
            arrays[f"{name}.w2.input"] = hq.float().contiguous()
            arrays[f"{name}.w2.output"] = o[tok, slot].float().contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")  # renamed into place when whole
    try:
        save_file(arrays, str(partial), metadata={"format": "pt", "what": "dsv4lab golden linear dumps"})
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path


# ------------------------------------------------------------------------------------------ verify
def load_golden(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no golden file (record one with `dsv4lab verify record --checkpoint DIR`)")
    g = read_json(path, UserError)
    if not isinstance(g, dict) or g.get("version") != GOLDEN_VERSION:
        raise UserError(f"{path}: not a golden file of version {GOLDEN_VERSION}; re-record it")
    return g


TIERS = ("oracles", "trajectory", "cached_vs_recompute", "chunked_vs_recompute", "vs_reference", "checkpoint",
         "stages")
KL_TIERS = ("cached_vs_recompute", "chunked_vs_recompute", "vs_reference")

# The calibrated KL rule for backends that are not bit-exact: mean KL ≤ KL_FLOOR_FACTOR_MEAN × the checkpoint's
# rounding floor and every position ≤ KL_FLOOR_FACTOR_MAX × the floor's max, both measured in the same run. Each is
# ceil(2 × the largest ratio seen among legitimate rounding variants on data/tiny and data/tiny-py, four sequences
# each: 4.93 for the mean, 1.91 for the max — data/results/host/kl_calibration.json, written by
# scripts/measure_kl_calibration.py; tests/test_stages.py keeps these equal to the file's).
KL_FLOOR_FACTOR_MEAN = 10
KL_FLOOR_FACTOR_MAX = 4


def kl_rule(floor: list[float] | None, kl_bound: float | None) -> dict:
    """The per-position and mean bounds a KL tier is judged by: a stated per-position ``kl_bound``, or the
    calibrated multiples of the rounding ``floor`` (per-position KLs of the reference with fp32 reductions)."""
    if kl_bound is not None or floor is None:
        b = 1e-2 if kl_bound is None else kl_bound
        return dict(kind="per-position", max_kl=b, mean_kl=None)
    fmean, fmax = sum(floor) / len(floor), max(floor)
    return dict(kind="calibrated", k_mean=KL_FLOOR_FACTOR_MEAN, k_max=KL_FLOOR_FACTOR_MAX, floor_mean=fmean,
                floor_max=fmax, mean_kl=KL_FLOOR_FACTOR_MEAN * fmean, max_kl=KL_FLOOR_FACTOR_MAX * fmax)


def judge_kl(kl: list[float], args, rule: dict) -> dict:
    """A KL tier's verdict: every position within ``rule["max_kl"]`` and, for the calibrated rule, the mean within
    ``rule["mean_kl"]``; with the boundary rows, the first position above the bound and the max-KL position."""
    brows, first, mx = boundary_report(kl, args, rule["max_kl"])
    mean = sum(kl) / len(kl) if kl else 0.0
    ok = first is None and (rule["mean_kl"] is None or mean <= rule["mean_kl"])
    arg = max(range(len(kl)), key=kl.__getitem__) if kl else None
    return dict(ok=ok, binding=True, max_kl=mx, max_position=arg, mean_kl=mean, first_divergence=first,
                boundaries=brows, bound=dict(rule))


def _say(progress, name: str, tier: dict) -> None:
    if progress is not None:
        progress(tier_line(name, tier))


def tier_line(name: str, tier: dict) -> str:
    """One line per tier, as the CLI prints it when the tier finishes."""
    flag = "ok  " if tier["ok"] else ("FAIL" if tier.get("binding", True) else "diff")
    if name == "oracles":
        extra = ", ".join(f"{r['name']}: {r['hash']}" for r in tier["rows"])
    elif name == "trajectory":
        extra = f"hash {tier['hash']} (golden {tier['expected_hash']})"
    elif name == "noise_floor":
        ratio = tier.get("backend_mean_over_floor")
        extra = (f"rounding-only change of the reference: mean KL {tier['mean_kl']:.3g}, max {tier['max_kl']:.3g}"
                 + (f"; the backend's mean KL is {ratio:.3g}x this floor" if ratio is not None else ""))
    elif name in ("checkpoint", "stages"):
        extra = tier.get("summary", "")
    else:
        b = tier.get("bound", {})
        lim = (f" (bound: mean ≤ {b['mean_kl']:.3g} = {b['k_mean']}×floor, max ≤ {b['max_kl']:.3g} = "
               f"{b['k_max']}×floor max)" if b.get("kind") == "calibrated" else
               f" (bound {b['max_kl']:g} per position)" if b else "")
        extra = (f"mean KL {tier.get('mean_kl', 0.0):.3g}, max KL {tier['max_kl']:.3g} at position "
                 f"{tier.get('max_position')}, first above the bound {tier['first_divergence']}{lim}")
    return f"{flag} {name}: {extra}"


def verify_model(runner, golden: dict, checkpoint: Path, reference_runner=None, kl_bound: float | None = None,
                 skip_trajectory: bool = False, layer_check: str = "on-failure",
                 tiers: tuple[str, ...] = TIERS, progress=None, stage_tokens: int | None = None) -> dict:
    """Run the model-level ``tiers`` against ``golden``; returns a result dict with ``ok`` and the per-tier rows.

    The reference backend (and the reference with a model or backend fault) is held to exact bounds: bit-identical
    oracles and trajectory, KL ≤ 1e-9; any ops object other than the plain reference also gets the two layer checks
    below when ``reference_runner`` is given. Any other backend is held to what a correct but not bit-exact backend
    can do:

    * ``checkpoint`` — the *reference* run of this checkpoint reproduces the golden layer digests (a faulted
      checkpoint makes reference and backend agree with each other; this tier catches it, naming layer and stage);
    * ``stages`` — every op of the backend, fed the reference's inputs, is within its error bound
      (:mod:`.stages`; catches a faulted backend, naming layer and stage);
    * the KL tiers — mean KL ≤ k × the checkpoint's rounding floor measured in the same run, and every position
      ≤ k × the floor's max (:func:`kl_rule`; ``kl_bound`` replaces this by a per-position bound); oracles and the
      trajectory hash are reported but not binding (near-tied greedy choices flip under rounding).

    ``progress`` (a callable taking a line) hears each tier as it finishes. ``stage_tokens`` shortens the stage
    tier's input (the golden layer input by default).
    """
    backend = runner.backend
    exact = backend.startswith("reference") or getattr(runner.ops, "exact_semantics", False)
    if exact and kl_bound is None:
        kl_bound = 1e-9
    res: dict = dict(backend=backend, exact_semantics=exact, tiers={})
    ident = checkpoint_identity(checkpoint)
    same = all(ident.get(k) == v for k, v in golden["checkpoint"].items() if k != "name")
    res["checkpoint_matches_golden"] = same
    tf = golden.get("teacher_forced") or dict(ids=fixed_sequence(runner.args, teacher_forced_length(runner.args)))
    compare_ref = reference_runner is not None and not exact
    # the layer checks run for every ops object that is not the plain reference (a reference with a model or backend
    # fault keeps the exact KL tiers, but its ops are replayed too)
    staged = reference_runner is not None and type(runner.ops) is not ReferenceOps
    # 0. the rounding floor of this checkpoint, the unit of the calibrated KL tiers
    floor, ref_logits = None, None
    if compare_ref and any(t in tiers for t in KL_TIERS):
        t = torch.tensor([tf["ids"]])
        reference_runner.reset([0])
        with torch.inference_mode():
            ref_logits = reference_runner.forward(t, 0, slots=[0])[0]
        floor = rounding_noise_floor(reference_runner, tf["ids"], ref_logits)
    rule = kl_rule(floor, kl_bound)
    res["kl_bound"] = rule["max_kl"]
    res["kl_rule"] = rule
    # 1. fixed-id oracles
    rows = []
    for o in golden["oracles"] if "oracles" in tiers else []:
        ids, margins = greedy_with_margins(runner, o["prompt_ids"], len(o["expected_ids"]))
        mm = first_mismatch(ids, o["expected_ids"])
        rows.append(dict(name=o["name"], ok=mm is None, hash=trajectory_hash(ids), expected_hash=o["hash"],
                         first_mismatch=mm, got=ids, expected=o["expected_ids"],
                         got_token=ids[mm] if mm is not None and mm < len(ids) else None,
                         expected_token=o["expected_ids"][mm] if mm is not None and mm < len(o["expected_ids"]) else None))
    if "oracles" in tiers:
        res["tiers"]["oracles"] = dict(ok=all(r["ok"] for r in rows), binding=exact, rows=rows)
        _say(progress, "oracles", res["tiers"]["oracles"])
    # 2. 256-token trajectory
    if not skip_trajectory and "trajectory" in tiers and "trajectory" in golden:
        t = golden["trajectory"]
        ids, _ = greedy_with_margins(runner, t["prompt_ids"], t["n_tokens"], stop_at_eos=False)
        mm = first_mismatch(ids, t["ids"])
        res["tiers"]["trajectory"] = dict(ok=mm is None, binding=exact, hash=trajectory_hash(ids),
                                          expected_hash=t["hash"], n_tokens=len(ids), first_mismatch=mm)
        _say(progress, "trajectory", res["tiers"]["trajectory"])
    # 3. teacher-forced cached vs recompute (self-consistency of the caches) around every boundary
    if "cached_vs_recompute" in tiers:
        cvr = cached_vs_recompute(runner, tf["ids"])
        res["tiers"]["cached_vs_recompute"] = dict(judge_kl(cvr["kl"], runner.args, rule),
                                                   argmax_agreement=sum(cvr["argmax_equal"]) / len(tf["ids"]))
        _say(progress, "cached_vs_recompute", res["tiers"]["cached_vs_recompute"])
    # 3b. chunked prefill (an irregular chunk: not a multiple of any ratio, crossing the window) vs one-shot
    if "chunked_vs_recompute" in tiers:
        chunk = runner.args.window_size + 5
        cc = chunked_vs_recompute(runner, tf["ids"], chunk)
        res["tiers"]["chunked_vs_recompute"] = dict(judge_kl(cc["kl"], runner.args, rule), chunk=chunk)
        _say(progress, "chunked_vs_recompute", res["tiers"]["chunked_vs_recompute"])
    # 4. teacher-forced agreement with the reference (fast backends), read against the rounding floor
    if compare_ref and "vs_reference" in tiers:
        runner.reset([0])
        with torch.inference_mode():
            kl = kl_per_position(ref_logits, runner.forward(torch.tensor([tf["ids"]]), 0, slots=[0])[0])
        runner.reset([0])
        res["tiers"]["vs_reference"] = judge_kl(kl, runner.args, rule)
        fmean, fmax = sum(floor) / len(floor), max(floor)
        res["tiers"]["noise_floor"] = dict(
            ok=True, binding=False, max_kl=fmax, mean_kl=fmean, first_divergence=None,
            backend_mean_over_floor=(sum(kl) / len(kl)) / fmean if fmean > 0 else None,
            note="reference with fp32 instead of exact reductions vs the reference (summation order only)")
        _say(progress, "vs_reference", res["tiers"]["vs_reference"])
        _say(progress, "noise_floor", res["tiers"]["noise_floor"])
    # 5. the checkpoint: the reference run reproduces the golden layer digests (exact)
    if staged and "checkpoint" in tiers:
        res["tiers"]["checkpoint"] = checkpoint_tier(reference_runner, golden)
        _say(progress, "checkpoint", res["tiers"]["checkpoint"])
    # 6. the backend, stage by stage on the reference's inputs
    if staged and "stages" in tiers:
        ids = golden["layers"]["input_ids"] if "layers" in golden else tf["ids"][:96]
        if stage_tokens:
            ids = ids[:stage_tokens]
        rep = verify_stages(runner, reference_runner, ids)
        counts = Counter(s.verdict for s in rep.stages)
        steps = len(DECODE_PATHS)
        summary = (f"{len(rep.stages)} stages on {len(ids) - steps} prefill tokens + {steps} decode steps "
                   f"({', '.join(DECODE_PATHS)}): "
                   + ", ".join(f"{n} {v}" for v, n in counts.most_common()) + f" ({rep.seconds:.1f} s)")
        if rep.first is not None:
            summary += f"; first defect: {rep.first.block} — {rep.first.stage}"
        res["tiers"]["stages"] = dict(rep.to_dict(), binding=True, summary=summary)
        _say(progress, "stages", res["tiers"]["stages"])
        if progress is not None:
            for st in rep.stages:
                if not st.ok:
                    progress("     " + st.line())
    res["ok"] = all(t["ok"] for t in res["tiers"].values() if t.get("binding", True))
    # 7. localisation for exact backends: the first layer and stage that diverge from the golden digests
    if exact and (layer_check == "always" or (layer_check == "on-failure" and not res["ok"])):
        res["layers"] = verify_layers(runner, golden) if "layers" in golden else dict(
            ok=None, first=None, rows=[], note="the golden file has no layer digests; run `dsv4lab verify layers "
            "--against-reference` or record digests on a trusted machine with `dsv4lab verify record`")
    res["first_divergence"] = first_divergence_of(res)
    return res


def checkpoint_tier(reference_runner, golden: dict) -> dict:
    """The reference run of this checkpoint against the golden layer digests, exact (a checkpoint fault)."""
    if "layers" not in golden:
        return dict(ok=True, binding=False, first=None, rows=[],
                    summary="the golden file has no layer digests: checkpoint not checked")
    out = verify_layers(reference_runner, golden)
    f = out["first"]
    out["binding"] = True
    out["summary"] = (f"the reference run of this checkpoint reproduces all {len(out['rows'])} golden layer digests"
                      if f is None else f"the reference run diverges from the golden digests first at "
                                        f"{f['block']} — {f['stage']} ({f['note']}): a checkpoint fault")
    return out


def first_divergence_of(res: dict) -> dict | None:
    """Where the failure is: ``{"where": tier, "block", "stage"}`` from the checkpoint, stage or layer tier."""
    for tier in ("checkpoint", "stages"):
        t = res["tiers"].get(tier)
        if t is not None and not t["ok"] and t.get("first"):
            return dict(where=tier, block=t["first"]["block"], stage=t["first"]["stage"])
    L = res.get("layers")
    if L and L.get("first"):
        return dict(where="layers", block=L["first"]["block"], stage=L["first"]["stage"])
    return None


def verify_layers(runner, golden: dict) -> dict:
    tracer = trace_model(runner, golden["layers"]["input_ids"])
    first, rows = first_divergence(tracer, golden["layers"], runner.backend)
    return dict(ok=first is None, first=first.to_dict() if first else None, rows=[r.to_dict() for r in rows])
