"""Kernel-native weight layouts, output/input fingerprinting, and load-time repair of permuted weights.

The paper's decisive bug: a kernel library's pre-shuffled layout for the routed-expert down projection (W2)
disagreed with the loader, so the 16-row blocks inside each 128-row tile came out permuted
(fast → reference ``[0,2,4,6,1,3,5,7]``). Stage 1 matched the oracle, stage 2 did not; output-column
fingerprinting found the permutation and permuting W2 **and its scales** once at load time fixed it. This
package makes that detective work a tool, one room per concern:

* :mod:`~dsv4lab.core.layouts.formats` — weight formats (packed FP4, FP8 with 128×128 block scales, dense) and the
  byte-level helpers.
* :mod:`~dsv4lab.core.layouts.algebra` — **layouts as data**: :class:`Permutation` / :class:`BlockPermutation` /
  :class:`GateUpInterleave`, :class:`TilePreshuffle`, :class:`NibbleSwap`, :class:`KMajor`, :class:`Inverse`, each
  an exact invertible map on a weight **and** its scale; block structure in words.
* :mod:`~dsv4lab.core.layouts.fingerprint` — :func:`fingerprint` (two ops) and :func:`fingerprint_recorded` (recorded
  activations): the permutation between them, its block structure, residual and confidence.
* :mod:`~dsv4lab.core.layouts.diagnose` — :func:`diagnose_linear`: which layout explains one stored linear.
* :mod:`~dsv4lab.core.layouts.repair` — **repair specs**: ``RepairSpec.load(path)``, then ``spec.apply(name, tensor,
  checkpoint)`` per tensor as it is read (``dsv4lab.load(..., repairs=spec)``), or :func:`repair_checkpoint`
  for a corrected copy (never in place).
* :mod:`~dsv4lab.core.layouts.catalogue` — the **fault catalogue** :data:`FAULTS` and
  :func:`inject_fault_into_checkpoint` (faulted copies for drills).
* :mod:`~dsv4lab.core.layouts.survey` — :func:`fingerprint_checkpoint`: a whole suspect checkpoint, per tensor class,
  and the repair spec it implies.
* :mod:`~dsv4lab.tools.drill` — the layout-fault drill of the notebooks (inject, localise, fingerprint,
  repair, confirm); it runs the model and the verification tiers, so it is imported on its own
  (``from dsv4lab.tools import drill``), never by this package.

Conventions: a layout maps *native* → *stored*. For permutations ``stored[i] = native[perm[i]]`` along the
side, which is exactly the fingerprint's ``perm`` (suspect index ``i`` holds reference index ``perm[i]``), so
the fingerprint of a stored layout is the layout itself and the repair is its inverse. All work is on packed
bytes; only one linear at a time is ever dequantized (for fingerprinting), never a whole checkpoint.
"""
from __future__ import annotations

from dsv4lab.core.errors import LayoutError
from dsv4lab.core.layouts.algebra import (LAYOUTS, PRESHUFFLE_16x16, PRESHUFFLE_32x16, BlockPermutation, BlockStructure, GateUpInterleave,
                      Inverse, KMajor, Layout, NibbleSwap, Permutation, TilePreshuffle, detect_block_structure,
                      layout_from_json, layout_from_perm, paper_w2_permutation)
from dsv4lab.core.layouts.catalogue import FAULTS, Fault, checkpoint_linears, inject_fault_into_checkpoint
from dsv4lab.core.layouts.diagnose import Diagnosis, Recorded, diagnose_linear
from dsv4lab.core.layouts.fingerprint import (FingerprintResult, fingerprint, fingerprint_recorded, match_columns, match_scores,
                          match_subspaces, probe_inputs)
from dsv4lab.core.layouts.formats import (byte_view, check_permutation, dequantize, invert_permutation, linear_op, logical_shape,
                      weight_format)
from dsv4lab.core.layouts.repair import SPEC_FORMAT, RepairRule, RepairSpec, repair_checkpoint
from dsv4lab.core.layouts.survey import (CheckpointFingerprint, ClassReport, class_regex, fingerprint_checkpoint, load_golden_dumps,
                     tensor_class)

__all__ = [
    "LayoutError", "Layout", "LAYOUTS", "Permutation", "BlockPermutation", "GateUpInterleave", "TilePreshuffle",
    "NibbleSwap", "KMajor", "Inverse", "PRESHUFFLE_16x16", "PRESHUFFLE_32x16", "paper_w2_permutation",
    "layout_from_json", "layout_from_perm", "weight_format", "logical_shape", "dequantize", "linear_op",
    "invert_permutation", "check_permutation", "byte_view", "BlockStructure", "detect_block_structure",
    "FingerprintResult", "fingerprint", "fingerprint_recorded", "match_columns", "match_subspaces", "match_scores",
    "probe_inputs", "Recorded", "Diagnosis", "diagnose_linear", "SPEC_FORMAT", "RepairRule", "RepairSpec",
    "repair_checkpoint", "Fault", "FAULTS", "inject_fault_into_checkpoint", "checkpoint_linears", "tensor_class",
    "class_regex", "load_golden_dumps", "fingerprint_checkpoint", "CheckpointFingerprint", "ClassReport",
]
