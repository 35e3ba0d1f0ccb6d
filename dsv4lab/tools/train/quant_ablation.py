"""Weight-format ablation of the trained small model: what DeepSeek-V4's choice of FP4 E2M1 experts with E8M0
per-32 scales and FP8 dense weights with 128×128 E8M0 blocks costs, against its neighbours.

Two sweeps over the trained float32 master weights (the rest of the model stays as the unquantized bf16
checkpoint would hold it, so each sweep measures its own family alone):

* **routed experts** — E2M1 values with a scale per group of 16 / 32 / 64 / 128 along K, the scale either a
  power of two (**E8M0**, DeepSeek-V4's choice at group 32) or an **E4M3** number under one float32 scale per
  matrix (the NVFP4-style two-level scale; the E4M3 scale costs the same byte as an E8M0 one);
* **dense projections** — E4M3 with 128×128 E8M0 block scales (the checkpoint's choice), per-output-channel
  E8M0 scales, or per-output-channel float32 scales;

plus the full native choice (both) and the bf16 reference. For each point: held-out perplexity, teacher-forced
KL(bf16 model ‖ quantized model) per token, the relative Frobenius error of the quantized family's weights
against the float32 master weights, and bytes per parameter of that family (values + scales).

Everything runs on the CPU through the training form of the reference model (:func:`dsv4lab.tools.train.trainer.build_trainable`
holding dequantized values) with bf16 compute and the activation/KV/indexer simulations off, so the only
difference between points is the weight format.
"""
from __future__ import annotations

import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal

import torch

from dsv4lab.core import quant
from dsv4lab.core.checkpoint import expected_tensors
from dsv4lab.core.config import ModelArgs, get_preset
from dsv4lab.core.model.numerics import Numerics
from dsv4lab.core.model.ops import ReferenceOps
from dsv4lab.core.paths import RESULTS_DIR, read_json
from dsv4lab.core.provenance import short_commit, write_json
from dsv4lab.tools.train.trainer import (bf16_rounded_state, evaluate_nll, heldout_windows, load_tokens, load_weights_f32, read_train_log,
                      trainable_from_state)

RESULTS_FILE = RESULTS_DIR / "quant_ablation.json"

E4M3_MIN_SUBNORMAL = 2.0 ** -9


# ============================================================================================ formats
@dataclass(frozen=True)
class ExpertFormat:
    """Routed-expert weight format: E2M1 values, one scale per ``group`` elements along K."""

    group: int = 32
    scale: Literal["e8m0", "e4m3"] = "e8m0"

    @property
    def label(self) -> str:
        return f"experts E2M1 g{self.group} {self.scale.upper()}"


@dataclass(frozen=True)
class DenseFormat:
    """Dense projection format: E4M3 values with 128×128 block or per-output-channel scales."""

    granularity: Literal["block128", "channel"] = "block128"
    scale: Literal["e8m0", "f32"] = "e8m0"

    @property
    def label(self) -> str:
        g = "128x128 blocks" if self.granularity == "block128" else "per channel"
        return f"dense E4M3 {g} {self.scale.upper()}"


NATIVE_EXPERTS = ExpertFormat(32, "e8m0")
NATIVE_DENSE = DenseFormat("block128", "e8m0")


