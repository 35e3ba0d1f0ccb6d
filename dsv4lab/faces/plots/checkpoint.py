"""Checkpoint figures: where a checkpoint's bytes are, and what the native number formats cost (00)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from dsv4lab.faces.plots.style import INK, MEASURED, PALETTE, caption, marker_style, new_figure, use_style

INVENTORY_SIZE = (7.6, 3.8)
QUANT_ABLATION_SIZE = (8.4, 4.0)


def plot_checkpoint_inventory(inventory: Mapping[str, Any], *, title: str | None = None,
                              where: Mapping[str, Any] | None = None):
    """Bytes of a checkpoint by component and by stored dtype (``Inventory.to_dict()`` of
    :meth:`dsv4lab.core.checkpoint.Checkpoint.validate`)."""
    comps = sorted(inventory.get("by_component", {}).items(), key=lambda kv: kv[1])
    dtypes = sorted(((k, v["bytes"]) for k, v in inventory.get("by_dtype", {}).items()), key=lambda kv: kv[1])
    total = float(inventory.get("total_bytes") or sum(v for _, v in comps) or 1)
    scale, unit = (1e-9, "GB") if total > 5e9 else (1e-6, "MB")
    with use_style():
        fig = new_figure(INVENTORY_SIZE)
        a1, a2 = fig.subplots(1, 2, width_ratios=[1.6, 1.0])
        a1.barh([c for c, _ in comps], [v * scale for _, v in comps], color=PALETTE[0])
        a1.set_xlabel(f"stored bytes ({unit})")
        a1.set_ylabel("component")
        a1.set_title("by component", fontsize=9)
        a2.barh([d for d, _ in dtypes], [v * scale for _, v in dtypes], color=PALETTE[1])
        a2.set_xlabel(f"stored bytes ({unit})")
        a2.set_ylabel("stored dtype")
        a2.set_title("by stored dtype", fontsize=9)
        for ax in (a1, a2):
            ax.grid(axis="y", visible=False)
            ax.tick_params(axis="y", labelsize=7)
        fig.suptitle(title or f"Checkpoint bytes ({total * scale:,.1f} {unit} in {inventory.get('tensors')} tensors)",
                     fontsize=10)
        w = {k: v for k, v in (where or {}).items() if v is not None}
        w.setdefault("measured", "counted from the safetensors files on disk")
        caption(fig, w.pop("model", "the checkpoint"), **w)
    return fig


def plot_quant_ablation(points: Sequence[Mapping[str, Any]], *, title: str | None = None,
                        where: Mapping[str, Any] | None = None):
    """The weight-format ablation of the trained small model (``data/results/quant_ablation.json``).

    Left: routed experts — teacher-forced KL against the bf16 model per FP4 group size, E8M0 (power-of-two) vs
    E4M3 group scales. Right: dense projections, FP8 with 128×128 blocks vs per-channel scales. The real
    checkpoint's choice is drawn as a star (left) and a dark bar (right).
    """
    with use_style():
        fig = new_figure(QUANT_ABLATION_SIZE)
        ax_e, ax_d = fig.subplots(1, 2, width_ratios=(3, 2))
        experts = [p for p in points if p.get("sweep") == "experts"]
        for i, (scale, marker) in enumerate((("e8m0", "o"), ("e4m3", "s"))):
            rows = sorted((p for p in experts if p["experts"]["scale"] == scale), key=lambda p: p["experts"]["group"])
            if not rows:
                continue
            style = marker_style(MEASURED, PALETTE[i], 5)
            style.update(marker=marker, linestyle="-")
            ax_e.plot([p["experts"]["group"] for p in rows], [p["kl_vs_bf16"] for p in rows],
                      label=f"{scale.upper()} group scales", **style)
        for p in (p for p in experts if p.get("is_checkpoint_choice")):
            ax_e.plot([p["experts"]["group"]], [p["kl_vs_bf16"]], marker="*", markersize=14, color=INK,
                      linestyle="none", label="the checkpoint's choice (E2M1, g32, E8M0)")
        ax_e.set_xscale("log", base=2)
        groups = sorted({p["experts"]["group"] for p in experts})
        ax_e.set_xticks(groups, [str(g) for g in groups])
        ax_e.set_xlabel("FP4 (E2M1) group size (weights per scale)")
        ax_e.set_ylabel("KL vs the bf16 model (nats/token)")
        ax_e.set_title("routed experts", fontsize=9)
        ax_e.legend(fontsize=7)
        dense = [p for p in points if p.get("sweep") == "dense"]
        labels = [p["name"].replace("dense E4M3 ", "").replace(" E8M0", "\nE8M0").replace(" F32", "\nF32")
                  for p in dense]
        ax_d.bar(range(len(dense)), [p["kl_vs_bf16"] for p in dense],
                 color=[INK if p.get("is_checkpoint_choice") else PALETTE[0] for p in dense])
        ax_d.set_xticks(range(len(dense)), labels, fontsize=7)
        ax_d.set_xlabel("FP8 scale layout (dark: the checkpoint)")
        ax_d.set_ylabel("KL vs the bf16 model (nats/token)")
        ax_d.set_title("dense projections (FP8 E4M3)", fontsize=9)
        fig.suptitle(title or "What the native number formats cost the trained small model", fontsize=10)
        w = {k: v for k, v in (where or {}).items() if v is not None}
        w.setdefault("measured", "teacher-forced on held-out text, CPU (data/results/quant_ablation.json)")
        caption(fig, w.pop("model", "data/tiny-py, re-quantized per format"), **w)
    return fig


__all__ = ["plot_checkpoint_inventory", "plot_quant_ablation"]
