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

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from .. import __version__, quant
from ..config import PRESETS, ModelArgs, get_preset
from ..engine.loader import load
from ..engine.sampling import trajectory_hash
from ..errors import DSV4LabError, UserError
from ..model.ops import ReferenceOps
from ..paths import GOLDEN_DIR, display_path, read_json
from .layers import first_divergence, trace_model

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
    runner.reset([0])
    logits = runner.forward(torch.tensor([prompt_ids]), 0, slots=[0])[0, -1]
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
    runner.reset([0])
    parts = [runner.forward(t[:, s:s + chunk], s, slots=[0])[0] for s in range(0, len(ids), chunk)]
    runner.reset([0])
    return dict(kl=kl_per_position(full, torch.cat(parts)), chunk=chunk)


@torch.inference_mode()
def rounding_noise_floor(reference_runner, ids: list[int], exact: torch.Tensor | None = None) -> list[float]:
    """Teacher-forced per-position KL between the reference and the same reference with fp32 instead of exact
    (fp64) reductions: a change of summation order only, no change of semantics. How far a correct but not
    bit-exact backend can drift on this checkpoint is of this order; a layout fault is orders of magnitude above.
    ``exact``: the reference's logits of ``ids`` when the caller already has them."""
    t = torch.tensor([ids])
    exact_ops = reference_runner.ops
    if exact is None:
        reference_runner.reset([0])
        exact = reference_runner.forward(t, 0, slots=[0])[0]
    reference_runner.ops = ReferenceOps(dataclasses.replace(exact_ops.numerics, exact_reductions=False))
    try:
        reference_runner.reset([0])
        reordered = reference_runner.forward(t, 0, slots=[0])[0]
    finally:
        reference_runner.ops = exact_ops
        reference_runner.reset([0])
    return kl_per_position(exact, reordered)


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
                           indexer_fp4_sim=True, exact_reductions=True, dsv4lab=__version__),
        oracles=oracles,
        trajectory=dict(prompt_ids=traj_prompt, n_tokens=len(traj_ids), hash=trajectory_hash(traj_ids),
                        ids=traj_ids, min_margin=min(traj_margins)),
        teacher_forced=dict(ids=tf_ids, boundaries=boundaries(args), max_kl_reference=max(tf["kl"])),
        layers=dict(input_ids=layer_ids, order=tracer.order, digests=tracer.digests),
    )
    if dump_layers is not None:
        write_linear_dumps(runner, layer_ids, dump_layers)
        golden["layer_dumps"] = Path(dump_layers).name
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(golden, indent=1, sort_keys=False) + "\n")
    return golden


def write_linear_dumps(runner, ids: list[int], path: str | Path) -> Path:
    """Per routed expert of every layer: the rows that reached its w1/w3/w2 in the fixed run, as recorded
    linear inputs/outputs (``<linear>.input [n, in]``, ``<linear>.output [n, out]``) for layout fingerprinting
    against golden dumps (:func:`dsv4lab.layouts.load_golden_dumps`)."""
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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(path), metadata={"format": "pt", "what": "dsv4lab golden linear dumps"})
    return Path(path)


