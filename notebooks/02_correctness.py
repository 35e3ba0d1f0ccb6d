# %% [markdown]
# # 02 · The correctness hierarchy: kernel, layer and model tiers, and divergence at every cache boundary
#
# As reported by the paper, its correctness recovery rested on a hierarchy of checks: **kernel** tests of each op
# against a reference, **layer** oracles that compare stage by stage (router, stage 1, activation, stage 2, sum),
# and **model** oracles — fixed-token prompts whose greedy ids must match exactly, and a 256-token trajectory hash.
# The paper planned, but did not build, a teacher-forced tier that compares cached decoding with a full recompute
# around every cache boundary (sliding window, each compression ratio, the indexer's top-k). dsv4lab has all of
# them (`dsv4lab verify kernels | layers | model`); this notebook runs them and shows what each one sees.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/02_correctness/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (tests): one shape per op, no Triton, one oracle, no trajectory, 72 tokens
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # seed of the kernel-tier random inputs
CHECKPOINT: str = ""  # checkpoint folder; empty: data/tiny-py when present, else data/tiny
FAULT: str = "compressed_rope_block_end"  # a model fault the tiers must catch (dsv4lab.tools.verify.faults.MODEL_FAULTS)
TF_TOKENS: int = 0  # teacher-forced tokens; 0: the golden sequence, which crosses every boundary

# %%
# %matplotlib inline
import dsv4lab
from dsv4lab.faces import measurements, plots, runs
from dsv4lab.tools.verify import layers as layer_tier
from dsv4lab.tools.verify import model as model_tier
from dsv4lab.tools.verify.faults import MODEL_FAULTS, faulty_backend

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("02_correctness", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, SEED=SEED, FAULT=FAULT,
                                                             TF_TOKENS=TF_TOKENS))
if FAULT not in MODEL_FAULTS:
    raise ValueError(f"FAULT={FAULT!r}: expected one of {', '.join(MODEL_FAULTS)}")
golden_file = model_tier.golden_path_for(ckpt)
golden = model_tier.load_golden(golden_file) if golden_file.exists() else None
identity = model_tier.checkpoint_identity(ckpt)
golden_matches = golden is not None and all(identity.get(k) == v for k, v in golden["checkpoint"].items()
                                            if k != "name")
print(f"checkpoint {runs.display_path(ckpt)}; golden file "
      + (f"{runs.display_path(golden_file)} ({'matches' if golden_matches else 'does NOT match'} the checkpoint)"
         if golden else f"absent ({golden_file.name}: record one with `dsv4lab verify record`)"))
out.keys(golden_present=golden is not None, golden_matches_checkpoint=golden_matches)

# %% [markdown]
# ## Kernel tier
#
# Every registered op, for every implementation a backend provides, against the reference on fresh random
# inputs over a grid of irregular shapes, with NaN-poisoned rows a correct kernel never reads. The reference
# compared with itself must be bitwise; the Triton backend runs under the interpreter on a CPU.
#
# The figure puts each op's worst check at its error divided by what it is allowed, so a pass (left of the line
# at 1) and a fail (right of it) read at a glance. When the checks carry the analytic bound's ratio
# (`dsv4lab.tools.verify.bounds`: `|out − ref| ≤ γₙ·Σ|terms| + ulps`), that ratio is plotted; otherwise the worst
# element's error over its tolerance (`dsv4lab.tools.verify.compare.tolerance`), and the caption says so.

# %%
reference = measurements.kernel_checks("reference", seed=SEED, max_shapes=1 if SMOKE else None)
if SMOKE:  # 03 and 04 run the interpreter check of the Triton kernels; a smoke run here does not repeat it
    triton = dict(status="skipped", rows=[], message="not run in SMOKE mode")
else:
    triton = measurements.kernel_checks("triton", ["moe_stage1", "moe_stage2", "linear_fp8", "linear_fp4",
                                                   "sparse_attention"], seed=SEED, max_shapes=1)
print(f"reference: {reference['message']}; triton: {triton['status']} — {triton['message']}")
kernel_rows = reference["rows"] + triton["rows"]
out.keys(kernel_tier_reference_ok=reference["status"] == "ran" and all(r["ok"] for r in reference["rows"]),
         kernel_tier_triton_status=triton["status"],
         kernel_tier_triton_failed=sum(not r["ok"] for r in triton["rows"]) if triton["rows"] else None)
out.table("kernel_tier", measurements.check_rows_summary(kernel_rows))

# %%
kernel_where = dict(model="every registered op at small irregular shapes",
                    measured="this CPU: the reference backend, and the Triton kernels under the interpreter"
                    + ("" if triton["rows"] else f" (Triton: {triton['status']})"))
out.figure(plots.plot_kernel_check_errors(kernel_rows, where=kernel_where), "kernel_tier")

# %% [markdown]
# ## Model tier
#
# Fixed-id oracles (greedy ids must match the golden ids exactly), the 256-token trajectory hash (full runs), and
# the teacher-forced tier: one sequence crossing every boundary, its logits computed once by a single prefill
# (recompute) and once token by token through the caches, compared per position by KL. The reference backend
# must agree with itself to 1e-9.

