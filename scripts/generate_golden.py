"""Run ``dsv4lab generate`` on a golden's trajectory prompt and compare the ids with the golden's.

The command a user runs (through the CLI, as a subprocess), on the prompt and length the golden trajectory was
recorded with (``data/golden/<checkpoint name>.json``): for each backend, the decode path it reports, its hash and
whether it is the golden's. Exit 1 if the first backend's (the fast one's) trajectory is not the golden's.

    python scripts/generate_golden.py --checkpoint data/tiny-py [--backends triton,reference] [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--backends", default="triton,reference")
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    golden_path = ROOT / "data" / "golden" / f"{Path(a.checkpoint).name}.json"
    if not golden_path.is_file():
        sys.exit(f"generate_golden: no golden {golden_path} for checkpoint {a.checkpoint}")
    trajectory = json.loads(golden_path.read_text())["trajectory"]
    fast_ok = True
    for i, backend in enumerate(a.backends.split(",")):
        cmd = [sys.executable, "-m", "dsv4lab", "generate", "--checkpoint", a.checkpoint, "--backend", backend,
               "--device", a.device, "--prompt-ids", ",".join(map(str, trajectory["prompt_ids"])),
               "--max-new-tokens", str(trajectory["n_tokens"]), "--json"]
        print("$", " ".join(cmd[1:]), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            print(run.stderr.strip()[-2000:])
            fast_ok &= i > 0
            continue
        out = json.loads(run.stdout.strip().splitlines()[-1])
        same = out["hash"] == trajectory["hash"]
        first = next((j for j, (x, y) in enumerate(zip(out["output_ids"], trajectory["ids"])) if x != y), None)
        print(f"{backend}: decode path {out.get('decode', {}).get('path')}, {len(out['output_ids'])} tokens in "
              f"{out.get('seconds')} s, hash {out['hash']} (golden {trajectory['hash']}): "
              f"{'golden trajectory reproduced' if same else f'MISMATCH from token {first}'}", flush=True)
        if i == 0:
            fast_ok = same
    return 0 if fast_ok else 1


if __name__ == "__main__":
    sys.exit(main())