# ------------------------------------------------------------------------------------------ verify
def load_golden(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no golden file (record one with `dsv4lab verify record --checkpoint DIR`)")
    g = read_json(path, UserError)
    if not isinstance(g, dict) or g.get("version") != GOLDEN_VERSION:
        raise UserError(f"{path}: not a golden file of version {GOLDEN_VERSION}; re-record it")
    return g


TIERS = ("oracles", "trajectory", "cached_vs_recompute", "chunked_vs_recompute", "vs_reference")


def verify_model(runner, golden: dict, checkpoint: Path, reference_runner=None, kl_bound: float | None = None,
                 skip_trajectory: bool = False, layer_check: str = "on-failure",
                 tiers: tuple[str, ...] = TIERS) -> dict:
    """Run the model-level ``tiers`` against ``golden``; returns a result dict with ``ok`` and the per-tier rows."""
    backend = runner.backend
    exact = backend.startswith("reference") or getattr(runner.ops, "exact_semantics", False)
    if kl_bound is None:
        kl_bound = 1e-9 if backend.startswith("reference") else getattr(runner.ops, "kl_bound", 1e-2)
    res: dict = dict(backend=backend, exact_semantics=exact, kl_bound=kl_bound, tiers={})
    ident = checkpoint_identity(checkpoint)
    same = all(ident.get(k) == v for k, v in golden["checkpoint"].items() if k != "name")
    res["checkpoint_matches_golden"] = same
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
    # 2. 256-token trajectory
    if not skip_trajectory and "trajectory" in tiers and "trajectory" in golden:
        t = golden["trajectory"]
        ids, _ = greedy_with_margins(runner, t["prompt_ids"], t["n_tokens"], stop_at_eos=False)
        mm = first_mismatch(ids, t["ids"])
        res["tiers"]["trajectory"] = dict(ok=mm is None, binding=exact, hash=trajectory_hash(ids),
                                          expected_hash=t["hash"], n_tokens=len(ids), first_mismatch=mm)
    # 3. teacher-forced cached vs recompute (self-consistency of the caches) around every boundary
    tf = golden.get("teacher_forced") or dict(ids=fixed_sequence(runner.args, teacher_forced_length(runner.args)))
    if "cached_vs_recompute" in tiers:
        cvr = cached_vs_recompute(runner, tf["ids"])
        brows, first, mx = boundary_report(cvr["kl"], runner.args, kl_bound)
        res["tiers"]["cached_vs_recompute"] = dict(
            ok=first is None, binding=True, max_kl=mx, first_divergence=first, boundaries=brows,
            argmax_agreement=sum(cvr["argmax_equal"]) / len(tf["ids"]))
    # 3b. chunked prefill (an irregular chunk: not a multiple of any ratio, crossing the window) vs one-shot
    if "chunked_vs_recompute" in tiers:
        chunk = runner.args.window_size + 5
        cc = chunked_vs_recompute(runner, tf["ids"], chunk)
        brows, first, mx = boundary_report(cc["kl"], runner.args, kl_bound)
        res["tiers"]["chunked_vs_recompute"] = dict(ok=first is None, binding=True, max_kl=mx, chunk=chunk,
                                                    first_divergence=first, boundaries=brows)
    # 4. teacher-forced agreement with the reference (fast backends)
    if reference_runner is not None and not backend.startswith("reference") and "vs_reference" in tiers:
        t = torch.tensor([tf["ids"]])
        runner.reset([0])
        reference_runner.reset([0])
        ref_logits = reference_runner.forward(t, 0, slots=[0])[0]
        kl = kl_per_position(ref_logits, runner.forward(t, 0, slots=[0])[0])
        runner.reset([0])
        reference_runner.reset([0])
        brows2, first2, mx2 = boundary_report(kl, runner.args, kl_bound)
        res["tiers"]["vs_reference"] = dict(ok=first2 is None, binding=True, max_kl=mx2, first_divergence=first2,
                                            mean_kl=sum(kl) / len(kl), boundaries=brows2)
        # 4b. the checkpoint's rounding-noise floor, to read the KLs above against (informational, not binding)
        floor = rounding_noise_floor(reference_runner, tf["ids"], ref_logits)
        fmean, fmax = sum(floor) / len(floor), max(floor)
        res["tiers"]["noise_floor"] = dict(
            ok=True, binding=False, max_kl=fmax, mean_kl=fmean, first_divergence=None,
            backend_mean_over_floor=(sum(kl) / len(kl)) / fmean if fmean > 0 else None,
            note="reference with fp32 instead of exact reductions vs the reference (summation order only)")
    res["ok"] = all(t["ok"] for t in res["tiers"].values() if t.get("binding", True))
    # 5. localisation: the first layer and stage that diverge from the golden digests
    if layer_check == "always" or (layer_check == "on-failure" and not res["ok"]):
        res["layers"] = verify_layers(runner, golden) if "layers" in golden else dict(
            ok=None, first=None, rows=[], note="the golden file has no layer digests; run `dsv4lab verify layers "
            "--against-reference` or record digests on a trusted machine with `dsv4lab verify record`")
    return res


def verify_layers(runner, golden: dict) -> dict:
    tracer = trace_model(runner, golden["layers"]["input_ids"])
    first, rows = first_divergence(tracer, golden["layers"], runner.backend)
    return dict(ok=first is None, first=first.to_dict() if first else None, rows=[r.to_dict() for r in rows])
