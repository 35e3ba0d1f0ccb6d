"""The correctness hierarchy (the paper's, plus the teacher-forced tier it planned).

* :mod:`.compare` — the compare helper and the tolerance policy (one place).
* :mod:`.registry` / :mod:`.kernels` — kernel level: every registered op, every available implementation, fresh
  random inputs over a grid of shapes, against the reference.
* :mod:`.layers` — layer level: router, stage 1, activation, stage 2, MoE output, attention, compressor,
  indexer, mHC, per layer; names the first layer and stage that diverge.
* :mod:`.model` — model level: fixed-id oracles, the 256-token trajectory hash, teacher-forced cached-vs-recompute
  logits around every boundary; golden files under ``data/golden/``.

Submodules import torch; this package itself imports nothing heavy.
"""