def fp4_group_qdq(w: torch.Tensor, fmt: ExpertFormat) -> tuple[torch.Tensor, int]:
    """Quantize-dequantize ``w [N, K]`` to E2M1 in ``fmt``; returns (float32 values, bytes stored).

    E8M0 uses :func:`dsv4lab.core.quant.fp4_quantize` itself (the checkpoint writer's path). E4M3 group scales sit
    under one float32 scale per matrix that maps the largest group scale to E4M3's maximum (448).
    """
    n, k = w.shape
    if k % fmt.group:
        raise ValueError(f"K={k} is not a multiple of the group size {fmt.group}")
    if fmt.scale == "e8m0":
        packed, scale = quant.fp4_quantize(w, fmt.group)
        return quant.fp4_dequant(packed, scale, torch.float32, fmt.group), packed.numel() + scale.numel()
    wf = w.float().reshape(n, k // fmt.group, fmt.group)
    amax = wf.abs().amax(-1)
    ideal = amax / quant.E2M1_MAX
    tensor_scale = (ideal.max() / quant.FP8_E4M3_MAX).clamp_min(1e-30)
    group_scale = (ideal / tensor_scale).to(torch.float8_e4m3fn).float().clamp_min(E4M3_MIN_SUBNORMAL)
    s = group_scale * tensor_scale
    codes = quant.e2m1_encode((wf / s[..., None]).clamp(-quant.E2M1_MAX, quant.E2M1_MAX))
    out = quant.e2m1_decode(codes, torch.float32) * s[..., None]
    return out.reshape(n, k), n * k // 2 + amax.numel() + 4


def fp8_dense_qdq(w: torch.Tensor, fmt: DenseFormat) -> tuple[torch.Tensor, int]:
    """Quantize-dequantize ``w [N, K]`` to E4M3 in ``fmt``; returns (float32 values, bytes stored)."""
    n, k = w.shape
    if fmt.granularity == "block128":
        if fmt.scale != "e8m0":
            raise ValueError("128x128 blocks are evaluated with E8M0 scales only (the checkpoint's format)")
        q, s = quant.fp8_block_quantize(w)
        return quant.fp8_block_dequant(q, s, torch.float32), q.numel() + s.numel()
    wf = w.float()
    amax = wf.abs().amax(-1, keepdim=True).clamp_min(1e-12)
    if fmt.scale == "e8m0":
        s = quant.pow2_scale(amax, quant.FP8_E4M3_MAX)
        scale_bytes = n
    else:
        s = amax / quant.FP8_E4M3_MAX
        scale_bytes = 4 * n
    q = (wf / s).clamp(-quant.FP8_E4M3_MAX, quant.FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * s, n * k + scale_bytes


# ============================================================================================ re-quantization
def _families(args: ModelArgs) -> tuple[list[str], list[str]]:
    """(expert bank names ``layers.L.ffn.experts.wX``, dense FP8 weight names) of ``args``."""
    banks, dense = set(), []
    for s in expected_tensors(args):
        if ".ffn.experts." in s.name and s.name.endswith(".weight"):
            parts = s.name.split(".")
            banks.add(".".join(parts[:-3] + [parts[-2]]))
        elif s.dtype == "F8_E4M3":
            dense.append(s.name)
    return sorted(banks), dense


def requantize(args: ModelArgs, state: dict[str, torch.Tensor], experts: ExpertFormat | None,
               dense: DenseFormat | None) -> tuple[dict[str, torch.Tensor], dict]:
    """The float32 ``state`` with routed experts and/or dense projections replaced by their dequantized values
    in the given formats (None: bf16), every other tensor as the bf16 checkpoint holds it.

    Returns ``(state, stats)`` with per-family ``rel_error`` (‖Ŵ − W‖/‖W‖ over the family) and
    ``bytes_per_param``.
    """
    out = bf16_rounded_state(args, state)
    bank_names, dense_names = _families(args)
    stats = {}
    for family, names, fmt in (("experts", bank_names, experts), ("dense", dense_names, dense)):
        err2 = ref2 = 0.0
        nbytes = params = 0
        for name in names:
            w = state[name].float()
            mats = w.unbind(0) if family == "experts" else [w]
            deq = []
            for m in mats:
                if fmt is None:
                    d, b = m.to(torch.bfloat16).float(), 2 * m.numel()
                elif family == "experts":
                    d, b = fp4_group_qdq(m, fmt)
                else:
                    d, b = fp8_dense_qdq(m, fmt)
                deq.append(d)
                err2 += float((d.double() - m.double()).square().sum())
                ref2 += float(m.double().square().sum())
                nbytes += b
                params += m.numel()
            out[name] = torch.stack(deq) if family == "experts" else deq[0]
        stats[family] = dict(format=fmt.label if fmt else f"{family} BF16", rel_error=math.sqrt(err2 / ref2),
                             bytes_per_param=nbytes / params, params=params)
    return out, stats


def sweep_points() -> list[dict]:
    """The ablation grid: bf16, the expert sweep, the dense sweep, the full native choice."""
    pts = [dict(name="bf16 (reference)", experts=None, dense=None, sweep="reference")]
    for scale in ("e8m0", "e4m3"):
        for group in (16, 32, 64, 128):
            f = ExpertFormat(group, scale)
            pts.append(dict(name=f.label, experts=f, dense=None, sweep="experts"))
    for f in (DenseFormat("block128", "e8m0"), DenseFormat("channel", "e8m0"), DenseFormat("channel", "f32")):
        pts.append(dict(name=f.label, experts=None, dense=f, sweep="dense"))
    pts.append(dict(name="native (experts E2M1 g32 E8M0 + dense 128x128 E8M0)", experts=NATIVE_EXPERTS,
                    dense=NATIVE_DENSE, sweep="native"))
    return pts


def run_ablation(weights_dir: str | Path, tokens_dir: str | Path, out: str | Path | None = None,
                 eval_windows: int = 24, batch_size: int = 4, points: list[dict] | None = None,
                 log: Callable[[str], None] = print) -> dict:
    """Evaluate every point of :func:`sweep_points` (or ``points``) and write the results JSON to ``out``."""
    weights_dir = Path(weights_dir)
    train_log = read_train_log(weights_dir)
    args = get_preset(train_log["config"]["preset"])
    state = load_weights_f32(weights_dir)
    streams, token_meta = load_tokens(tokens_dir)
    windows = heldout_windows(streams["heldout"], args.max_seq_len, eval_windows)
    numerics = Numerics(torch.bfloat16, act_quant=False, kv_fp8_sim=False, indexer_fp4_sim=False,
                        exact_reductions=False)
    ops = ReferenceOps(numerics)
    points = points or sweep_points()
    ref_logprobs = None
    rows = []
    t_all = time.perf_counter()
    for pt in points:
        t0 = time.perf_counter()
        q_state, stats = requantize(args, state, pt["experts"], pt["dense"])
        model = trainable_from_state(args, q_state)
        if ref_logprobs is None:
            if pt["experts"] is not None or pt["dense"] is not None:
                raise ValueError("the first ablation point must be the bf16 reference")
            ev = evaluate_nll(model, ops, windows, batch_size, keep_logprobs=True, progress=pt["name"])
            ref_logprobs = ev.pop("logprobs")
            ev["kl"] = 0.0
        else:
            ev = evaluate_nll(model, ops, windows, batch_size, reference_logprobs=ref_logprobs, progress=pt["name"])
        family = {"experts": "experts", "dense": "dense"}.get(pt["sweep"])
        fam_stats = stats[family] if family else None
        row = dict(name=pt["name"], sweep=pt["sweep"],
                   experts=asdict(pt["experts"]) if pt["experts"] else None,
                   dense=asdict(pt["dense"]) if pt["dense"] else None,
                   heldout_ppl=ev["ppl"], heldout_nll=ev["nll"], kl_vs_bf16=ev["kl"],
                   weight_rel_error=fam_stats["rel_error"] if fam_stats else stats["experts"]["rel_error"],
                   bytes_per_param=fam_stats["bytes_per_param"] if fam_stats else None,
                   families=stats,
                   is_checkpoint_choice=(pt["experts"] == NATIVE_EXPERTS and pt["dense"] is None)
                   or (pt["dense"] == NATIVE_DENSE and pt["experts"] is None) or pt["sweep"] == "native")
        if row["bytes_per_param"] is None:  # reference / native: all quantized families together
            total_b = sum(s["bytes_per_param"] * s["params"] for s in stats.values())
            row["bytes_per_param"] = total_b / sum(s["params"] for s in stats.values())
            err = [s["rel_error"] for s in stats.values()]
            row["weight_rel_error"] = max(err)
        rows.append(row)
        log(f"{pt['name']:<52} ppl {ev['ppl']:.3f} KL {ev['kl']:.5f} rel.err {row['weight_rel_error']:.4f} "
            f"{row['bytes_per_param']:.4f} B/param ({time.perf_counter() - t0:.0f} s)")
    result = dict(
        description="Weight-format ablation of data/tiny-py's trained model (dsv4lab.tools.train.quant_ablation)",
        computed_on=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads), from the trained weights as "
                    "`train` saved them (float32 experts, dense projections and F32 tensors; bf16 for the tensors "
                    "the checkpoint stores as BF16); no GPU involved",
        numerics="reference ops, bf16 compute, fp32 reductions, activation/KV/indexer simulations off: only the "
                 "weight format differs between points",
        metrics=dict(heldout_ppl="exp(mean NLL) over the evaluation windows",
                     kl_vs_bf16="teacher-forced KL(bf16 model || quantized model), nats per token",
                     weight_rel_error="||W_q - W||_F / ||W||_F over the swept family vs the float32 master weights "
                                      "(reference/native rows: the larger of the two families)",
                     bytes_per_param="bytes stored (values + scales) per parameter of the swept family "
                                     "(reference/native rows: experts and dense together)"),
        checkpoint_choice="routed experts E2M1, group 32, E8M0 scales; dense E4M3 with 128x128 E8M0 blocks",
        model=args.summary(), heldout_windows=len(windows), window_tokens=args.max_seq_len,
        heldout_tokens=int(windows.shape[0] * (windows.shape[1] - 1)),
        training=dict(steps=train_log["steps"], hardware=train_log["hardware"], seed=train_log["config"]["seed"]),
        corpus_digest=token_meta["corpus_manifest"]["digest"],
        versions=dict(torch=torch.__version__, python=sys.version.split()[0]), commit=short_commit(),
        seconds=time.perf_counter() - t_all, points=rows)
    if out is not None:
        write_json(out, result, indent=2)
    return result


def load_results(path: str | Path | None = None) -> dict | None:
    """The committed ablation results (``data/results/quant_ablation.json``), or None when absent."""
    p = Path(path) if path is not None else RESULTS_FILE
    return read_json(p) if p.exists() else None


__all__ = ["ExpertFormat", "DenseFormat", "NATIVE_EXPERTS", "NATIVE_DENSE", "fp4_group_qdq", "fp8_dense_qdq",
           "requantize", "sweep_points", "run_ablation", "load_results", "RESULTS_FILE"]

