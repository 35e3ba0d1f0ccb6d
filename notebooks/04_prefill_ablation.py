# %% [markdown]
# # 04 · Prefill kernels: grouped FP4 MoE, FP8 GEMM, sparse attention, chunking
#
# As reported by the paper, prefill of a 4,604-token prompt on four MI250 GCDs went from 1,336 to 2,234 input
# tok/s through MFMA routed-MoE kernels, kernel geometry, chunked prefill of 2,048 tokens and a 64-row expert
# sorter (a 32 → 64-row change worth −18.2% on the M=2048 MoE kernels, with bitwise-identical outputs). dsv4lab's
# prefill path is a grouped FP4 MoE GEMM with expert sorting, an FP8 block-scaled GEMM and sparse prefill
# attention, benchmarked for M = 512…8192 tokens on an H200 against the matrix peak measured in the same run.
#
# Like `03_decode_ablation`: committed measurements (`data/results/h200/prefill_kernels.json`) when present,
# fresh ones on a GPU, the cost model always, and the interpreter check on a CPU.

# %% tags=["parameters"]
RUN_DIR: str = ""  # run folder for results/ and figures/; empty: scratch/04_prefill_ablation/ (replaced at the next run)
SMOKE: bool = False  # tiny CPU run (what the tests run): fewer prompt lengths and interpreter checks
INTERACTIVE: bool = False  # show the interactive widgets (this notebook has none)
SEED: int = 0  # seed of the interpreter check's random inputs
CHECKPOINT: str = ""  # checkpoint folder (recorded only; the kernels are benchmarked at DeepSeek-V4-Flash shapes)
GPU: str = "h200"  # results folder under data/results/
HARDWARE: str = "h200-sxm"  # catalogue entry the cost model predicts for
PROMPT_TOKENS: int = 4604  # the paper's prompt length, for the chunk-size account

# %%
# %matplotlib inline
from dsv4lab.faces import figure_data, measurements, plots, runs
from dsv4lab.core.config import get_preset
from dsv4lab.tools.perf import account as perf_account
from dsv4lab.tools.perf.hardware import load_hardware

ckpt = runs.resolve_checkpoint(CHECKPOINT)
out = runs.notebook_outputs("04_prefill_ablation", RUN_DIR, dict(checkpoint=ckpt, SMOKE=SMOKE, SEED=SEED, GPU=GPU,
                                                                  HARDWARE=HARDWARE, PROMPT_TOKENS=PROMPT_TOKENS))
flash = get_preset("flash")
hw, mi250 = load_hardware(HARDWARE), load_hardware("mi250-gcd")
out.table("availability", measurements.availability(GPU))

# %% [markdown]
# ## Throughput against prompt length
#
# One panel per kernel, its best variants (the rest are counted in the panel and kept in the CSV), against the
# matrix peaks measured in the same run. Without committed measurements: the cost model's whole-prefill rate
# (FLOPs per token × predicted tokens per second) on the H200 and on the paper's MI250 TP4, said so in the figure.

# %%
doc = measurements.load_results_file("prefill_kernels", GPU)
if doc is not None:
    print(f"measured on {measurements.provenance(doc)}")
    rows = [dict(r) for r in doc["rows"]]
    where = dict(measured=measurements.provenance(doc))
    title = f"Prefill kernels on the {doc['gpu']}: TFLOP/s against prompt length"
    missing_note = None
else:
    print(f"No committed prefill measurements: {measurements.results_path('prefill_kernels', GPU)} is absent; they "
          "come from `dsv4lab bench kernels --suite prefill` on the GPU machine.")
    rows = figure_data.prefill_model_rows(hw, (512, 4096) if SMOKE else (512, 1024, 2048, 4096, 8192))
    where = dict(modelled=f"cost model on {hw.name} and mi250-gcd")
    title = "Prefill throughput per GPU: the cost model (nothing measured yet)"
    missing_note = "measured kernels: not measured yet (dsv4lab bench kernels --suite prefill)"
out.keys(prefill_measurements_present=doc is not None)
out.table("throughput", rows)
out.figure(plots.plot_prefill_throughput(rows, peaks=figure_data.prefill_peaks(doc, hw), names=figure_data.KERNEL_NAMES,
                                         title=title, where=where, missing_note=missing_note), "throughput")

# %% [markdown]
# ## Chunked prefill: where the time goes, and how far the model is from the paper
#
# The cost model's prefill of the paper's prompt on MI250 TP4 at several chunk sizes (the paper moved from
# 512/1024 to 2,048-token chunks), and on the H200 in one pass. The bars are the model's penalty terms; the
# columns print the paper's reported rate beside the model's and their ratio. The model is about four times the
# paper at chunk 2,048: it runs the GEMMs at peak matrix rates, while the paper's M=2048 MoE kernels reach a small
# fraction of the INT8 peak (`05_roofline`, `perf.account.paper_prefill_account`) — the model misses a cost the
# paper's kernels paid.

