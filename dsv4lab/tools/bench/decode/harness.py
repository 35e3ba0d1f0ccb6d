"""The decode suite's run: rows per batch with GB/s and % of the copy bandwidth measured in the same run, and the
constants the sections share."""
from __future__ import annotations

from dsv4lab.tools.bench.common import BenchRun, measure_ceilings

BATCHES = (1, 2, 4, 8)
QUICK_BATCHES = (1, 8)
EXPERT_BYTES = 13_369_344  # one real routed expert: 3 × 4 MiB FP4 + 3 × 256 KiB E8M0
ROTATE_BYTES = 256 << 20
QUICK_BUDGET_S = 140.0


def run_mode(smoke: bool, quick: bool) -> str:
    """The variant list a run iterates (:data:`dsv4lab.engine.kernel_families.RUNS`)."""
    return "smoke" if smoke else ("quick" if quick else "full")


class DecodeBench(BenchRun):
    """One decode run: rows per batch with GB/s and % of the copy bandwidth measured here."""

    suite = "decode"

    def __init__(self, device, budget_s: float, smoke: bool):
        super().__init__(device, budget_s, smoke)
        self.copy_bw = None
        self.cublas: dict = {}

    def record_ceilings(self) -> None:
        """Copy bandwidth and matmul peaks, graph-timed (the decode rows' ceilings); nothing without a GPU."""
        if not self.cuda:
            return
        ceilings = measure_ceilings(self, timing="graph")
        self.copy_bw = ceilings.pop("copy_gbps")
        self.peaks = ceilings

    def add(self, kernel: str, variant: str, batch: int, time_us: float, nbytes: float, **extra) -> dict:
        gbps = nbytes / (time_us * 1e-6) / 1e9 if time_us else None
        row = dict(kernel=kernel, variant=variant, batch=batch, time_us=round(time_us, 2), bytes=int(nbytes),
                   gbps=None if gbps is None else round(gbps, 1),
                   pct_copy_bw=None if (gbps is None or not self.copy_bw) else round(100 * gbps / self.copy_bw, 1),
                   **extra)
        self.rows.append(row)
        self.log(f"{kernel:<22} {variant:<34} b={batch} {time_us:9.2f} µs {row['gbps'] or 0:8.1f} GB/s "
                 f"{row['pct_copy_bw'] or 0:5.1f}%")
        return row

    def check_record(self, c, gating: bool) -> dict:
        return dict(name=c.name, ok=c.ok, max_abs=c.max_abs, rel_l2=c.rel_l2, cosine=c.cosine,
                    bitwise=c.bitwise_equal, line=c.line())

    def record_bound(self, res, **extra) -> bool:
        """Record one :class:`~dsv4lab.tools.verify.bounds.BoundCheck` (or a dict with ``name, ok, line``)."""
        d = res.to_dict() if hasattr(res, "to_dict") else dict(res)
        d["line"] = res.line() if hasattr(res, "line") else d.get("line", "")
        d.update(extra)
        self.checks.append(d)
        self.log(d["line"])
        return bool(d["ok"])