# %%
runner = dsv4lab.load(ckpt, max_batch=1)
args = runner.args
kl_bound = 1e-9
tiers = []
if golden_matches:
    checked = dict(golden, oracles=golden["oracles"][:1]) if SMOKE else golden
    res = model_tier.verify_model(runner, checked, ckpt, skip_trajectory=SMOKE, layer_check="never",
                                  tiers=("oracles", "trajectory"))
    for name, tier in res["tiers"].items():
        tiers.append(dict(tier=name, ok=tier["ok"], detail=tier.get("hash") or
                          f"{sum(r['ok'] for r in tier.get('rows', []))}/{len(tier.get('rows', []))} oracles"))
    out.keys(oracles_ok=res["tiers"]["oracles"]["ok"],
             trajectory_ok=res["tiers"]["trajectory"]["ok"] if "trajectory" in res["tiers"] else None)
else:
    print("no golden file matches this checkpoint: the fixed-id oracles and the trajectory cannot be checked here")
tf_ids = golden["teacher_forced"]["ids"] if golden_matches else model_tier.fixed_sequence(
    args, model_tier.teacher_forced_length(args))
bounds = model_tier.boundaries(args)
n_tf = 72 if SMOKE else (TF_TOKENS or len(tf_ids))
tf_ids = tf_ids[:n_tf]
cvr = model_tier.cached_vs_recompute(runner, tf_ids)
boundary_rows, first_bad, max_kl = model_tier.boundary_report(cvr["kl"], args, kl_bound)
tiers.append(dict(tier="cached_vs_recompute", ok=first_bad is None,
                  detail=f"max KL {max_kl:.3g} over {n_tf} positions"))
out.keys(cached_vs_recompute_max_kl=max_kl, cached_vs_recompute_first_divergence=first_bad,
         teacher_forced_tokens=n_tf)
out.table("model_tier", tiers)

# %% [markdown]
# ## Divergence vs position, around every boundary
#
# The same teacher-forced sequence through a model with a known bug (`FAULT`, one of the bug classes public ports
# shipped) against the reference: its KL is zero until the first position where the bug has an effect — a
# boundary — and the tier names that position. The reference's own cached-vs-recompute KL stays on the floor.

# %%
faulty = dsv4lab.load(ckpt, max_batch=1, backend=faulty_backend(FAULT))
ids = model_tier.torch.tensor([tf_ids])
runner.reset([0])
faulty.reset([0])
kl_fault = model_tier.kl_per_position(runner.forward(ids, 0, slots=[0])[0], faulty.forward(ids, 0, slots=[0])[0])
runner.reset([0])
faulty.reset([0])
fault_rows, fault_first, fault_max = model_tier.boundary_report(kl_fault, args, 1e-6)
print(f"{FAULT}: {MODEL_FAULTS[FAULT]}\nfirst position with KL > 1e-6: {fault_first}; max KL {fault_max:.3g}")
out.keys(fault_detected=fault_first is not None, fault_first_divergence=fault_first)
out.table("boundaries", [dict(boundary=r["boundary"], positions=r["positions"], reference_max_kl=r["max_kl"],
                              faulty_max_kl=f["max_kl"]) for r, f in zip(boundary_rows, fault_rows)])
fig = plots.plot_divergence_vs_position({"reference: cached vs recompute": cvr["kl"],
                                         f"{FAULT}: vs reference": kl_fault}, bounds, bound=kl_bound,
                                        title=f"Teacher-forced KL per position ({ckpt.name})",
                                        where=dict(model=f"checkpoint {runs.display_path(ckpt)}",
                                                   measured="reference backend on this machine, "
                                                            f"{n_tf} teacher-forced tokens"))
out.figure(fig, "divergence")

# %% [markdown]
# ## Layer tier: where does it go wrong?
#
# Every stage of every layer is summarised by a digest (norm, NaN count, a 64-dimensional random projection) and
# compared with the golden digests in forward order; the first stage that disagrees is named. The reference
# passes; the faulty model is localised to its layer and stage.

# %%
if golden_matches:
    golden_layers = golden["layers"]
else:  # no trusted recording: compare with a live trace of the reference (`verify layers --against-reference`)
    ref_trace = layer_tier.trace_model(runner, tf_ids[:96])
    golden_layers = dict(input_ids=tf_ids[:96], order=ref_trace.order, digests=ref_trace.digests)
clean_first, _ = layer_tier.first_divergence(layer_tier.trace_model(runner, golden_layers["input_ids"]), golden_layers,
                                             "reference")
fault_first_stage, fault_layer_rows = layer_tier.first_divergence(
    layer_tier.trace_model(faulty, golden_layers["input_ids"]), golden_layers, "reference")
where = f"{fault_first_stage.block} — {fault_first_stage.stage}" if fault_first_stage else None
print(f"reference: {'no divergence' if clean_first is None else clean_first.note}; {FAULT}: first divergence {where}")
out.keys(layer_tier_clean_ok=clean_first is None, fault_first_stage=where)
fig = plots.plot_layer_divergence([r.to_dict() for r in fault_layer_rows],
                                  title=f"Layer tier localises {FAULT}",
                                  where=dict(model=f"checkpoint {runs.display_path(ckpt)}",
                                             measured=f"reference backend with the {FAULT} fault, on this machine"))
out.figure(fig, "layer_tier")

# %% [markdown]
# ## Summary
#
# A backend or checkpoint passes when every binding tier passes; on failure `dsv4lab verify model` runs the layer
# tier and names the first layer and stage that diverge. The same checks gate every fast path in
# `03_decode_ablation` and `04_prefill_ablation`.

# %%
out.summary()
