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
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: a new runs/<UTC stamp>_<commit>/
SMOKE: bool = False  # tiny CPU run (what the tests run): two ops in the interpreter check
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # seed of the interpreter check's random inputs
CHECKPOINT: str = ""  # checkpoint folder (recorded only; the kernels are benchmarked at DeepSeek-V4-Flash shapes)
GPU: str = "h200"  # results folder under data/results/
HARDWARE: str = "h200-sxm"  # catalogue entry the cost model predicts for
BATCH: int = 1  # decode batch of the rows plotted

# %%
# %matplotlib inline
from dsv4lab import measurements, plots, runs
from dsv4lab.perf import roofline
from dsv4lab.perf.hardware import load_hardware

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("03_decode_ablation", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, SEED=SEED, GPU=GPU,
                                                                 HARDWARE=HARDWARE, BATCH=BATCH))
hw = load_hardware(HARDWARE)
out.table("availability", measurements.availability(GPU))

# %% [markdown]
# ## Committed measurements beside the cost model
#
# Each measured row is set beside the cost model's time for the same kernel and shape, and beside its floor —
# the bytes it must move at the copy bandwidth measured in the same run.

# %%
doc = measurements.load_results_file("decode_kernels", GPU)
if doc is not None:
    print(f"measured on {measurements.provenance(doc)}; copy bandwidth {doc['copy_bw_gbps']:,.0f} GB/s")
    compared = roofline.compare_kernel_results(measurements.results_path("decode_kernels", GPU), hw)["rows"]
    rows = [dict(label=f"{r['kernel']} / {r['variant']}", kernel=r["kernel"], variant=r["variant"],
                 measured_us=r["measured_us"], predicted_us=r["predicted_us"], floor_us=r["floor_us_at_copy_bw"],
                 pct_copy_bw=r["pct_copy_bw"]) for r in compared if r["batch"] == BATCH]
    title = f"Decode kernels (batch {BATCH}): measured on {doc['gpu']} vs the cost model"
else:
    print(f"No committed decode measurements: {measurements.results_path('decode_kernels', GPU)} is absent. "
          "Showing the cost model's predictions only; the measurements come from `dsv4lab bench kernels "
          "--suite decode` on the GPU machine.")
    rows = [dict(label=f"{kernel} (model)", kernel=kernel, variant="model", measured_us=None,
                 predicted_us=p["time_us"], floor_us=p["floor_us"], bytes=p["bytes"])
            for kernel, p in roofline.kernel_predictions(hw, batch=BATCH).items()]
    title = f"Decode kernels (V4-Flash shapes, batch {BATCH}): cost model on {hw.name}, no measurements"
out.keys(decode_measurements_present=doc is not None, rows_plotted=len(rows))
out.table("kernels", rows)

# %%
out.figure(plots.plot_kernel_timings(rows, title=title), "kernels")

# %% [markdown]
# ## The variant ablation
#
# What each idea is worth on this hardware: per kernel, every variant's time and share of the copy bandwidth
# (committed measurements only).

# %%
if doc is not None:
    ablation = sorted(({"kernel": r["kernel"], "variant": r["variant"], "batch": r["batch"], "time_us": r["time_us"],
                        "gbps": r["gbps"], "pct_copy_bw": r["pct_copy_bw"]} for r in doc["rows"]),
                      key=lambda r: (r["kernel"], r["batch"], r["time_us"]))
    best = {}
    for r in ablation:
        best.setdefault((r["kernel"], r["batch"]), r)
    out.data("best_variants", [dict(kernel=k, batch=b, variant=r["variant"], time_us=r["time_us"],
                                    pct_copy_bw=r["pct_copy_bw"]) for (k, b), r in best.items()])
    display_rows = out.table("ablation", ablation)
else:
    display_rows = "no committed measurements: nothing to ablate on this machine"
display_rows

# %% [markdown]
# ## Fresh measurements (GPU only)

# %%
fresh = measurements.fresh_benchmark("kernels", ["--suite", "decode"],
                                     out.work_dir(create=False) / "decode_kernels.json")
print(fresh["message"])
out.keys(fresh_measurement=fresh["status"])
if fresh["status"] == "measured":
    fresh_rows = roofline.compare_kernel_results(fresh["path"], hw)["rows"]
    out.table("fresh", fresh_rows)
    out.figure(plots.plot_kernel_timings(
        [dict(label=f"{r['kernel']} / {r['variant']}", measured_us=r["measured_us"], predicted_us=r["predicted_us"],
              floor_us=r["floor_us_at_copy_bw"]) for r in fresh_rows if r["batch"] == BATCH],
        title=f"Decode kernels, batch {BATCH}: fresh measurements"), "fresh")

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