# %%
chunks = (512, 2048) if SMOKE else (512, 1024, 2048, None)
account = figure_data.prefill_chunk_account(hw, PROMPT_TOKENS, chunks)  # the paper's setting, as 06's account
out.table("chunk_account", [dict(label=a["label"], modelled_input_tok_s=a["tokens"] * 1e6 / sum(a["components_us"].values()),
                                 reported_input_tok_s=a.get("reported_rate"),
                                 modelled_ms=sum(a["components_us"].values()) / 1e3) for a in account])
out.figure(plots.plot_step_waterfall(account, title=f"Prefill of {PROMPT_TOKENS:,} tokens: modelled time by term, "
                                                    "beside the paper's reported rate (input tok/s)",
                                     unit="ms", rate_unit="input tok/s",
                                     where=dict(modelled="cost model on mi250-gcd (TP4, the paper's layout) and "
                                                         f"{hw.name}",
                                                reported="the paper's final prefill, 2,234 input tok/s (TTFT 2.061 s)")),
           "chunks")

# %% [markdown]
# ## The expert-sorter ablation
#
# Reported by the paper for the M=2048 routed-MoE kernels: 32 → 64 rows per sorted expert block. Our measured
# grouped-MoE rows at 2,048 tokens appear beside it, per sorter block, when the committed results carry them.

# %%
micro = perf_account.load_paper("microbenchmarks")["entries"]["routed_moe_prefill_m2048"]
sorter = [dict(source="reported by the paper (MI250)", sorter_rows=rows_, gate_up_ms=g, down_ms=d)
          for rows_, g, d in zip((32, 64), micro["gate_up_ms"], micro["down_ms"])]
if doc is not None:
    sorter += [dict(source=f"measured ({doc['gpu']})", sorter_rows=r.get("sorter_rows"), kernel=r["kernel"],
                    variant=r["variant"], tokens=r.get("tokens"), time_ms=float(r["time_us"]) / 1e3)
               for r in doc["rows"] if r["kernel"] == "moe_grouped_gemm" and r.get("tokens") == 2048
               and r.get("sorter_rows") is not None]
out.table("sorter", sorter)

# %% [markdown]
# ## What the measurements chose, and the targets
#
# The prefill benchmark (issue 18) also times each FP8 projection beside cuBLAS `_scaled_mm` with the same block
# scales, and writes the settings its measurements pick (`choices`: chunk size per prompt length, MoE route /
# decode / sorter rows, GEMM backend — read back by `dsv4lab.engine.dispatch` from that GPU's tuned file) and
# the targets as measured. Results files from before issue 18 carry neither; the tables are then empty.

# %%
measured = doc or {}
gemm_side_by_side = [dict(r) for r in measured.get("rows", []) if r["kernel"] == "fp8_gemm"
                     and (r["variant"].endswith(":cublas") or ":triton:" in r["variant"])]
out.table("fp8_gemm_vs_cublas", gemm_side_by_side)
choices = measured.get("choices", {})
out.table("choices", [dict(setting=k, value=str(v), why=choices.get("why", {}).get(k.split("_")[0], ""))
                      for k, v in choices.items() if k != "why"])
targets = measured.get("targets", {})
out.table("targets", [dict(target=k, measured=str(v)) for k, v in targets.items()])

# %% [markdown]
# ## Fresh measurements (GPU only) and the interpreter check (CPU)

# %%
fresh = measurements.fresh_benchmark("kernels", ["--suite", "prefill"],
                                     out.work_dir(create=False) / "prefill_kernels.json")
print(fresh["message"])
out.keys(fresh_measurement=fresh["status"])
if fresh["status"] == "measured":
    fresh_doc = measurements.load_results_file("prefill_kernels", path=fresh["path"])
    out.table("fresh", fresh_doc["rows"])
    out.figure(plots.plot_prefill_throughput(fresh_doc["rows"], peaks=figure_data.prefill_peaks(fresh_doc, hw),
                                             names=figure_data.KERNEL_NAMES, title="Prefill kernels: fresh measurements",
                                             where=dict(measured=measurements.provenance(fresh_doc))), "fresh")
prefill_ops = ["moe_stage1", "sparse_attention"] if SMOKE else ["moe_stage1", "moe_stage2", "routed_experts",
                                                                 "linear_fp8", "sparse_attention"]
check = measurements.kernel_checks("triton", prefill_ops, seed=SEED, max_shapes=1)
print(f"triton backend: {check['status']} — {check['message']}")
out.keys(interpreter_check=check["status"],
         interpreter_failed_checks=sum(not r["ok"] for r in check["rows"]) if check["rows"] else None)
out.table("interpreter_check", measurements.check_rows_summary(check["rows"]))
