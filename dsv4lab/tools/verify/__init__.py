"""The correctness hierarchy (the paper's, plus the teacher-forced tier it planned); docs/verification.md.

* :mod:`.bounds` / :mod:`.op_bounds` — error bounds from analysis: ``γₙ·Σ|terms|`` for sums, intervals through
  roundings and quantizers for chains; the bound of every replaceable op, computed from its inputs (a fused op's:
  the chain of its parts on intervals).
* :mod:`.op_outputs` — what a call outputs: its return value and, for the ops that write in place (the ring write,
  the compressor step), the state it writes, run on private copies.
* :mod:`.registry` / :mod:`.kernels` — kernel level: every registered op, every available implementation, fresh
  random inputs over a grid of shapes, against the reference, judged by the op's bound.
* :mod:`.layers` — the golden layer digests of a run (router, stages of the MoE, attention, compressor, indexer,
  mHC per layer): names the first layer and stage where the reference run leaves the golden (a checkpoint fault).
* :mod:`.stages` — the stage-isolated oracle: the reference recorded at the op boundary (a prefill, an eager and a
  static decode step), every call replayed on a backend with the reference's inputs and judged by its bound under
  the accumulation model the backend states for that call (a backend fault, named at layer and stage).
* :mod:`.model` — model level: fixed-id oracles, the 256-token trajectory hash, teacher-forced KL around every
  boundary, exact for the reference and calibrated against the checkpoint's rounding floor for other backends.
* :mod:`.variants` / :mod:`.backend_faults` — legitimate rounding variants (calibration) and deliberate backend
  faults (tests).
* :mod:`.compare` — descriptive metrics (max abs, relative L2, cosine) reported beside the verdicts.

Submodules import torch; this package itself imports nothing heavy.
"""
