# %% [markdown]
# # 03 · Decode kernels: variants, measurements and the cost model
#
# As reported by the paper, decode on MI250 went from 20.1 to 74.5 tok/s through packed FP4 weights, INT8
# activation quantization with integer dot products, a peer-read all-reduce and launch geometry — yet the final
# step still ran at only about 14% of the bandwidth roofline, and its routed-MoE stage at about 24% of peak.
# dsv4lab's decode kernels make each idea a switchable variant (dequantize-and-FMA, the paper's INT8 route,
# `tl.dot_scaled`; launch geometry as a parameter), every one gated by the correctness harness and timed on an
# H200 against the bytes it must move.
#
# On a CPU this notebook plots the **committed** H200 measurements (`data/results/h200/decode_kernels.json`) when
# they exist, and says so when they do not; it takes **fresh** measurements only when a GPU is present. Either way
# it sets the cost model's prediction beside each kernel and runs the one check a CPU can: the Triton kernels
# against the reference under the interpreter.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/03_decode_ablation/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (what the tests run): two ops in the interpreter check
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # seed of the interpreter check's random inputs
CHECKPOINT: str = ""  # checkpoint folder (recorded only; the kernels are benchmarked at DeepSeek-V4-Flash shapes)
GPU: str = "h200"  # results folder under data/results/
HARDWARE: str = "h200-sxm"  # catalogue entry the cost model predicts for
BATCH: int = 1  # decode batch of the rows plotted

# %%
# %matplotlib inline
from dsv4lab.faces import figure_data, measurements, plots, runs
from dsv4lab.tools.perf.hardware import load_hardware

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("03_decode_ablation", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, SEED=SEED, GPU=GPU,
                                                                 HARDWARE=HARDWARE, BATCH=BATCH))
hw = load_hardware(HARDWARE)
out.table("availability", measurements.availability(GPU))

# %% [markdown]
# ## Committed measurements beside the cost model
#
# One row per kernel at the real DeepSeek-V4-Flash shapes: the best of its own (Triton) variants, the other
# variants, cuBLAS and a plain `torch.sum` read of the same bytes where the benchmark has them (all measured),
# the cost model's time (modelled), and the floor — the kernel's bytes at the copy bandwidth measured in the same
# run. The column on the right is the best variant's share of that bandwidth.

# %%
doc = measurements.load_results_file("decode_kernels", GPU)
rows = figure_data.decode_kernels(doc, hw, BATCH)
if doc is not None:
    print(f"measured on {measurements.provenance(doc)}; copy bandwidth {doc['copy_bw_gbps']:,.0f} GB/s")
    where = dict(measured=measurements.provenance(doc),
                 modelled=f"cost model on {hw.name} at the run's copy bandwidth")
    title = f"Decode kernels on the {doc['gpu']}, batch {BATCH}: the best of each kernel's variants vs the cost model"
else:
    print(f"No committed decode measurements: {measurements.results_path('decode_kernels', GPU)} is absent; "
          "they come from `dsv4lab bench kernels --suite decode` on the GPU machine.")
    where = dict(modelled=f"cost model on {hw.name}")
    title = f"Decode kernels, batch {BATCH}: the cost model on {hw.name} (nothing measured yet)"
out.keys(decode_measurements_present=doc is not None, kernels_plotted=len(rows))
out.table("kernels", rows, ["label", "best_variant", "best_us", "library_us", "modelled_us", "floor_us",
                            "pct_copy_bw", "variants"])

# %%
missing_note = None if doc is not None else (f"not measured yet: {measurements.results_path('decode_kernels', GPU).name} "
                                             "is absent (dsv4lab bench kernels --suite decode)")
out.figure(plots.plot_decode_kernels(rows, title=title, where=where, missing_note=missing_note), "kernels")

# %% [markdown]
# ## The variant ablation
#
# What each idea is worth on this hardware: per kernel, its three fastest variants with their share of the copy
# bandwidth (every variant is in `results/03_decode_ablation_ablation.csv`).

