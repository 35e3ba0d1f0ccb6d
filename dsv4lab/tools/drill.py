"""The paper's W2 story as a drill on any native checkpoint: fault, failing oracle, per-stage evidence,
fingerprint, repair, passing oracle (``notebooks/01_layout_repair`` is its narrative).

As reported by the paper, a kernel library's pre-shuffled layout for the routed-expert down projection (W2)
disagreed with the loader: the 16-row blocks inside each 128-row tile came out permuted. The fixed-token
oracle failed, stage 1 (W1/W3) still matched the reference while stage 2 (W2) did not, output-column
fingerprinting named the permutation and a load-time repair of W2 and its scales fixed it.

The pieces that do the work live elsewhere — faults, fingerprinting and repair in :mod:`dsv4lab.core.layouts`,
oracles and layer tracing in :mod:`dsv4lab.tools.verify`; this module adds what the drill needs on top:

* :func:`fixed_id_oracles` / :func:`run_oracles` — the oracles of a trusted checkpoint (its golden file when the
  checkpoint matches it, otherwise recorded live from the trusted copy) and a pass/fail table for a runner;
* :func:`isolated_moe_stages` — per layer, the suspect's routed-expert stages fed the *trusted* run's inputs,
  so each stage is judged on its own (the paper's stage-level comparison) rather than on drifted inputs;
* :func:`channel_similarity` — the cosine matrix between a suspect linear's output channels and the trusted
  one's inside one tile: the permutation made visible;
* :func:`injected_layout_recovered` — whether a fingerprint found exactly the injected layout on exactly the
  injected linears.
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any, Sequence

import torch

from dsv4lab.core import layouts
from dsv4lab.core.checkpoint import Checkpoint
from dsv4lab.core.provenance import file_sha256
from dsv4lab.tools.verify.layers import trace_model
from dsv4lab.tools.verify.model import (checkpoint_identity, default_oracles, first_mismatch, golden_path_for, greedy_with_margins,
                           load_golden)

PAPER_FAULT = "paper_w2_blocks"


# ============================================================================================ oracles
def fixed_id_oracles(checkpoint: str | Path, trusted_runner=None, *, limit: int | None = None,
                     max_new_tokens: int | None = None) -> tuple[list[dict], str]:
    """The fixed-id oracles of a trusted checkpoint and where their expected ids come from.

    The golden file ``data/golden/<name>.json`` is used when its recorded checkpoint identity matches
    ``checkpoint``; otherwise the expected ids are recorded live, greedily, from ``trusted_runner`` (a
    reference-backend runner of ``checkpoint``). ``limit`` keeps the first oracles, ``max_new_tokens`` shortens
    them (for quick runs)."""
    checkpoint = Path(checkpoint)
    gpath = golden_path_for(checkpoint)
    oracles, source = None, ""
    if gpath.exists():
        golden = load_golden(gpath)
        ident = checkpoint_identity(checkpoint)
        if all(ident.get(k) == v for k, v in golden["checkpoint"].items() if k != "name"):
            oracles = [dict(name=o["name"], prompt_ids=o["prompt_ids"], expected_ids=o["expected_ids"])
                       for o in golden["oracles"]]
            source = f"golden file {gpath.parent.name}/{gpath.name}"
    if oracles is None:
        if trusted_runner is None:
            raise ValueError(f"{checkpoint}: no matching golden file ({gpath.name}); pass trusted_runner to record "
                             "the oracles live")
        oracles = [dict(name=o["name"], prompt_ids=o["prompt_ids"], max_new_tokens=o["max_new_tokens"])
                   for o in default_oracles(trusted_runner.args, trusted_runner.tokenizer, checkpoint)]
        source = f"recorded live from the trusted checkpoint {checkpoint.name} (no matching golden file)"
    oracles = oracles[:limit] if limit else oracles
    for o in oracles:
        if max_new_tokens is not None and "expected_ids" in o:
            o["expected_ids"] = o["expected_ids"][:max_new_tokens]
        if "expected_ids" not in o:
            n = min(o.pop("max_new_tokens"), max_new_tokens or 10 ** 9)
            o["expected_ids"], _ = greedy_with_margins(trusted_runner, o["prompt_ids"], n)
    return oracles, source


def run_oracles(runner, oracles: Sequence[dict]) -> list[dict]:
    """Greedy-decode each oracle's prompt and compare with its expected ids: one row per oracle with ``ok``,
    ``first_mismatch`` and the expected and produced token at that step."""
    rows = []
    for o in oracles:
        got, _ = greedy_with_margins(runner, o["prompt_ids"], len(o["expected_ids"]))
        mm = first_mismatch(got, o["expected_ids"])
        rows.append(dict(oracle=o["name"], prompt_tokens=len(o["prompt_ids"]), steps=len(o["expected_ids"]),
                         ok=mm is None, first_mismatch=mm,
                         expected=o["expected_ids"][mm] if mm is not None and mm < len(o["expected_ids"]) else None,
                         got=got[mm] if mm is not None and mm < len(got) else None))
    return rows


# ============================================================================================ stages
def _cosine_and_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    keep = torch.isfinite(o) & torch.isfinite(r)  # slots of experts nobody picked are NaN on both sides
    o, r = o[keep], r[keep]
    den = float(o.norm() * r.norm())
    cos = float((o * r).sum() / den) if den > 0 else (1.0 if torch.equal(o, r) else 0.0)
    rn = float(r.norm())
    rel = float((o - r).norm() / rn) if rn > 0 else 0.0
    return cos, rel


@torch.inference_mode()
def isolated_moe_stages(trusted, suspect, input_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Per layer, the suspect's routed-expert stages on the trusted run's own inputs, against the trusted outputs.

    The trusted runner is traced on ``input_ids``; for every layer its MoE input and routing feed the suspect's
    stage 1 (W1, W3), and its activation feeds the suspect's stage 2 (W2). Each row has the cosine and relative
    error of ``stage1_w1``, ``stage1_w3`` and ``stage2_w2`` (NaN slots of unpicked experts ignored)."""
    tr = trace_model(trusted, list(input_ids), keep_tensors=True)
    ops = suspect.ops
    rows = []
    for i, block in enumerate(suspect.model.layers):
        p = f"layers.{i}.ffn."
        if p + "input" not in tr.tensors:
            continue
        x, idx = tr.tensors[p + "input"], tr.tensors[p + "router_idx"]
        bank = block.ffn.experts
        g, u = ops.moe_stage1(x.to(suspect.device), idx.to(suspect.device), bank)
        out = ops.moe_stage2(tr.tensors[p + "activation"].to(suspect.device), idx.to(suspect.device), bank)
        row: dict[str, Any] = dict(layer=i)
        for stage, got in (("stage1_w1", g), ("stage1_w3", u), ("stage2_w2", out)):
            cos, rel = _cosine_and_error(got.cpu(), tr.tensors[p + stage])
            row[f"{stage}_cosine"] = cos
            row[f"{stage}_rel_err"] = rel
        rows.append(row)
    return rows


