"""Measure the main and the MTP head's rounding-noise floors on ``data/tiny-py`` → data/results/host/mtp_floor.json.

    python scripts/measure_mtp_floor.py [--ids 70]

Teacher-forced on ``fixed_sequence(args, N)`` (the ids the speculative GPU test uses): per-position KL between the
reference and the same reference with fp32 instead of exact reductions, for the main logits and for the MTP block's
(:func:`dsv4lab.tools.verify.model.rounding_noise_floors_with_mtp`). The MTP head is judged by its own floor.
"""
import argparse
import platform
from pathlib import Path

import torch

import dsv4lab
from dsv4lab.core.provenance import short_commit, write_json
from dsv4lab.tools.verify.model import fixed_sequence, rounding_noise_floors_with_mtp

root = Path(__file__).resolve().parents[1]
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--ids", type=int, default=70)
a = p.parse_args()
m = dsv4lab.load(root / "data" / "tiny-py", max_batch=1)
floors = rounding_noise_floors_with_mtp(m, fixed_sequence(m.args, a.ids))
heads = {h: dict(mean_kl=sum(v) / len(v), max_kl=max(v), positions=len(v)) for h, v in floors.items()}
doc = dict(checkpoint="data/tiny-py", ids=f"fixed_sequence(args, {a.ids})", heads=heads,
           mtp_over_main=dict(mean=heads["mtp"]["mean_kl"] / heads["main"]["mean_kl"],
                              max=heads["mtp"]["max_kl"] / heads["main"]["max_kl"]),
           device="cpu", torch=torch.__version__, python=platform.python_version(), commit=short_commit())
out = root / "data" / "results" / "host" / "mtp_floor.json"
write_json(out, doc)
for h, r in heads.items():
    print(f"{h:4s} floor: mean KL {r['mean_kl']:.3g}, max {r['max_kl']:.3g} over {r['positions']} positions")
print(f"MTP / main: mean {doc['mtp_over_main']['mean']:.2f}x, max {doc['mtp_over_main']['max']:.2f}x; wrote {out}")