# %%
if doc is not None:
    out.table("ablation", sorted(({"kernel": r["kernel"], "variant": r["variant"], "batch": r["batch"],
                                   "route": r.get("route"), "time_us": r["time_us"], "gbps": r["gbps"],
                                   "pct_copy_bw": r["pct_copy_bw"]} for r in doc["rows"]),
                                 key=lambda r: (r["kernel"], r["batch"], r["time_us"])))
    top = out.table("top_variants", figure_data.decode_variant_table(doc, BATCH, top=3))
else:
    top = runs.Table([dict(note="no committed measurements: nothing to ablate on this machine")])
top

# %% [markdown]
# ## Steps that carry more than one token
#
# The whole decode step of the committed end-to-end run (`data/results/<gpu>/e2e_1gpu.json`, `bench e2e`): tok/s and
# MBU at batch 1…32; the verify step of `k` drafts (k+1 tokens, the MTP block included) and the whole speculative
# cycle against the one-token step, beside the bytes ratios of the same steps (a step at the bandwidth limit costs
# its bytes ratio); speculative throughput with injected acceptance α against plain greedy of the same run (every
# output checked equal to plain greedy). Empty tables: the run did not measure that part. Last, the decode step's fused
# paths timed off, alone and all on (`--fusion-batches`): tok/s, speedup over off, launches per layer, ids equal to
# the unfused step's, and the paths the run recommends for the GPU's tuned file.

# %%
e2e_doc = measurements.load_results_file("e2e_1gpu", GPU)
multi = figure_data.multitoken_tables(e2e_doc)
if e2e_doc is not None:
    print(f"end-to-end run: {measurements.provenance(e2e_doc)}")
else:
    print(f"No committed end-to-end run: {measurements.results_path('e2e_1gpu', GPU)} is absent "
          "(dsv4lab bench e2e --nproc 1 --layers 30 on the GPU machine).")
out.keys(e2e_batches=len(multi["batches"]), e2e_verify_rows=len(multi["verify"]),
         e2e_speculative_rows=len(multi["speculative"]))
for name, table in multi.items():
    out.table(f"multitoken_{name}", table or [dict(note=f"{name}: not in the committed run")])
# the fused paths of the decode step (off, each alone, all on; A-B-B-A against off) and the ones the run recommends
fusions = figure_data.fusion_table(e2e_doc)
out.keys(e2e_fusion_rows=len(fusions))
out.table("fused_paths", fusions or [dict(note="fused paths: not timed in the committed run "
                                              "(bench e2e --fusion-batches)")])

# %% [markdown]
# ## Fresh measurements (GPU only)

# %%
fresh = measurements.fresh_benchmark("kernels", ["--suite", "decode"],
                                     out.work_dir(create=False) / "decode_kernels.json")
print(fresh["message"])
out.keys(fresh_measurement=fresh["status"])
if fresh["status"] == "measured":
    fresh_doc = measurements.load_results_file("decode_kernels", path=fresh["path"])
    fresh_rows = figure_data.decode_kernels(fresh_doc, hw, BATCH)
    out.table("fresh", fresh_rows)
    out.figure(plots.plot_decode_kernels(fresh_rows, title=f"Decode kernels, batch {BATCH}: fresh measurements",
                                         where=dict(measured=measurements.provenance(fresh_doc),
                                                    modelled=f"cost model on {hw.name}")), "fresh")

# %% [markdown]
# ## The check a CPU can run: decode kernels under the Triton interpreter
#
# The same kernels, on small irregular shapes, against the reference (the kernel tier of `02_correctness`).
# Timing under the interpreter means nothing; correctness does.

# %%
decode_ops = ["moe_stage2", "linear_fp8"] if SMOKE else ["moe_stage1", "moe_stage2", "routed_experts", "linear_fp8",
                                                           "linear_fp4", "sparse_attention", "indexer_scores"]
check = measurements.kernel_checks("triton", decode_ops, seed=SEED, max_shapes=1)
print(f"triton backend: {check['status']} — {check['message']}")
out.keys(interpreter_check=check["status"],
         interpreter_failed_checks=sum(not r["ok"] for r in check["rows"]) if check["rows"] else None)
out.table("interpreter_check", measurements.check_rows_summary(check["rows"]))