# ============================================================================================ heatmap
def channel_similarity(trusted: str | Path, suspect: str | Path, linear: str, *, tile: int = 0,
                       tile_size: int = 128, n_probes: int = 64, seed: int = 0) -> torch.Tensor:
    """``[t, t]`` cosine similarity between the suspect linear's output channels (rows) and the trusted one's
    (columns) inside output tile ``tile`` (``t = min(tile_size, out_features)``), on random probe inputs.

    An exact row permutation shows as one 1 per row; the paper's W2 fault as 16-row blocks off the diagonal."""
    ref_ck, sus_ck = Checkpoint(trusted), Checkpoint(suspect)
    ops = []
    for ck in (ref_ck, sus_ck):
        if linear + ".weight" not in ck:
            raise layouts.LayoutError(f"{ck.path}: no linear {linear!r}")
        w = ck.get(linear + ".weight")
        s = ck.get(linear + ".scale") if linear + ".scale" in ck else None
        ops.append((layouts.linear_op(w, s), w))
    w_ref = ops[0][1]
    out_f, in_f = layouts.logical_shape(tuple(w_ref.shape), layouts.weight_format(w_ref))
    t = min(tile_size, out_f)
    n_tiles = -(-out_f // t)
    if not 0 <= tile < n_tiles:
        raise ValueError(f"{linear}: tile {tile} out of range; {out_f} output rows make {n_tiles} tile(s) of {t}")
    x = layouts.probe_inputs(in_f, n_probes, 1, seed, torch.float64)
    rows = slice(tile * t, min((tile + 1) * t, out_f))
    yr, ys = ops[0][0](x)[:, rows].double(), ops[1][0](x)[:, rows].double()
    yr = yr / yr.norm(dim=0, keepdim=True).clamp_min(1e-300)
    ys = ys / ys.norm(dim=0, keepdim=True).clamp_min(1e-300)
    return (ys.T @ yr).float()


def expert_linears(checkpoint: str | Path, which: str = "w2") -> dict[tuple[int, int], str]:
    """``{(layer, expert): linear name}`` of the routed experts' ``which`` projection (main layers only)."""
    out = {}
    for lin in layouts.checkpoint_linears(Checkpoint(checkpoint)):
        m = re.fullmatch(rf"layers\.(\d+)\.ffn\.experts\.(\d+)\.{which}", lin)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = lin
    return out


# ============================================================================================ verdict
def injected_layout_recovered(result: "layouts.CheckpointFingerprint", checkpoint: str | Path, injected: Sequence[str],
                              fault: str | layouts.Fault = PAPER_FAULT,
                              only: Sequence[str] | None = None) -> dict[str, Any]:
    """Whether the repair spec a fingerprint derived names exactly ``fault``'s layout on exactly the
    ``injected`` linears (and nothing on any other fingerprinted linear)."""
    fault = layouts.FAULTS[fault] if isinstance(fault, str) else fault
    injected = set(injected)
    linears = layouts.checkpoint_linears(Checkpoint(checkpoint))
    if only:
        linears = [lin for lin in linears if any(fnmatch.fnmatchcase(lin, g) for g in only)]
    wrong, missed = [], []
    for lin in linears:
        found = [r.layout for r in result.spec.rules if r.matches(lin)]
        want = [fault.layout] if lin in injected else []
        if found != want:
            (missed if lin in injected else wrong).append(lin)
    layouts_found = list(dict.fromkeys(r.layout.describe() for r in result.spec.rules))
    return dict(exact=not wrong and not missed and result.ok, injected=len(injected & set(linears)),
                checked=len(linears), missed=missed[:10], wrongly_flagged=wrong[:10], layouts_found=layouts_found,
                injected_layout=fault.layout.describe(), rules=len(result.spec.rules))


def same_files(a: str | Path, b: str | Path) -> dict[str, bool]:
    """``{file name: identical bytes}`` over the files of folder ``a`` (a repaired copy against the original)."""
    a, b = Path(a), Path(b)
    return {p.name: (b / p.name).exists() and file_sha256(p) == file_sha256(b / p.name)
            for p in sorted(a.iterdir()) if p.is_file()}


__all__ = ["PAPER_FAULT", "fixed_id_oracles", "run_oracles", "isolated_moe_stages", "channel_similarity",
           "expert_linears", "injected_layout_recovered", "same_files"]
