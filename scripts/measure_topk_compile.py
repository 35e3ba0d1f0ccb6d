"""Compile time of the indexer's top-k kernel for an NVIDIA target, without a GPU: a former revision's kernel against
this tree's, at the row lengths (compressed entries, ratio 4) of prompts of 512 … 32,768 tokens.

The one-sort kernel compiled a bitonic network per power of two of the row; the tiled one compiles once. Host
seconds (Triton's own ptxas); run without ``TRITON_INTERPRET`` and with a fresh ``TRITON_CACHE_DIR``.

    TRITON_CACHE_DIR=$(mktemp -d) python scripts/measure_topk_compile.py --old af564e0 [--target cuda:90]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compile_glue_kernels as cg  # noqa: E402

ROWS = ((512, 128), (4604, 1151), (8192, 2048), (8192, 4096), (8192, 8192))  # (queries, entries) of a chunk


def _attention_prefill(root: Path):
    """The tree at ``root``'s ``attention_prefill.py``, imported as part of the ``dsv4lab_kernels`` package."""
    for name in [m for m in sys.modules if m.startswith("dsv4lab_kernels")]:
        del sys.modules[name]
    folder = root / "kernels" / "dsv4lab_kernels"
    if not folder.is_dir():
        folder = root / "kernels"  # trees before the package moved into kernels/dsv4lab_kernels/
    spec = importlib.util.spec_from_file_location("dsv4lab_kernels", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["dsv4lab_kernels"] = pkg
    spec.loader.exec_module(pkg)
    return importlib.import_module("dsv4lab_kernels.attention_prefill")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="the revision whose kernel to compare (git rev)")
    p.add_argument("--target", default="cuda:90", help="backend:arch, e.g. cuda:90")
    args = p.parse_args()
    backend, arch = args.target.split(":")
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, 32 if backend == "cuda" else 64)
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.old, "kernels"], capture_output=True)
        if archive.returncode:
            sys.exit(f"measure_topk_compile.py: git archive {args.old}: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "x", "-C", tmp], input=archive.stdout, check=True)
        for label, root in ((f"{args.old} (one sort per row)", Path(tmp)), ("this tree (tiled)", ROOT)):
            ap = _attention_prefill(root)
            for S, T in ROWS:
                call = (f"T={T}", lambda S=S, T=T: ap.indexer_topk(torch.zeros(1, S, T, dtype=torch.bfloat16),
                                                                   torch.full((1, S), 4 * T), 4, 512))
                for r in cg.compile_launches(target, [call]):
                    print(json.dumps(dict(kernels=label, entries=T, **r)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
